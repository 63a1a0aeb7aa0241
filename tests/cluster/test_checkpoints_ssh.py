"""Checkpoints on real nodes (README, "Checkpoints"): a gloo training over two SSH nodes and
a hot spare saves every step into its agents' memory, each node replicating to the other
over the network namespaces' addresses; node rank 1's agent is SIGKILLed, and the spare,
pulling the lost ranks' copies from their buddy, resumes every rank at the same step, warm,
with the weights of a run that never failed at the end and no memory left on any node."""

from __future__ import annotations

import os
import signal

import torch

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, wait_for, wait_for_output
from tests.integration.test_checkpoints import memory_dirs, reference_weights

TRAIN = [PYTHON, str(WORKERS / "ckpt_train.py")]
TRAIN_ENV = {"STEPS": "60", "STEP_SLEEP": "0.1", "STATE_MB": "1"}


def lost_node_resumes_from_its_buddy(job_id: str, out) -> dict:
    """Node rank 1's agent SIGKILLed once rank 3 saved step 15: the job must succeed, every
    rank resuming the same step (from memory, and the lost ranks from their replicas), with
    the weights of a run that never failed, nothing left running and no memory left."""
    wait_for_output(job_id, "rank 3 step 15 saved", 1, timeout=120)
    shown = orchestrator.status(job_id)
    lost = next(n for n in shown["nodes"] if n["node_rank"] == 1)
    os.kill(lost["agent_pid"], signal.SIGKILL)  # the agent of this test's job on that node
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["attempts"][0]["failure"]["node_index"] == lost["node_index"]
    step = result["attempts"][1]["restored_step"]
    assert step is not None and step >= 14, step
    assert lost["node_index"] not in {r["node_index"] for r in result["ranks"]}
    for rank in range(4):
        assert (out / f"resumed-2-{rank}").read_text() == str(step)
    expected = reference_weights(60, 4)
    for rank in range(4):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    assert_no_job_processes(job_id)
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's memory removed")
    return result


def test_a_lost_nodes_ranks_resume_from_their_buddy_over_ssh(cluster, home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, TRAIN, nnodes=2, env={"OUT": str(out), **TRAIN_ENV},
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    lost_node_resumes_from_its_buddy(job_id, out)
