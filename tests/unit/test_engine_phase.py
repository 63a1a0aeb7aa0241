"""The engine's mode is one Phase that only moves forward: resuming, running, ending,
lingering (four booleans before, which could contradict each other)."""

from __future__ import annotations

from orchestrator.dispatch import dispatch
from orchestrator.engine import Engine, Phase
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
