"""Checkpoints on real nodes (README, "Checkpoints"): a gloo training over two SSH nodes and
a hot spare saves every step into its agents' memory, each node replicating to the other
over the network namespaces' addresses; node rank 1's agent is SIGKILLed, and the spare,
pulling the lost ranks' copies from their buddy, resumes every rank at the same step, warm,
with the weights of a run that never failed at the end and no memory left on any node."""

from __future__ import annotations

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS
from tests.integration.test_checkpoints import lost_node_resumes_from_its_buddy

TRAIN = [PYTHON, str(WORKERS / "ckpt_train.py")]
TRAIN_ENV = {"STEPS": "60", "STEP_SLEEP": "0.1", "STATE_MB": "1"}


def test_a_lost_nodes_ranks_resume_from_their_buddy_over_ssh(cluster, home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, TRAIN, nnodes=2, env={"OUT": str(out), **TRAIN_ENV},
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    lost_node_resumes_from_its_buddy(job_id, out)
