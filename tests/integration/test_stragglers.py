"""Stragglers under synchronous all-reduce, named from how long each rank waits in it."""

from __future__ import annotations

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, write_spec


def _run(tmp_path, env: dict[str, str]) -> dict:
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "straggle", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 2, "command": [PYTHON, str(WORKERS / "straggler.py")],
        "workdir": str(tmp_path), "health": {"heartbeat_interval": 0.5},
        # 10 s of samples are needed before anyone is named (diagnosis.STRAGGLER_MIN_SAMPLES)
        "env": {"STEPS": "40", "STEP_COMPUTE": "0.05", **env}}))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert_no_job_processes(job_id)
    return result


def test_the_rank_that_computes_8x_longer_is_named(home, tmp_path):
    result = _run(tmp_path, {"SLOW_RANK": "2", "SLOW_FACTOR": "8"})
    assert result["stragglers"] == [2], result["ranks"]
    assert result["attempts"][0]["stragglers"] == [2]
    shares = {r["rank"]: r["wait_share"] for r in result["ranks"]}
    assert shares[2] < 0.15 and all(shares[r] > 0.6 for r in (0, 1, 3)), shares
    assert [r["rank"] for r in result["ranks"] if r["straggler"]] == [2]


def test_a_balanced_job_names_nobody(home, tmp_path):
    result = _run(tmp_path, {})
    assert result["stragglers"] == [], result["ranks"]
    # Every rank was sampled: the empty list is a verdict, not an absence of data.
    assert all(r["wait_share"] is not None for r in result["ranks"]), result["ranks"]
