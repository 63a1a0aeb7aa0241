"""The survivable control plane over real SSH: a flood counted line by line, an SSH session
killed under a running job, link cuts shorter and longer than node_timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import orchestrator
from orchestrator.store import Store
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import (
    PYTHON,
    WORKERS,
    assert_no_job_processes,
    job_processes,
    wait_for,
    wait_for_output,
)

STEPS = [PYTHON, str(WORKERS / "steps.py")]


def rank_log(job_id: str, rank: int, attempt: int = 1) -> list[str]:
    return (Store().log_dir(job_id, attempt) / f"rank-{rank}.log").read_text().splitlines()


def steps_of(lines: list[str], rank: int) -> list[int]:
    return [int(m.group(1)) for ln in lines if (m := re.fullmatch(rf"step {rank} (\d+)", ln))]


def _stat(pid: int) -> tuple[str, int]:
    text = Path(f"/proc/{pid}/stat").read_text()
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text.rsplit(")", 1)[1].split()[1])


def relay_sshd_on(host) -> int:
    """The sshd process serving the channel to ``host``'s agent (its relay's ancestor)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"import agents.main" not in cmdline:  # the bootstrap
            continue
        netns = subprocess.run(["ip", "netns", "identify", entry], capture_output=True,
                               text=True).stdout.strip()
        if netns != host.netns:
            continue
        pid = int(entry)
        while pid > 1:
            comm, parent = _stat(pid)
            if comm == "sshd":
                return pid
            pid = parent
    raise AssertionError(f"no relay found on {host.netns}")


def test_flood_over_ssh_keeps_every_line(cluster, home, tmp_path):
    n = 50_000
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "flood.py")], hosts=cluster.hosts[:2],
        env={"FLOOD_LINES": str(n), "FLOOD_WIDTH": "80"}))
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    for rank in range(4):
        lines = rank_log(job_id, rank)
        assert len(lines) == n + 1 and lines[-1] == f"flood {rank} done {n}"
        assert [int(ln.split()[2]) for ln in lines[:-1]] == list(range(n))
    assert_no_job_processes(job_id)


def test_killed_ssh_session_costs_no_restart_and_no_line(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, STEPS, hosts=cluster.hosts[:2], nproc_per_node=1,
        env={"STEPS": "80", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 10", 1)
    os.kill(relay_sshd_on(cluster.hosts[1]), signal.SIGKILL)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (1, 0)
    for rank in (0, 1):
        assert steps_of(rank_log(job_id, rank), rank) == list(range(80))
    history = [e["state"] for e in result["nodes"][1]["history"]]
    assert "UNREACHABLE" in history and "LOST" not in history, history
    assert_no_job_processes(job_id)


def test_link_cut_shorter_than_node_timeout_costs_no_restart(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, STEPS, hosts=cluster.hosts[:2], nproc_per_node=1,
        env={"STEPS": "100", "STEP_SLEEP": "0.05"},
        health={"heartbeat_interval": 0.5, "node_timeout": 8}))
    wait_for_output(job_id, "step 1 10", 1)
    cluster.link_down(1)
    try:
        time.sleep(3)
    finally:
        cluster.link_up(1)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (1, 0)
    for rank in (0, 1):
        assert steps_of(rank_log(job_id, rank), rank) == list(range(100))
    assert_no_job_processes(job_id)


def _attempt_processes(job_id: str, attempt: int) -> list[int]:
    needle = f"ORCHESTRATOR_ATTEMPT={attempt}".encode()
    found = []
    for pid in job_processes(job_id):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_long_link_cut_loses_the_node_and_its_old_workers_go_before_it_rejoins(
        cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], nnodes="2:3",
        nproc_per_node=1, max_restarts=2, restart_backoff={"initial": 0.1, "max": 0.2},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}, ssh={"connect_timeout": 2}))
    wait_for_output(job_id, "sleeping", 3)
    cluster.link_down(2)
    try:
        wait_for(lambda: orchestrator.status(job_id)["attempt"] == 2, 30, what="attempt 2")
        status = orchestrator.status(job_id)
        assert status["attempts"][0]["failure"]["cause"] == "NODE_FAIL"
        assert status["nodes"][2]["state"] == "LOST"
        # Node 2's agent outlives the cut with its attempt-1 worker (controller_grace).
        assert _attempt_processes(job_id, 1), "the cut-off worker should still run"
    finally:
        cluster.link_up(2)
    wait_for(lambda: orchestrator.status(job_id)["nodes"][2]["state"] == "CONNECTED", 60,
             what="node 2 rejoins")
    assert not _attempt_processes(job_id, 1), "old workers must be gone before a rejoin"
    history = [e["message"] or "" for e in orchestrator.status(job_id)["nodes"][2]["history"]]
    assert any("stopped first" in m for m in history), history
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id, within=15)
