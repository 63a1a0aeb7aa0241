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


def _straggle(cluster, tmp_path, env):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "straggler.py")], hosts=cluster.hosts[:2],
        nproc_per_node=2, env={"STEPS": "40", "STEP_COMPUTE": "0.05", **env},
        health={"heartbeat_interval": 0.5}))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert_no_job_processes(job_id)
    return result


def test_a_straggler_under_all_reduce_is_named_over_ssh(cluster, home, tmp_path):
    # Rank 3 (the second node) computes 8x longer; all step at its pace, so only the waiting
    # in all_reduce can tell.
    result = _straggle(cluster, tmp_path, {"SLOW_RANK": "3", "SLOW_FACTOR": "8"})
    assert result["stragglers"] == [3], result["ranks"]
    rates = [r["steps_per_s"] for r in result["ranks"]]
    assert max(rates) / min(rates) < 1.2, rates  # step rates alike: they cannot tell


def test_a_balanced_job_over_ssh_names_no_straggler(cluster, home, tmp_path):
    result = _straggle(cluster, tmp_path, {})
    assert result["stragglers"] == [], result["ranks"]
    assert all(r["wait_share"] is not None for r in result["ranks"]), result["ranks"]
