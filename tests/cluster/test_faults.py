"""Fault injection on the namespace cluster: real sshd, real torch gloo, real signals and cut
links. Every test ends by checking that no process of its job is left on any node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec, final_digests
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
)

TRAIN = [PYTHON, str(ROOT / "examples" / "ddp_train.py"), "--samples", "128"]
FAST = {"restart_backoff": {"initial": 0.1, "max": 0.2}}


def running(job_id, nranks):
    def check():
        s = orchestrator.status(job_id)
        return s if (s["state"] == "RUNNING" and len(s["ranks"]) == nranks and
                     all(r["state"] == "RUNNING" for r in s["ranks"])) else None
    return wait_for(check, 60, what=f"{nranks} ranks RUNNING")


def test_crash_once_resumes_and_matches_an_uncrashed_run(cluster, home, tmp_path):
    hosts = cluster.hosts[:2]
    ref = orchestrator.submit(cluster_spec(cluster, tmp_path, [*TRAIN, "--epochs", "3"],
                                           hosts=hosts))
    assert orchestrator.wait(ref, timeout=180)["state"] == "SUCCEEDED"
    assert len({d for _, d in final_digests(ref).values()}) == 1

    marker = tmp_path / "crashed"
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [*TRAIN, "--epochs", "3", "--crash-rank", "3", "--crash-epoch", "1",
                            "--crash-marker", str(marker)],
        hosts=hosts, max_restarts=2, **FAST))
    result = orchestrator.wait(job_id, timeout=240)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"]) == (2, 1)
    first = result["attempts"][0]["failure"]
    assert (first["rank"], first["exit_code"], first["node_rank"]) == (3, 13, 1)
    assert "rank 3: injected crash in epoch 1" in first["stderr_tail"]
    resumed = list(orchestrator.logs(job_id, attempt=2, rank=0))
    assert any("resumed from" in ln and "at epoch 1" in ln for ln in resumed), resumed
    assert len({d for _, d in final_digests(job_id).values()}) == 1
    # Equal to the uncrashed run's weights (up to float rounding: see examples/ddp_train.py).
    import torch

    expected = torch.load(tmp_path / "checkpoints" / ref / "final.pt")
    got = torch.load(tmp_path / "checkpoints" / job_id / "final.pt")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(expected[key], got[key], rtol=1e-5, atol=1e-7), key
    assert_no_job_processes(job_id)


def test_always_crashing_rank_fails_after_max_restarts_plus_one(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")], hosts=cluster.hosts[:2],
        env={"FAIL_RANK": "2", "FAIL_CODE": "5", "FAIL_AFTER": "0.2"}, max_restarts=2, **FAST))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "FAILED"
    assert len(result["attempts"]) == 3 and result["restarts"] == 2
    assert all(a["failure"]["rank"] == 2 for a in result["attempts"])
    failure = result["failure"]
    assert failure["rank"] == 2 and failure["exit_code"] == 5 and failure["restarts_exhausted"]
    assert "max_restarts reached" in failure["message"]
    assert_no_job_processes(job_id)


def test_sigkilled_worker_restarts_the_group(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        max_restarts=1, **FAST))
    status = running(job_id, 4)
    victim = next(r for r in status["ranks"] if r["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: orchestrator.status(job_id)["attempt"] == 2, 30, what="attempt 2")
    status = running(job_id, 4)
    first = status["attempts"][0]["failure"]
    assert first["rank"] == 1 and first["signal"] == "SIGKILL" and first["exit_code"] is None
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)


def test_worker_ignoring_sigterm_is_killed_after_grace(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        env={"IGNORE_SIGTERM": "1", "SPAWN_GRANDCHILD": "1"}, stop_grace_period=1))
    running(job_id, 4)
    wait_for_output(job_id, "sleeping", 4)  # SIGTERM is ignored from here on
    started = time.monotonic()
    result = orchestrator.cancel(job_id)
    assert result["state"] == "CANCELLED"
    assert 1 <= time.monotonic() - started < 10
    assert {r["signal"] for r in result["ranks"]} == {"SIGKILL"}
    assert_no_job_processes(job_id)


def test_hung_job_is_detected(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        health={"hang_timeout": 2}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "HUNG"
    assert "hang_timeout" in result["failure"]["message"]
    assert_no_job_processes(job_id)


def test_heartbeat_api_keeps_a_quiet_job_alive(cluster, home, tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text(
        "import time\nimport orchestrator\n"
        "for _ in range(12):\n    orchestrator.heartbeat()\n    time.sleep(0.5)\n")
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(script)], hosts=cluster.hosts[:1], nproc_per_node=1,
        env={"PYTHONPATH": str(ROOT)}, health={"hang_timeout": 3}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]


def test_sigkilled_agent_is_a_node_failure_with_no_orphans(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        env={"SPAWN_GRANDCHILD": "1"}))
    status = running(job_id, 4)
    wait_for_output(job_id, "sleeping", 4)  # the grandchildren exist
    os.kill(status["nodes"][1]["agent_pid"], signal.SIGKILL)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_FAIL"
    assert result["failure"]["node_index"] == 1
    assert_no_job_processes(job_id)


def test_a_peers_failure_while_a_node_dies_is_that_nodes_failure(cluster, home, tmp_path):
    """Node 1's agent is SIGKILLed and at once a rank of node 0 dies, as a peer of a dead
    node's ranks does: node 0's exit comes before node 1's loss can be known over SSH (a
    reconnect), yet the failure is node 1's, and a restart goes to the nodes that are left."""
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2]))
    status = running(job_id, 4)
    wait_for_output(job_id, "sleeping", 4)
    peer = next(r for r in status["ranks"] if r["node_index"] == 0)
    os.kill(status["nodes"][1]["agent_pid"], signal.SIGKILL)
    os.kill(peer["pid"], signal.SIGKILL)  # a worker of this test's job
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED"
    failure = result["failure"]
    assert (failure["cause"], failure["node_index"]) == ("NODE_FAIL", 1), failure
    assert_no_job_processes(job_id)


