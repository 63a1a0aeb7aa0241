"""The phases of a run, marked by the controller and shown by ``status --json``: what happens
between submit and the first line of output (orchestrator/timeline.py)."""

from __future__ import annotations

from orchestrator.jobview import status_dict
from orchestrator.timeline import PHASES, Timeline, shown
from tests.unit.test_controller import SPEC, run_job


def test_status_shows_every_phase_of_a_run_in_order_and_in_time(tmp_path):
    store, job_id, _ = run_job(tmp_path, SPEC, {"b": {1: {2: 3}}})  # attempt 1: rank 2 fails
    marks = status_dict(store.get_job(job_id))["timeline"]
    phases = [(m["phase"], m["attempt"]) for m in marks]
    # Every worker started, and a first line came, in whichever order the nodes' channels
    # were read; both after the start and before the exit.
    for n in (1, 2):
        assert phases.index(("start", n)) < phases.index(("started", n)) < \
            phases.index(("exit", n))
    assert [p for p in phases if p[0] != "started"] == [
        ("submitted", None), ("controller", None), ("connect", None), ("hello", None),
        ("prepared", 1), ("checked", 1), ("start", 1), ("first_output", 1), ("exit", 1),
        ("prepared", 2), ("checked", 2), ("start", 2), ("first_output", 2), ("exit", 2),
        ("teardown", None), ("state_written", None)]
    seconds = [m["seconds"] for m in marks]
    assert seconds == sorted(seconds) and 0 <= seconds[-1] < 30
    assert {p for p, _ in phases} == set(PHASES)


def test_a_phase_keeps_its_first_time_and_a_stored_timeline_is_never_the_readers_error():
    t = Timeline(100.0)
    t.mark("connect", at=101.0)
    t.mark("connect", at=105.0)  # a resumed controller's connect is not the first
    again = Timeline.from_json(t.to_json(), 100.0)
    assert again.marks == [("connect", None, 101.0)]
    assert shown('[["connect", null, 101.5], ["bogus", 1, 2], [1, 2], "x"]', 100.0) == [
        {"phase": "submitted", "attempt": None, "seconds": 0.0},
        {"phase": "connect", "attempt": None, "seconds": 1.5}]
    assert shown("not json", 100.0) == [{"phase": "submitted", "attempt": None, "seconds": 0.0}]
