"""Progress and ETA (orchestrator/progress.py) from a job's record: the step is the slowest
rank's, the total a rank's before the spec's, the pace the newest known, and the ETA the
remaining steps at that pace stretched by the share of time lost to faults so far."""

from __future__ import annotations

import json

import pytest

from orchestrator.progress import MOST_LOST_SHARE, progress
from orchestrator.records import AttemptRecord, AttemptSteps, JobRecord, RankRecord
from orchestrator.render import progress_line, span
from orchestrator.state import JobState

T0 = 1_000_000.0
NO_LOSS = {"seconds": 0.0, "unknown_downtime_s": 0.0}


def _job(spec: dict | None = None, state: JobState = JobState.RUNNING, attempt: int = 1,
         steps: dict[int, int] | None = None) -> JobRecord:
    job = JobRecord("j", "j", state, json.dumps(spec or {}), "/", T0, T0, None, attempt, 0, 0,
                    None, False, None)
    job.attempts = [AttemptRecord(a, T0 + 100 * (a - 1), None, None, None, None, 2, None)
                    for a in range(1, attempt + 1)]
    job.ranks = [RankRecord(attempt, rank, rank, 0, None, "RUNNING", None, None, step)
                 for rank, step in (steps or {}).items()]
    return job


def test_nothing_known_is_no_progress():
    assert progress(_job(), NO_LOSS, T0 + 10) is None


def test_the_step_is_the_slowest_ranks_and_the_eta_the_rest_at_the_pace():
    job = _job(steps={0: 420, 1: 400})
    job.totals, job.rates = {1: 1000}, {1: 4.0}
    p = progress(job, NO_LOSS, T0 + 100)
    assert p is not None
    assert (p["step"], p["total_steps"], p["total_from"]) == (400, 1000, "heartbeat")
    assert p["percent"] == 40.0 and p["remaining_steps"] == 600
    assert p["eta_s"] == p["eta_without_faults_s"] == 150.0  # 600 steps at 4/s
    assert p["eta_at"] == pytest.approx(T0 + 100 + 150)
    assert p["lost_share"] == 0.0


def test_time_lost_so_far_stretches_the_eta():
    job = _job(steps={0: 500, 1: 500}, attempt=2)
    job.totals, job.rates = {2: 1000}, {1: 5.0, 2: 5.0}
    # 50 s lost and 10 s of unknown downtime in the 200 s since the first attempt began
    p = progress(job, {"seconds": 50.0, "unknown_downtime_s": 10.0}, T0 + 200)
    assert p is not None and p["lost_share"] == 0.3
    assert p["eta_without_faults_s"] == 100.0
    assert p["eta_s"] == pytest.approx(100.0 / 0.7, abs=0.1)


def test_a_job_that_lost_nearly_everything_still_gets_a_finite_eta():
    job = _job(steps={0: 10})
    job.totals, job.rates = {1: 20}, {1: 1.0}
    p = progress(job, {"seconds": 1e9}, T0 + 100)
    assert p is not None and p["eta_s"] == pytest.approx(10 / (1 - MOST_LOST_SHARE), abs=0.1)


def test_the_spec_gives_the_total_when_no_rank_does_and_a_rank_overrides_it():
    job = _job({"total_steps": 50}, steps={0: 10})
    job.rates = {1: 2.0}
    p = progress(job, NO_LOSS, T0 + 5)
    assert p is not None and (p["total_steps"], p["total_from"], p["eta_s"]) == (50, "spec", 20.0)
    job.totals = {1: 80}
    p = progress(job, NO_LOSS, T0 + 5)
    assert p is not None and (p["total_steps"], p["total_from"]) == (80, "heartbeat")


def test_just_after_a_restart_the_last_step_and_pace_stand_in():
    # Attempt 2 began; none of its ranks has stepped yet.
    job = _job(attempt=2)
    job.steps = [AttemptSteps(1, 2, T0, 0, 300, 3.0)]
    job.totals, job.rates = {1: 600}, {1: 3.0}
    p = progress(job, NO_LOSS, T0 + 110)
    assert p is not None and (p["step"], p["steps_per_s"], p["eta_s"]) == (300, 3.0, 100.0)


def test_an_ended_job_has_no_eta_and_a_step_past_the_total_is_100_percent():
    job = _job(state=JobState.SUCCEEDED, steps={0: 120})
    job.totals, job.rates = {1: 100}, {1: 3.0}
    p = progress(job, NO_LOSS, T0 + 50)
    assert p is not None and p["percent"] == 100.0 and p["remaining_steps"] == 0
    assert p["eta_s"] is None and p["eta_at"] is None


def test_steps_without_a_total_say_how_to_get_one():
    job = _job(steps={0: 7})
    job.rates = {1: 1.5}
    p = progress(job, NO_LOSS, T0 + 5)
    assert p is not None and (p["step"], p["percent"], p["eta_s"]) == (7, None, None)
    line = progress_line(p)
    assert line is not None and "step 7 (total unknown: heartbeat(total_steps=...)" in line


def test_the_line_says_step_percent_pace_and_eta():
    line = progress_line({"step": 4200, "total_steps": 10000, "total_from": "heartbeat",
                          "percent": 42.0, "remaining_steps": 5800, "steps_per_s": 3.1,
                          "lost_share": 0.04, "eta_s": 1870.0, "eta_without_faults_s": 1800.0,
                          "eta_at": "2026-11-26T11:42:00+00:00"})
    assert line == ("progress: step 4,200 of 10,000 (42.0%), 3.1 steps/s, ETA 31m 10s "
                    "(at 2026-11-26T11:42:00+00:00), counting the 4% of the time lost to "
                    "faults so far")


@pytest.mark.parametrize("seconds, shown", [(0.4, "0s"), (59, "59s"), (61, "1m 01s"),
                                            (3600, "1h 00m"), (7325, "2h 02m"),
                                            (90000, "1d 01h")])
def test_durations_read_as_a_person_reads_them(seconds, shown):
    assert span(seconds) == shown