def test_cut_link_is_detected_within_node_timeout(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    running(job_id, 4)
    cluster.link_down(1)
    try:
        cut = time.monotonic()
        wait_for(lambda: orchestrator.status(job_id)["nodes"][1]["state"] == "LOST", 20,
                 interval=0.05, what="node 1 LOST")
        detected = time.monotonic() - cut
        result = orchestrator.wait(job_id, timeout=60)
    finally:
        cluster.link_up(1)
    assert detected <= 2 + 1 + 0.5, detected  # node_timeout + 1 s (+ this test's polling)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_FAIL"
    assert "no heartbeat" in result["failure"]["message"]
    # Node 1's agent lost its controller too, and stopped its workers by itself.
    assert_no_job_processes(job_id, within=15)


def goes_on_without_node_2(cluster, job_id: str) -> dict:
    """Node 2's link goes down: the job of three nodes x 2 ranks must succeed on the other
    two (4 ranks)."""
    cluster.link_down(2)
    try:
        result = orchestrator.wait(job_id, timeout=180)
    finally:
        cluster.link_up(2)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["attempts"][0]["failure"]["cause"] == "NODE_FAIL"
    assert result["attempts"][-1]["world_size"] == 4
    return result


def test_lost_node_with_min_satisfied_continues_on_fewer(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [*TRAIN, "--epochs", "6", "--epoch-sleep", "1"], nnodes="2:3",
        max_restarts=2, health={"heartbeat_interval": 0.5, "node_timeout": 2},
        ssh={"connect_timeout": 2}, **FAST))
    running(job_id, 6)
    wait_for(lambda: any("epoch 0 loss" in ln for ln in orchestrator.logs(job_id)), 60,
             what="first epoch")
    result = goes_on_without_node_2(cluster, job_id)
    assert [n["state"] for n in result["nodes"]][2] in ("LOST", "FAILED")
    lines = list(orchestrator.logs(job_id, attempt=result["attempt"]))
    assert any("world_size 4" in ln for ln in lines) and any("resumed from" in ln for ln in lines)
    assert_no_job_processes(job_id, within=15)


def test_cancel_during_backoff(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")], hosts=cluster.hosts[:2],
        env={"FAIL_RANK": "0", "FAIL_AFTER": "0.2"}, max_restarts=3,
        restart_backoff={"initial": 60, "max": 60}))
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RESTARTING", 60, what="RESTARTING")
    started = time.monotonic()
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert time.monotonic() - started < 10
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"  # a second cancel is harmless
    assert_no_job_processes(job_id)


def test_fail_on_exit_codes_fails_without_spending_the_budget(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")], hosts=cluster.hosts[:2],
        env={"FAIL_RANK": "1", "FAIL_CODE": "42", "FAIL_AFTER": "0.2"}, max_restarts=3,
        fail_on_exit_codes=[42], **FAST))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["restarts"] == 0
    assert len(result["attempts"]) == 1 and result["failure"]["exit_code"] == 42
    assert_no_job_processes(job_id)


def test_two_jobs_at_once_do_not_disturb_each_other(cluster, home, tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    steady = orchestrator.submit(cluster_spec(
        cluster, a_dir, [*TRAIN, "--epochs", "3", "--epoch-sleep", "0.5"],
        hosts=cluster.hosts[:2], nproc_per_node=1))
    crashy = orchestrator.submit(cluster_spec(
        cluster, b_dir, [*TRAIN, "--epochs", "2", "--crash-rank", "0", "--crash-epoch", "0",
                         "--crash-marker", str(b_dir / "m")],
        hosts=cluster.hosts[1:], nproc_per_node=1, max_restarts=1, **FAST))
    a, b = orchestrator.wait(steady, timeout=240), orchestrator.wait(crashy, timeout=240)
    assert a["state"] == "SUCCEEDED" and a["attempt"] == 1 and a["restarts"] == 0
    assert b["state"] == "SUCCEEDED" and b["attempt"] == 2
    assert {int(m.group(1)) for ln in orchestrator.logs(steady)
            if (m := re.search(r"epoch (\d) loss", ln))} == {0, 1, 2}
    assert_no_job_processes(steady)
    assert_no_job_processes(crashy)


def test_sigint_to_submit_follow_cancels_the_job(cluster, home, tmp_path):
    spec = cluster_spec(cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")],
                        hosts=cluster.hosts[:2], env={"CHATTY": "1"})
    proc = subprocess.Popen([PYTHON, "-m", "orchestrator", "submit", str(spec), "--follow"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "tick 2" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    job_id = orchestrator.list_jobs()[-1]["job_id"]
    assert orchestrator.status(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)
