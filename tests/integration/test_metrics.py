"""Steps and metrics that workers give heartbeat(), through the agent, in status."""

from __future__ import annotations

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, write_spec


def test_steps_and_metrics_reach_status_with_a_rate(home, tmp_path):
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "metrics", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, str(WORKERS / "stepper.py")], "workdir": str(tmp_path),
        # silent but heartbeating: a hang_timeout must not fire
        "health": {"hang_timeout": 2, "heartbeat_interval": 0.5}, "env": {"STEPS": "30"}}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    for r in result["ranks"]:
        assert r["step"] == 29 and abs(r["metrics"]["loss"] - 1 / 30) < 1e-9, r
        assert r["steps_per_s"] and 2 < r["steps_per_s"] < 40, r  # about 20 steps/s
        assert r["last_heartbeat"]
    assert result["attempts"][0]["steps_per_s"] == min(r["steps_per_s"] for r in result["ranks"])
    assert_no_job_processes(job_id)
