"""Progress and ETA of a running job, as `status --json`, `status` and the Python API show it
while it runs: the step, the total (a rank's heartbeat(total_steps=...) or the spec's),
steps/s, percent and an ETA that counts the time lost to faults so far."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime

import pytest

import orchestrator
from tests.helpers import PYTHON, ROOT, WORKERS, wait_for, write_spec


def _cli(*args: str) -> str:
    done = subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _spec(tmp_path, env: dict[str, str], **more) -> str:
    return str(write_spec(tmp_path, {
        "name": "progress", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 1, "command": [PYTHON, str(WORKERS / "progress_train.py")],
        "workdir": str(tmp_path), "health": {"heartbeat_interval": 0.3},
        "env": {"STEP_SLEEP": "0.05", **env}, **more}))


def _progress(job_id: str, attempt: int, least_step: int) -> dict:
    """The progress of a job once its attempt ``attempt`` has reached ``least_step`` and has
    a pace, read through `status --json` as a user would."""
    seen: dict = {}

    def reached() -> bool:
        data = json.loads(_cli("status", job_id, "--json"))
        p = data["progress"]
        seen.update(data)
        return (data["attempt"] == attempt and p is not None and p["step"] is not None
                and p["step"] >= least_step and p["steps_per_s"] is not None
                and all(r["steps_per_s"] for r in data["ranks"]))
    wait_for(reached, timeout=90, interval=0.3, what=f"attempt {attempt} at step {least_step}")
    return seen


def test_a_running_job_shows_step_percent_pace_and_eta(home, tmp_path):
    job_id = orchestrator.submit(_spec(tmp_path, {"STEPS": "400", "GIVE_TOTAL": "1"}))
    data = _progress(job_id, 1, 40)
    p = data["progress"]
    assert data["state"] == "RUNNING"
    assert (p["total_steps"], p["total_from"]) == (400, "heartbeat")
    assert p["step"] == min(r["step"] for r in data["ranks"])
    assert p["percent"] == round(100 * p["step"] / 400, 1)
    assert p["remaining_steps"] == 400 - p["step"]
    assert 4 < p["steps_per_s"] < 30, p  # a step every 0.05 s, and a heartbeat's writing
    assert p["steps_per_s"] == round(data["attempts"][0]["steps_per_s"], 4)
    assert p["lost_share"] == 0.0 and p["eta_s"] == p["eta_without_faults_s"]
    assert p["eta_s"] == pytest.approx(p["remaining_steps"] / p["steps_per_s"], rel=0.01, abs=0.2)
    eta_at = datetime.fromisoformat(p["eta_at"]).timestamp()
    assert eta_at == pytest.approx(time.time() + p["eta_s"], abs=5)
    text = _cli("status", job_id)
    assert "progress: step " in text and " of 400 (" in text and "steps/s, ETA " in text, text
    result = orchestrator.cancel(job_id, wait_seconds=30)
    ended = orchestrator.status(job_id)
    assert ended["state"] == "CANCELLED", result
    assert ended["progress"]["eta_s"] is None and ended["progress"]["total_steps"] == 400


def test_after_a_fault_the_eta_counts_the_time_lost_so_far(home, tmp_path):
    """The spec's total_steps (the script gives none), a rank failing once at step 20: the
    restarted job redoes those steps, and its ETA is stretched by the share of time lost."""
    job_id = orchestrator.submit(_spec(
        tmp_path, {"STEPS": "300", "FAIL_ONCE": str(tmp_path / "failed-once")},
        max_restarts=1, total_steps=300))
    data = _progress(job_id, 2, 15)
    p = data["progress"]
    assert (p["total_steps"], p["total_from"]) == (300, "spec")
    lost = data["time_lost"]
    assert len(lost["incidents"]) == 1 and lost["seconds"] > 0, lost
    assert 0 < p["lost_share"] < 1, p
    assert p["eta_s"] > p["eta_without_faults_s"] > 0
    assert p["eta_s"] == pytest.approx(p["eta_without_faults_s"] / (1 - p["lost_share"]),
                                       rel=0.01, abs=0.2)
    assert "counting the " in _cli("status", job_id)
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["progress"]["percent"] == round(100 * 299 / 300, 1)
    assert result["progress"]["eta_s"] is None
