"""The survivable control plane on the local transport: floods counted line by line, dropped
channels, a killed controller replaced with the job going on, a controller gone for good,
and the spool's cap. Every test counts exactly what reached the logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import orchestrator
from orchestrator.store import Store
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)

FLOOD = [PYTHON, str(WORKERS / "flood.py")]
STEPS = [PYTHON, str(WORKERS / "steps.py")]


def spec(tmp_path, command, *, nodes=2, nproc=2, **extra):
    return write_spec(tmp_path, {
        "name": "cplane", "nodes": [{"host": "local"}] * nodes, "nproc_per_node": nproc,
        "command": command, "workdir": str(tmp_path), "stop_grace_period": 2, **extra})


def rank_log(job_id: str, rank: int, attempt: int = 1) -> list[str]:
    path = Store().log_dir(job_id, attempt) / f"rank-{rank}.log"
    return path.read_text().splitlines()


def combined(job_id: str, attempt: int = 1) -> list[str]:
    return (Store().log_dir(job_id, attempt) / "combined.log").read_text().splitlines()


def peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def steps_of(lines: list[str], rank: int) -> list[int]:
    return [int(m.group(1)) for ln in lines if (m := re.fullmatch(rf"step {rank} (\d+)", ln))]


def kill_controller_and_supervisor(job_id: str) -> None:
    c = orchestrator.status(job_id)["controller"]
    os.kill(c["supervisor_pid"], signal.SIGKILL)  # first, or it would start a new one
    os.kill(c["pid"], signal.SIGKILL)
    wait_for(lambda: orchestrator.status(job_id)["controller"]["alive"] is False, 10,
             what="controller dead")


def run_cli(*args, timeout=60):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_flood_keeps_every_line_in_order_with_bounded_memory(home, tmp_path):
    n = 100_000
    job_id = orchestrator.submit(spec(tmp_path, FLOOD, env={
        "FLOOD_LINES": str(n), "FLOOD_STREAM": "both", "FLOOD_WIDTH": "60"}))
    peaks: dict[str, float] = {"controller": 0.0, "agent": 0.0}
    done = threading.Event()

    def sample() -> None:  # VmHWM is a peak already; sample until the job ends
        while not done.is_set():
            try:
                s = orchestrator.status(job_id)
            except Exception:
                continue
            if s["controller"]["pid"]:
                peaks["controller"] = max(peaks["controller"], peak_rss_mib(s["controller"]["pid"]))
            for node in s["nodes"]:
                if node["agent_pid"]:
                    peaks["agent"] = max(peaks["agent"], peak_rss_mib(node["agent_pid"]))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = orchestrator.wait(job_id, timeout=180)
    finally:
        done.set()
        sampler.join()
    assert result["state"] == "SUCCEEDED", result["failure"]
    for rank in range(4):
        lines = rank_log(job_id, rank)
        # One file per rank, in arrival order: stdout (even) and stderr (odd) interleave.
        out = [ln for ln in lines if ln.split()[2] == "done" or int(ln.split()[2]) % 2 == 0]
        err = [ln for ln in lines if ln.split()[2] != "done" and int(ln.split()[2]) % 2 == 1]
        assert len(lines) == n + 1
        expected_out = [f"flood {rank} {i} " for i in range(0, n, 2)]
        assert [ln[:len(e)] for ln, e in zip(out[:-1], expected_out, strict=True)] == expected_out
        assert len(out) == n // 2 + 1 and out[-1] == f"flood {rank} done {n}"
        assert [int(ln.split()[2]) for ln in err] == list(range(1, n, 2))
    assert len(combined(job_id)) == 4 * (n + 1)
    # Bounded: the agent holds at most a window of unacknowledged output, the controller
    # at most that per node (their RSS at rest is about 40 and 15 MiB).
    assert 0 < peaks["controller"] < 200, peaks
    assert 0 < peaks["agent"] < 100, peaks
    assert_no_job_processes(job_id)


def test_exit_is_never_lost_behind_a_flood(home, tmp_path):
    n = 50_000
    job_id = orchestrator.submit(spec(tmp_path, FLOOD, nodes=1, env={
        "FLOOD_LINES": str(n), "FLOOD_EXIT": "7"}))
    result = orchestrator.wait(job_id, timeout=120)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["exit_code"] == 7, failure
    lines = rank_log(job_id, failure["rank"])
    assert lines == [f"flood {failure['rank']} {i}" for i in range(n)] + [
        f"flood {failure['rank']} done {n}"]
    assert_no_job_processes(job_id)


def test_dropped_channels_reattach_without_a_restart(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, STEPS, nproc=1,
                                      env={"STEPS": "60", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 10", 1)
    controller = orchestrator.status(job_id)["controller"]["pid"]
    relays = [pid for pid in _children(controller)  # the bootstrap imports agents.main
              if b"import agents.main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(relays) == 2, relays
    for pid in relays:  # both channels drop; the agents and workers carry on
        os.kill(pid, signal.SIGKILL)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (1, 0)
    for rank in (0, 1):
        assert steps_of(rank_log(job_id, rank), rank) == list(range(60))
    for node in result["nodes"]:
        states = [e["state"] for e in node["history"]]
        assert "UNREACHABLE" in states and "LOST" not in states, node["history"]
    assert_no_job_processes(job_id)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_killed_controller_is_replaced_and_the_job_goes_on(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, STEPS,
                                      env={"STEPS": "80", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 3 10", 1)
    first = orchestrator.status(job_id)["controller"]
    os.kill(first["pid"], signal.SIGKILL)
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)
    assert result["controller"]["pid"] != first["pid"]
    for rank in range(4):  # the lines printed with no controller attached are all there
        assert steps_of(rank_log(job_id, rank), rank) == list(range(80))
    assert len([ln for ln in combined(job_id) if "step " in ln]) == 4 * 80
    assert_no_job_processes(job_id)


def test_resume_by_hand(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, STEPS,
                                      env={"STEPS": "60", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 3 5", 1)
    kill_controller_and_supervisor(job_id)
    shown = orchestrator.status(job_id)
    assert shown["state"] == "UNKNOWN" and shown["recorded_state"] == "RUNNING"
    assert job_processes(job_id), "the workers must outlive their controller"
    resumed = run_cli("resume", job_id)
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    again = run_cli("resume", job_id)
    assert again.returncode == 0 and "already has a controller" in again.stdout, again.stdout
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (1, 0)
    for rank in range(4):
        assert steps_of(rank_log(job_id, rank), rank) == list(range(60))
    ended = run_cli("resume", job_id)
    assert ended.returncode == 2 and "already ended" in ended.stderr
    assert_no_job_processes(job_id)


def test_controller_gone_for_good_stops_workers_then_resume_restarts_free(home, tmp_path):
    marker = tmp_path / "second-run"
    job_id = orchestrator.submit(spec(
        tmp_path, ["sh", "-c", f'test -e {marker} && exec "$0" "$@"; touch {marker}; '
                               'STEPS=1000 exec "$0" "$@"', *STEPS],
        nproc=1, health={"controller_grace": 2}, env={"STEPS": "20", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 3", 1)
    kill_controller_and_supervisor(job_id)
    # The agents give up after controller_grace: every worker is stopped, nothing is left.
    assert_no_job_processes(job_id, within=15)
    shown = orchestrator.status(job_id)
    assert shown["state"] != "RUNNING" and shown["controller"]["alive"] is False
    assert orchestrator.resume(job_id)["resumed"] is True
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["attempt"] == 2 and result["restarts"] == 0 and result["free_restarts"] == 1
    lost = result["attempts"][0]["failure"]
    assert lost["cause"] == "CONTROLLER_LOST" and "not charged" in lost["message"], lost
    for rank in (0, 1):
        assert steps_of(rank_log(job_id, rank, attempt=2), rank) == list(range(20))
    assert_no_job_processes(job_id)


def test_spool_overflow_reports_the_lines_not_kept(home, tmp_path):
    n = 50_000
    go = tmp_path / "go"
    job_id = orchestrator.submit(spec(tmp_path, STEPS, nodes=1, nproc=1, spool_max_bytes=100_000,
                                      env={"GO_FILE": str(go), "FLOOD_LINES": str(n),
                                           "STEPS": "5", "STEP_SLEEP": "0.01"}))
    wait_for_output(job_id, "rank 0 waiting", 1)
    kill_controller_and_supervisor(job_id)
    go.touch()  # the flood happens with no controller attached
    time.sleep(2)
    assert orchestrator.resume(job_id)["resumed"] is True
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    lines = rank_log(job_id, 0)
    markers = [ln for ln in lines if ln.startswith("[orchestrator] ")]
    assert len(markers) == 1 and "were not kept" in markers[0], markers
    not_kept = int(markers[0].split()[1])
    kept = [ln for ln in lines if ln.startswith(("flood ", "step ", "steps "))]
    assert 0 < not_kept < n and len(kept) + not_kept == n + 5 + 1
    flood = [int(ln.split()[2]) for ln in kept if ln.startswith("flood ")]
    assert flood == sorted(flood) and len(set(flood)) == len(flood)
    assert_no_job_processes(job_id)


def test_sigterm_without_cancel_leaves_the_job_to_its_agents(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, STEPS, nproc=1,
                                      env={"STEPS": "60", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 5", 1)
    c = orchestrator.status(job_id)["controller"]
    os.kill(c["supervisor_pid"], signal.SIGTERM)  # e.g. the submitting host shuts down
    wait_for(lambda: orchestrator.status(job_id)["controller"]["alive"] is False, 15,
             what="controller and supervisor gone")
    status = orchestrator.status(job_id)
    assert status["recorded_state"] == "RUNNING" and job_processes(job_id)
    assert orchestrator.resume(job_id)["resumed"] is True
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED" and (result["attempt"], result["restarts"]) == (1, 0)
    for rank in (0, 1):
        assert steps_of(rank_log(job_id, rank), rank) == list(range(60))
    assert_no_job_processes(job_id)


def test_many_nodes_and_restarts_in_a_row_keep_every_line_of_every_attempt(home, tmp_path):
    """8 nodes x 2 ranks, each flooding 5,000 lines; rank 5 crashes in attempts 1 to 3 after
    its flood, and attempt 4 succeeds: every line of every attempt is there, exactly once."""
    n, nodes, nproc = 5000, 8, 2
    script = tmp_path / "crashy.py"
    script.write_text(
        "import os, sys\n"
        "rank, attempt = os.environ['RANK'], int(os.environ['ORCHESTRATOR_ATTEMPT'])\n"
        f"sys.stdout.write(''.join(f'flood {{rank}} {{attempt}} {{i}}\\n' for i in range({n})))\n"
        "sys.stdout.flush()\n"
        "if rank == '5' and attempt < 4:\n    sys.exit(9)\n"
        "import time; time.sleep(0.5 if attempt < 4 else 0)\n")
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(script)], nodes=nodes, nproc=nproc,
                                      max_restarts=3, stop_grace_period=5,
                                      restart_backoff={"initial": 0.1, "max": 0.1}))
    result = orchestrator.wait(job_id, timeout=240)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (4, 3)
    # Rank 5 always finishes its flood; the others may be stopped mid-flood in a failed
    # attempt, so there they must hold a prefix, in order, with nothing missing or doubled.
    def lines_of(rank: int, attempt: int) -> list[str]:  # a rank stopped before it printed
        try:                                              # has no file
            return rank_log(job_id, rank, attempt)
        except FileNotFoundError:
            return []

    for attempt in range(1, 5):
        for rank in range(nodes * nproc):
            lines = lines_of(rank, attempt)
            # A rank stopped in the middle of a write leaves what it wrote of its last line
            # ("flood "): kept as written, and it must be the start of the next line.
            if lines and len(lines[-1].split()) < 4:
                cut = lines.pop()
                assert f"flood {rank} {attempt} {len(lines)}".startswith(cut), (attempt, rank)
                assert attempt < 4 and rank != 5, (attempt, rank, cut)
            got = [int(ln.split()[3]) for ln in lines]
            assert got == list(range(len(got))), (attempt, rank)
            if attempt == 4 or rank == 5:
                assert len(got) == n, (attempt, rank, len(got))
        assert len(combined(job_id, attempt)) == sum(
            len(lines_of(r, attempt)) for r in range(nodes * nproc))
    assert_no_job_processes(job_id)
