"""A preparation (orchestrator/prepare.py) whose node's channel ended is done again once the
node is back (``ChannelEnded``), while one that got no answer on a live channel fails."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator import prepare
from orchestrator.spec import parse_jobspec


def test_a_preparation_whose_channel_ended_is_done_again_and_not_a_failure(monkeypatch,
                                                                            tmp_path):
    spec = parse_jobspec("nodes: [{host: local}]\ncommand: [python, t.py]\n"
                         "setup: [echo hi]\n")
    posted: list = []
    preparer = prepare.Preparer("j-1", spec, str(tmp_path), None,  # type: ignore[arg-type]
                                SimpleNamespace(post=posted.append))  # type: ignore[arg-type]
    monkeypatch.setattr(prepare, "ask", lambda *args, **kwargs: None)  # no answer came
    preparer._prepare(0, "local", True, SimpleNamespace(closed=True))  # type: ignore[arg-type]
    assert posted[-1].interrupted and posted[-1].failure is None
    preparer._prepare(0, "local", True, SimpleNamespace(closed=False))  # type: ignore[arg-type]
    assert not posted[-1].interrupted and posted[-1].failure.cause.value == "SETUP_FAILED"
    preparer.close()
