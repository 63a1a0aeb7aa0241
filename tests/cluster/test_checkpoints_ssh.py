"""Checkpoints on real nodes (README, "Checkpoints"): a gloo training over two SSH nodes and
a hot spare saves every step into its agents' memory, each node replicating to the other
over the network namespaces' addresses; node rank 1's agent is SIGKILLed, and the spare,
pulling the lost ranks' copies from their buddy, resumes every rank at the same step, warm,
with the weights of a run that never failed at the end and no memory left on any node."""

from __future__ import annotations

import glob
import os

import orchestrator
from tests.cluster.test_faults import goes_on_without_node_2
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, wait_for, wait_for_output
from tests.integration.test_checkpoints import lost_node_resumes_from_its_buddy, replicated

TRAIN = [PYTHON, str(WORKERS / "ckpt_train.py")]
# The attempt after the loss has only to finish.
TRAIN_ENV = {"STEPS": "60", "STEP_SLEEP": "0.1", "STEP_SLEEP_LATER": "0.01", "STATE_MB": "1"}


def test_a_lost_nodes_ranks_resume_from_their_buddy_over_ssh(cluster, home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, TRAIN, nnodes=2, env={"OUT": str(out), **TRAIN_ENV},
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    lost_node_resumes_from_its_buddy(job_id, out)


DCP_ENV = {"STEPS": "60", "STEP_SLEEP": "0.15", "STEP_SLEEP_LATER": "0.01"}  # 2nd: finish
# Enough kept that the nodes saving on until they are stopped do not trim the last step the
# lost node's ranks persisted.
DCP_CHECKPOINT = {"persist_every": 1, "keep": 30}


def test_a_dcp_job_that_lost_a_node_goes_on_with_fewer_ranks_resharded(cluster, home,
                                                                      tmp_path):
    """Three SSH nodes x 2 ranks, nnodes 2:3, a DTensor sharded over the 6 ranks saved with
    checkpoint_dcp every step and persisted to a checkpoint.dir the nodes share. Node 2's
    link goes down: the job goes on with 4 ranks, which reshard the newest step all 6 ranks
    persisted (before: their dcp.load failed, "another rank saved it"), and ends with every
    element equal to the number of steps."""
    out = tmp_path / "out"
    out.mkdir()
    ck = tmp_path / "ck"
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "dcp_train.py")], nnodes="2:3",
        max_restarts=1, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}, ssh={"connect_timeout": 2},
        checkpoint={"dir": str(ck), **DCP_CHECKPOINT}, env={"OUT": str(out), **DCP_ENV}))
    lost_node_2_reshards(cluster, job_id, out, ck)


def lost_node_2_reshards(cluster, job_id: str, out, ck) -> dict:
    """The job of three nodes x 2 ranks (dcp_train.py) goes on with 4 ranks once node 2's
    link is down, resharding the newest step all 6 ranks persisted in ``ck``; the SSH and
    Slurm tests run the same."""
    wait_for_output(job_id, "rank 5 step 10 saved", 1, timeout=120)
    wait_for(lambda: any(len(glob.glob(os.path.join(d, "rank-*.manifest"))) == 6
                         for d in glob.glob(str(ck / "step-*"))), 60,
             what="a step persisted by all 6 ranks")
    result = goes_on_without_node_2(cluster, job_id)
    resumed = [ln for ln in orchestrator.logs(job_id, attempt=result["attempt"])
               if "resumed step" in ln]
    assert len(resumed) == 4 and all("in world 4" in ln for ln in resumed), resumed
    # The attempt says the step the ranks resharded (older than the survivors' newest copies,
    # which the controller agreed on): the steps redone count from it.
    steps = {int(ln.split("resumed step ")[1].split()[0]) for ln in resumed}
    assert [result["attempts"][-1]["restored_step"]] == list(steps), (steps, result["attempts"])
    assert (out / "final.txt").read_text() == "60.0"
    assert_no_job_processes(job_id, within=15)
    return result


def test_a_dcp_job_that_lost_a_node_reshards_from_the_nodes_memory_over_ssh(cluster, home,
                                                                          tmp_path):
    """The same three SSH nodes with no checkpoint.dir: the 4 ranks left reshard from the
    nodes' memory (borrowed over the namespaces' addresses) the step node 2's ranks had
    replicated to node 0 (before: the load failed, nothing persisted, and the job)."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "dcp_train.py")], nnodes="2:3",
        max_restarts=1, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}, ssh={"connect_timeout": 2},
        env={"OUT": str(out), **DCP_ENV}))
    lost_node_2_reshards_from_memory(cluster, job_id, out)


def lost_node_2_reshards_from_memory(cluster, job_id: str, out) -> dict:
    """The job of three nodes x 2 ranks (dcp_train.py, no checkpoint.dir) goes on with 4
    ranks once node 2's link is down, resharding from memory a step no older than node 2's
    ranks' newest replicas on node 0 when it went; the SSH and Slurm tests run the same."""
    wait_for_output(job_id, "rank 5 step 10 saved", 1, timeout=120)
    wait_for(lambda: replicated(job_id, 0, (4, 5)) >= 10, 60,
             what="node 2's ranks' step 10 replicated to node 0")
    before = replicated(job_id, 0, (4, 5))
    result = goes_on_without_node_2(cluster, job_id)
    resumed = [ln for ln in orchestrator.logs(job_id, attempt=result["attempt"])
               if "resumed step" in ln]
    assert len(resumed) == 4 and all("in world 4" in ln for ln in resumed), resumed
    steps = {int(ln.split("resumed step ")[1].split()[0]) for ln in resumed}
    assert len(steps) == 1 and min(steps) >= before, (resumed, before)
    assert [result["attempts"][-1]["restored_step"]] == list(steps), result["attempts"]
    assert (out / "final.txt").read_text() == "60.0"
    assert_no_job_processes(job_id, within=15)
    return result
