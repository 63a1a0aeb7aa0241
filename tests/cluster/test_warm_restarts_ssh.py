"""Warm restarts on real nodes: a real gloo training over two SSH nodes (and a Slurm
allocation, tests/cluster/test_slurm_jobs.py) has a rank SIGKILLed once every node's
standbys are up; the next attempt's four workers are those standbys (the agent, its boot file
and its standbys all shipped over the channel), the training resumes from its checkpoint,
and nothing is left behind."""

from __future__ import annotations

import os
import signal

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, standby_processes, wait_for

TRAIN = [PYTHON, str(WORKERS / "goodput_train.py")]
TRAIN_ENV = {"STEPS": "150", "STEP_TIME": "0.05", "CKPT_EVERY": "10"}


def kill_a_rank_once_standbys_are_up(job_id: str, ranks: int) -> dict:
    """SIGKILL the last rank once every local rank of every node has its standby; then the
    job's end, which must be a success with every worker of attempt 2 started warm."""
    wait_for(lambda: len(standby_processes(job_id)) == ranks, 120, what=f"{ranks} standbys")
    shown = orchestrator.status(job_id)
    victim = next(r for r in shown["ranks"] if r["rank"] == ranks - 1)
    os.kill(victim["pid"], signal.SIGKILL)  # a worker of this test's job
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert [a["warm_starts"] for a in result["attempts"]] == [0, ranks]
    resumed = [ln for ln in lines if " STEP 1 " in f" {ln.split('] ', 1)[-1]}"]
    assert {ln.split("STEP 1 ")[1].split()[0] for ln in resumed} == {str(r) for r in range(ranks)}
    assert not any("started cold" in ln for ln in lines), [ln for ln in lines if "cold" in ln]
    assert_no_job_processes(job_id)
    return result


def test_a_warm_restart_over_ssh(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [*TRAIN, str(tmp_path / "ckpt")], hosts=cluster.hosts[:2],
        env=TRAIN_ENV, max_restarts=1, restart={"warm": True},
        restart_backoff={"initial": 0.1}))
    kill_a_rank_once_standbys_are_up(job_id, 4)


def spare_takes_over(job_id: str) -> dict:
    """Three nodes, nnodes 2 (the third a hot spare with standbys of its own): the agent of
    node rank 1's node is SIGKILLed; the next attempt runs on node rank 0's node and the
    spare, every worker warm, and the training resumes from its checkpoint."""
    wait_for(lambda: len(standby_processes(job_id)) == 6, 120, what="6 standbys (2 on the spare)")
    shown = orchestrator.status(job_id)
    (spare,) = [n["node_index"] for n in shown["nodes"] if n["spare"]]
    lost = next(n["node_index"] for n in shown["nodes"] if n["node_rank"] == 1)
    victim = next(r for r in shown["ranks"] if r["node_index"] == lost)
    with open(f"/proc/{victim['pid']}/stat", "rb") as f:
        agent = int(f.read().rsplit(b")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)  # the agent of this test's job on that node
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert result["attempts"][0]["failure"]["node_index"] == lost
    assert [a["warm_starts"] for a in result["attempts"]] == [0, 4]
    ran = {r["node_index"] for r in result["ranks"]}
    assert spare in ran and lost not in ran, (ran, spare, lost)
    resumed = [ln for ln in lines if " STEP 1 " in f" {ln.split('] ', 1)[-1]}"]
    assert {ln.split("STEP 1 ")[1].split()[0] for ln in resumed} == {"0", "1", "2", "3"}
    assert_no_job_processes(job_id)
    return result


def test_a_hot_spare_takes_a_lost_nodes_place_warm_over_ssh(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [*TRAIN, str(tmp_path / "ckpt")], nnodes=2, env=TRAIN_ENV,
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    spare_takes_over(job_id)
