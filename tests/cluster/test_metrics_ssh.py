"""Steps and metrics over SSH, from workers on nodes where only the agent's shim is there."""

from __future__ import annotations

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes


def test_steps_and_metrics_over_ssh(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "stepper.py")], hosts=cluster.hosts[:2],
        nproc_per_node=2, env={"STEPS": "25"}, health={"heartbeat_interval": 0.5}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1, 2, 3]
    assert {r["step"] for r in result["ranks"]} == {24}
    assert all(r["metrics"]["loss"] == 1 / 25 and r["steps_per_s"] for r in result["ranks"])
    assert_no_job_processes(job_id)
