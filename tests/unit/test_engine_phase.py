"""The engine's mode is one Phase that only moves forward: resuming, running, ending,
lingering (four booleans before, which could contradict each other)."""

from __future__ import annotations

from orchestrator.dispatch import dispatch
from orchestrator.engine import Engine, Phase
from orchestrator.events import Wake
from orchestrator.spec import parse_jobspec
from orchestrator.store import Store
from orchestrator.transport.fake import FakeAgent
from tests.unit.test_controller import SPEC


def test_the_engines_phase_only_moves_forward(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000001", spec.name, spec.model_dump_json(), str(tmp_path),
                     spec.max_restarts, [n.host for n in spec.nodes])

    def engine(resuming: bool) -> Engine:
        return Engine(store, "fake-000001", spec, str(tmp_path),
                      lambda node, _s: FakeAgent(node.host, {}, []), "s" * 32, dispatch,
                      resuming=resuming)

    resumed = engine(True)
    assert resumed.resuming and not resumed.ending and not resumed.lingering
    resumed.enter(Phase.RUNNING)
    resumed.enter(Phase.RESUMING)  # never back
    assert resumed.phase == Phase.RUNNING and not resumed.resuming
    fresh = engine(False)
    assert fresh.phase == Phase.RUNNING
    fresh.enter(Phase.LINGERING)
    assert fresh.ending and fresh.lingering
    fresh.enter(Phase.ENDING)  # lingering is ending too: it stays
    assert fresh.phase == Phase.LINGERING
    for e in (resumed, fresh):
        e.close()


def test_a_wait_returns_when_the_turns_events_made_it_done_before_the_turns_checks(tmp_path):
    """The turn that handled what its waiter waited for leaves its periodic checks to the
    next turn: with 4,000 simulated nodes the turn that saw the last worker start also ran
    a checkpoint of 1.6-2.3 s, and the job stayed LAUNCHING in `status` that much longer
    (benchmarks/bench_scale.py, restart_shown_s)."""
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000001", spec.name, spec.model_dump_json(), str(tmp_path),
                     spec.max_restarts, [n.host for n in spec.nodes])
    handled: list[object] = []
    engine = Engine(store, "fake-000001", spec, str(tmp_path),
                    lambda node, _s: FakeAgent(node.host, {}, []), "s" * 32,
                    lambda _engine, event: handled.append(event))
    checks: list[int] = []
    engine._checks = lambda: checks.append(len(handled))  # type: ignore[method-assign]
    try:
        assert engine.wait(lambda: False, 0.2) is False
        assert checks and set(checks) == {0}  # nothing handled: every turn checks
        checks.clear()
        engine.loop.post(Wake())
        assert engine.wait(lambda: bool(handled), 5.0)
        assert len(handled) == 1 and checks == [], checks
        assert engine.wait(lambda: False, 0.1) is False
        assert checks and checks[0] == 1  # the next turn checks
    finally:
        engine.close()
