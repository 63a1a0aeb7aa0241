"""A save beside the training (``save(step, state, wait=False)``, then ``wait()``): the copy
goes on on a thread while the caller goes on, the state as of the save, in order, its errors
raised where the script waits, a planned move's hold kept, a normal exit losing none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from agents import commands as C
from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from agents.shims import orchestrator_checkpoint_slots as M
from tests.helpers import ROOT
from tests.unit.test_checkpoint_store import store  # noqa: F401  (the agent's store fixture)


@pytest.fixture
def gated(monkeypatch):
    """The copy into memory held until the test opens the gate: what a long copy looks like."""
    gate, entered = threading.Event(), threading.Event()
    real = M.to_memory

    def slow(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(M, "to_memory", slow)
    yield gate, entered
    gate.set()
    ckpt.wait()


def test_a_save_beside_the_training_returns_before_its_copy_and_wait_ends_with_it(
        store, gated):  # noqa: F811
    s, _ = store
    gate, entered = gated
    rank_dir = os.path.join(s.root, "rank-1")
    state = {"w": torch.full((1000,), 3.0), "step": 3}
    started = time.perf_counter()
    held = ckpt.save(3, state, wait=False)
    assert entered.wait(10)  # the copy began on its thread, and save() has returned
    assert held < 1.0 and time.perf_counter() - started < 5
    assert 3 not in M.metas_of(rank_dir)  # no copy named before it is whole
    threading.Timer(0.3, gate.set).start()
    waited = ckpt.wait()
    assert waited >= 0.25, waited
    meta = M.metas_of(rank_dir)[3]
    # What the save held the training: its set-up and the wait (to the copy's end, just
    # before the wait's), not the thread's whole time.
    assert waited - 0.05 <= meta["block_s"] <= waited + held, (meta["block_s"], waited, held)
    assert ckpt.wait() == 0.0  # nothing in flight any more
    os.environ[F.STEP_VAR] = "3"
    try:
        step, back = ckpt.load()
    finally:
        del os.environ[F.STEP_VAR]
    assert step == 3 and torch.equal(back["w"], state["w"]) and back["step"] == 3


def test_the_next_save_and_a_load_wait_for_the_one_in_flight(store, gated, monkeypatch):  # noqa: F811
    s, _ = store
    gate, entered = gated
    rank_dir = os.path.join(s.root, "rank-1")
    ckpt.save(1, {"w": torch.full((100,), 1.0)}, wait=False)
    assert entered.wait(10)
    threading.Timer(0.3, gate.set).start()
    started = time.perf_counter()
    ckpt.save(2, {"w": torch.full((100,), 2.0)})  # the one before first: saves stay in order
    assert time.perf_counter() - started >= 0.25
    assert sorted(M.metas_of(rank_dir)) == [1, 2]
    gate.clear()
    entered.clear()
    ckpt.save(4, {"w": torch.full((100,), 4.0)}, wait=False)
    assert entered.wait(10)
    threading.Timer(0.3, gate.set).start()
    monkeypatch.setenv(F.STEP_VAR, "4")
    step, back = ckpt.load()  # this process's own save still copying: loaded once done
    assert step == 4 and torch.equal(back["w"], torch.full((100,), 4.0))


def test_what_a_save_beside_the_training_could_not_do_is_raised_where_it_waits(
        store, monkeypatch):  # noqa: F811
    monkeypatch.setenv(F.BUDGET_VAR, str(1 << 20))
    assert ckpt.save(0, {"w": torch.zeros(1 << 18)}, wait=False) >= 0.0  # returns at once
    with pytest.raises(F.CheckpointError, match="fewer than two copies"):
        ckpt.wait()
    assert ckpt.wait() == 0.0  # raised once
    ckpt.save(1, {"w": torch.zeros(1 << 18)}, wait=False)
    with pytest.raises(F.CheckpointError, match="fewer than two copies"):
        ckpt.save(2, {"w": torch.zeros(10)})  # or by the next save


def test_a_planned_moves_step_saved_beside_the_training_holds_where_the_script_waits(
        store):  # noqa: F811
    s, _ = store
    s.save_at(C.SaveAt(7, 0.4))
    started = time.monotonic()
    ckpt.save(7, {"w": torch.zeros(10)}, wait=False)
    assert time.monotonic() - started < 0.3  # not held in save(): the step computes on
    started = time.monotonic()
    ckpt.wait()
    assert time.monotonic() - started >= 0.3  # held at wait(), the save done (no step twice)
    assert 7 in M.metas_of(os.path.join(s.root, "rank-1"))


def test_without_an_agent_a_save_beside_the_training_writes_its_files(tmp_path, monkeypatch):
    for var in (F.MEMORY_VAR, F.STEP_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((4,), float(step))}, wait=False)
    ckpt.wait()
    assert F.persisted_steps(str(tmp_path), 0) == [2, 1]
    step, back = ckpt.load()
    assert step == 2 and torch.equal(back["w"], torch.full((4,), 2.0))


def test_a_script_that_exits_right_after_a_save_beside_the_training_keeps_it(tmp_path):
    """The copy's thread is no daemon: a normal exit waits for it (a whole copy, verified)."""
    script = (
        "import torch\n"
        "from agents.shims import orchestrator_checkpoint as ckpt\n"
        "ckpt.save(5, {'w': torch.arange(1 << 22, dtype=torch.float32)}, wait=False)\n")
    env = {**os.environ, "RANK": "0", F.DIR_VAR: str(tmp_path / "ck")}
    for name in (F.MEMORY_VAR, F.STEP_VAR):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    found = ckpt.persisted_copy(torch, str(tmp_path / "ck"), 5, rank=0)
    assert found is not None, os.listdir(tmp_path / "ck")
    meta, state = found
    assert json.loads(json.dumps(meta))["step"] == 5
    assert torch.equal(state["w"], torch.arange(1 << 22, dtype=torch.float32))
