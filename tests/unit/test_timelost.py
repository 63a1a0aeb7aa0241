"""Time lost per incident and goodput, from an attempts' timeline and the ranks' steps
(orchestrator/timelost.py), on hand-made records whose answers are worked out below."""

from __future__ import annotations

import pytest

from orchestrator.records import AttemptRecord, StepSpan
from orchestrator.render import time_lost_line
from orchestrator.timelost import incidents, summary


def attempt(n, started, ended, outcome, world=2, failure=None):
    return AttemptRecord(n, started, ended, outcome, None, None, world, failure)


ATTEMPTS = [
    attempt(1, 50.0, 101.0, "FAILED",
            failure={"cause": "WORKER_FAILED", "at": 100.0, "detected_at": 100.5}),
    attempt(2, 101.0, 162.0, "SUCCEEDED"),
]
STEPS = [  # one step a second in both attempts
    StepSpan(1, 0, 0, 50.0, 49, 99.0), StepSpan(1, 1, 0, 50.2, 48, 98.2),
    StepSpan(2, 0, 40, 102.0, 99, 161.0), StepSpan(2, 1, 40, 102.5, 99, 161.5),
]


def test_an_incident_is_detection_downtime_and_redone_steps():
    (found,) = incidents(ATTEMPTS, STEPS)
    assert found.attempt == 1 and found.cause == "WORKER_FAILED"
    assert found.detected_s == pytest.approx(0.5)
    assert found.restarted_s == pytest.approx(1.0)
    assert found.recovered_s == pytest.approx(2.5)  # the later rank's first step
    assert found.steps_redone == 10  # reached 49, resumed at 40
    assert found.lost_s == pytest.approx(12.5)  # 2.5 s down + 10 steps of 1 s
    assert found.gpu_s == pytest.approx(25.0)


def test_goodput_is_useful_step_time_over_wall_time():
    shown = summary(ATTEMPTS, STEPS, ended_at=162.0)
    assert shown["seconds"] == pytest.approx(12.5) and shown["gpu_seconds"] == pytest.approx(25)
    assert shown["goodput"] == pytest.approx(100 / 112, abs=1e-3)  # 100 steps of 1 s in 112 s


def test_without_steps_only_the_timeline_is_known():
    (found,) = incidents(ATTEMPTS, [])
    assert found.restarted_s == pytest.approx(1.0) and found.detected_s == pytest.approx(0.5)
    assert found.recovered_s is None and found.steps_redone is None and found.lost_s is None
    shown = summary(ATTEMPTS, [], None)
    assert shown == {"seconds": 0, "gpu_seconds": 0, "goodput": None, "unknown": 1,
                     "unknown_downtime_s": 1.0, "incidents": [found.to_dict()]}
    # Unknown is not zero: the line says what is not known, and what is.
    line = time_lost_line(shown)
    assert line == ("time lost: unknown for 1 incident (no steps reported by "
                    "heartbeat(step=...): restarted 1 s after the fault, steps redone "
                    "unknown)"), line
    assert "0 s" not in line


def test_known_and_unknown_incidents_are_told_apart():
    known = summary(ATTEMPTS, STEPS, None)
    line = time_lost_line({**known, "unknown": 1, "unknown_downtime_s": 2.5,
                           "incidents": [*known["incidents"], known["incidents"][0]]})
    assert line.startswith(f"time lost: {known['seconds']:g} s (") and " in 1 incident" in line
    assert "; unknown for 1 more incident (no steps reported" in line


def test_a_next_attempt_not_training_yet_has_no_recovery():
    spans = [s for s in STEPS if not (s.attempt == 2 and s.rank == 1)]
    (found,) = incidents(ATTEMPTS, spans)
    assert found.recovered_s is None and found.steps_redone == 10


def test_a_success_or_the_last_attempt_is_no_incident():
    assert incidents(ATTEMPTS[1:], STEPS) == []
    assert incidents([ATTEMPTS[0]], STEPS) == []


def test_the_steps_redone_count_from_the_checkpoint_step_every_rank_resumed():
    resumed = [ATTEMPTS[0], AttemptRecord(2, 101.0, 162.0, "SUCCEEDED", None, None, 2, None,
                                          restored_step=48)]
    (found,) = incidents(resumed, STEPS)
    assert found.steps_redone == 1  # reached 49; resumed after 48 (step 49 done twice)
