"""The checkpoint store's pure parts and its files, without a job: the state as data (no
pickle), a save that never writes over the newest copy nor one the agent is reading, the
agent's seal and persist and what it reports, a corrupt copy named and skipped for the next
good one, memory bounded as configured, and the controller's choice of the step every rank
resumes (orchestrator/checkpoints.py)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets

import pytest
import torch

from agents import commands as C
from agents import protocol as P
from agents.checkpoints import Store
from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from agents.shims import orchestrator_checkpoint_slots as M
from orchestrator.checkpoints import Holdings
from tests.helpers import ROOT


class Outbox:
    """What the store puts out, as the agent's outbox would carry it."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def current(self) -> object:
        return self

    def put(self, message: dict) -> None:
        self.sent.append(message)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An agent's store (its memory on /dev/shm, removed afterwards) and a worker's env for it:
    rank 1, every save persisted to tmp_path/ck, two kept."""
    outbox = Outbox()
    s = Store(f"unit-{secrets.token_hex(4)}", 0, outbox, "s3cret")  # type: ignore[arg-type]
    env = s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20), str(tmp_path), 1, 1)
    for key, value in {**env, "RANK": "1"}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    # No thread: the test drives the store's passes itself.
    yield s, outbox
    s.close()
    assert not os.path.exists(s.root)


def test_the_state_is_data_and_comes_back_as_it_went():
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, 3: (1, 2.5, None), "big": 1 << 70,
             "odd": [float("inf"), "s", True], "opt": {"state": {0: {"m": torch.ones(2)}}}}
    tree, tensors = F.flatten(state)
    back = F.unflatten(tree, tensors)
    assert back[3] == (1, 2.5, None) and back["big"] == 1 << 70 and back["odd"][1:] == ["s", True]
    assert math.isinf(back["odd"][0]) and torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["opt"]["state"][0]["m"], torch.ones(2))
    with pytest.raises(F.CheckpointError, match=r"state\['fn'\] is a function"):
        F.flatten({"fn": lambda: None})


def test_a_save_never_writes_the_newest_copy_nor_one_being_read(store, monkeypatch):
    s, _ = store
    for step in (0, 1):
        ckpt.save(step, {"w": torch.full((1000,), float(step))})
    rank_dir = os.path.join(s.root, "rank-1")
    slot0 = os.open(os.path.join(rank_dir, "slot-0"), os.O_RDONLY)
    fcntl.flock(slot0, fcntl.LOCK_SH)  # the agent reads step 0's copy
    try:
        ckpt.save(2, {"w": torch.full((1000,), 2.0)})
    finally:
        os.close(slot0)
    assert sorted(os.listdir(rank_dir)) == ["slot-0", "slot-1", "slot-2", "step-0.meta",
                                            "step-1.meta", "step-2.meta"]
    for step in (0, 1, 2):
        monkeypatch.setenv(F.STEP_VAR, str(step))
        assert torch.equal(ckpt.load()[1]["w"], torch.full((1000,), float(step)))
    s._pass()  # persisted: no slot awaits the agent any more
    ckpt.save(3, {"w": torch.full((1000,), 3.0)})  # the oldest save's slot: step 0's
    assert not os.path.exists(os.path.join(rank_dir, "step-0.meta"))


def test_the_agent_seals_persists_reports_and_a_corrupt_copy_is_skipped(store, capsys,
                                                                        monkeypatch):
    s, outbox = store
    state = {"w": torch.randn(1 << 16), "step": 5}
    ckpt.save(5, state)
    s._pass()
    # The blank its next save will take, made on a thread meanwhile, counts too: once made
    # (a report before or after it came: a race that failed this test 2 runs in 5).
    for thread in list(s._pages._threads.values()):
        thread.join(10)
    s._pass()
    rank_dir = os.path.join(s.root, "rank-1")
    assert os.path.exists(os.path.join(rank_dir, "step-5.manifest"))
    held = P.parse(outbox.sent[-1])
    assert isinstance(held, P.Held) and held.memory == {1: (5,)} and held.persisted == {1: (5,)}
    assert held.bytes == os.path.getsize(os.path.join(rank_dir, "slot-0")) + \
        F.blank_bytes(s.root) and held.store
    # A byte of the memory copy flipped: named, skipped, the persisted copy used.
    with open(os.path.join(rank_dir, "slot-0"), "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.setenv(F.STEP_VAR, "5")
    step, back = ckpt.load()
    assert step == 5 and torch.equal(back["w"], state["w"])
    said = capsys.readouterr().err
    assert "the memory copy of step 5 (rank 1) is not good: chunk 0" in said, said
    s._pass()  # the copy marked corrupt is no longer reported as held
    assert P.parse(outbox.sent[-1]).memory == {}
    # And the persisted one corrupt too: no good copy of the agreed step anywhere.
    data = os.path.join(s.persist_dir, "step-000000000005", "rank-1.data")
    with open(data, "r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(F.CheckpointError, match="no good copy of step 5"):
        ckpt.load()


def test_only_the_newest_persisted_steps_are_kept(store):
    s, _ = store
    for step in range(4):
        ckpt.save(step, {"w": torch.zeros(10)})
        s._pass()
    assert F.persisted_steps(s.persist_dir, 1) == [3, 2]
    assert sorted(os.listdir(s.persist_dir)) == [".orchestrator-store", "step-000000000002",
                                                 "step-000000000003"]


def test_memory_is_bounded_as_configured(store, monkeypatch):
    monkeypatch.setenv(F.BUDGET_VAR, str(1 << 20))
    with pytest.raises(F.CheckpointError, match="fewer than two copies"):
        ckpt.save(0, {"w": torch.zeros(1 << 18)})  # 1 MiB: two copies would take 2


def test_without_an_agent_files_are_written_and_read_back(tmp_path, monkeypatch):
    for var in (F.MEMORY_VAR, F.STEP_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    assert ckpt.load() is None
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((4,), float(step))})
    assert ckpt.load()[0] == 2
    # A save every step for a week must not fill the disk: the newest two steps are kept,
    # or as many as ORCHESTRATOR_CHECKPOINT_KEEP says.
    for step in range(3, 8):
        ckpt.save(step, {"w": torch.full((4,), float(step))})
    assert sorted(os.listdir(tmp_path)) == ["step-000000000006", "step-000000000007"]
    monkeypatch.setenv(F.KEEP_VAR, "3")
    ckpt.save(8, {"w": torch.zeros(4)})
    assert F.persisted_steps(str(tmp_path), 0) == [8, 7, 6]
    monkeypatch.delenv(F.DIR_VAR)
    with pytest.raises(F.CheckpointError, match="no checkpoint store"):
        ckpt.save(3, {})


def held(memory=None, persisted=None, store=None) -> P.Held:
    return P.Held(1, {r: tuple(s) for r, s in (memory or {}).items()},
                  {r: tuple(s) for r, s in (persisted or {}).items()}, 0, store)


def test_every_rank_resumes_the_newest_step_all_can_load_where_they_run():
    h = Holdings()
    assert h.agreed_step({0: 0, 1: 1}) is None
    h.update(0, held({0: [4, 5, 6]}))
    h.update(1, held({1: [4, 5]}))
    assert h.agreed_step({0: 0, 1: 1}) == 5
    # Rank 1 moved to node 0, which holds nothing of it: nothing in common.
    assert h.agreed_step({0: 0, 1: 0}) is None
    # Persisted on a directory both nodes read (the same store id): any node finds it.
    h.update(0, held({0: [6]}, {0: [2], 1: [2]}, "shared"))
    h.update(1, held({}, {}, "shared"))
    assert h.agreed_step({0: 0, 1: 1}) == 2
    h.forget(0)  # node 0's channel closed: what it held is not counted
    assert h.agreed_step({0: 0, 1: 1}) is None


def test_a_retained_step_is_kept_while_memory_allows(store, monkeypatch):
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    for step in (0, 1):
        ckpt.save(step, {"w": torch.zeros(1 << 16)})  # 256 KiB
    F.write_file(os.path.join(s.root, "retain"), b"0")  # every rank's buddy holds step 0
    ckpt.save(2, {"w": torch.zeros(1 << 16)})
    rank_dir = os.path.join(s.root, "rank-1")
    assert {"step-0.meta", "step-1.meta", "step-2.meta"} <= set(os.listdir(rank_dir))
    monkeypatch.setenv(F.BUDGET_VAR, str(3 << 18))  # room for three copies, no more
    ckpt.save(3, {"w": torch.zeros(1 << 16)})  # memory full: the retained copy goes first
    assert not os.path.exists(os.path.join(rank_dir, "step-0.meta"))


def test_a_rank_keeps_no_more_copies_than_the_agent_shares_it_and_gives_the_rest_back(
        store, monkeypatch):
    """Every step from the retained one on is kept while memory allows; the copies the agent
    gives each rank bound that (what is left is the replicas'), and copies past a share that
    shrank become blanks, but never the newest, one being read, or the one written next."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    F.write_file(os.path.join(s.root, "retain"), b"0")  # every step from 0 on is retained
    rank_dir = os.path.join(s.root, "rank-1")

    def slots() -> list[str]:
        return sorted(n for n in os.listdir(rank_dir) if n.startswith("slot-"))

    for step in range(6):
        ckpt.save(step, {"w": torch.zeros(1 << 16)})  # 256 KiB
    assert len(slots()) == 6  # 64 MiB of memory: all kept
    F.write_file(os.path.join(s.root, F.COPIES_NAME), b"3")
    first = F.read_json(os.path.join(rank_dir, "step-0.meta"))["slot"]
    reader = os.open(os.path.join(rank_dir, f"slot-{first}"), os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)  # the agent sending step 0 to a buddy
    try:
        ckpt.save(6, {"w": torch.zeros(1 << 16)})
    finally:
        os.close(reader)
    steps = sorted(F.parse_step(n, suffix=".meta") for n in os.listdir(rank_dir)
                   if n.endswith(".meta"))
    assert steps == [0, 5, 6], steps  # step 0 was being read; 5 is the newest before 6
    assert len(slots()) == 3 and len(F.blanks(s.root)) == 3
    for step in range(7, 12):  # from now on the share holds: no slot more
        ckpt.save(step, {"w": torch.zeros(1 << 16)})
        assert len(slots()) <= 3
    assert ckpt._memory_copy(torch, 11) is not None


def test_the_agent_shares_memory_between_its_ranks_copies_and_its_buddys(store, monkeypatch):
    """Each rank's copies: three at least, two of each replica, the rest alike; a buddy's
    replicas as large as the node's own until they come."""
    from agents.memshare import share
    assert share(5 << 30, 1 << 30, 1 << 30) == 3  # 2 ranks of 512 MiB: 3 GiB own, 2 replicas
    assert share(1 << 30, 64 << 20, 64 << 20) == 8  # 3 + 704 MiB over 128 MiB a step
    assert share(4 << 30, 1 << 30, 1 << 30) == 2  # short: the replicas keep their two
    assert share(2 << 30, 1 << 30, 1 << 30) == 2  # shorter: the shim's minimum
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    ckpt.save(0, {"w": torch.zeros(1 << 20)})  # 4 MiB
    s._pass()
    copies = os.path.join(s.root, F.COPIES_NAME)
    size = F.read_json(os.path.join(s.root, "rank-1", "step-0.meta"))["size"]
    assert F.read_bytes(copies) == str(share(64 << 20, size, size)).encode()
    buddy = os.path.join(s.root, "replicas", "rank-5")  # a buddy's rank of 12 MiB
    os.makedirs(buddy)
    with open(os.path.join(buddy, "step-3.data"), "wb") as f:
        f.truncate(12 << 20)
    for suffix in (".meta", ".manifest"):
        F.write_file(os.path.join(buddy, "step-3" + suffix), b"{}")
    s._pass()
    assert F.read_bytes(copies) == str(share(64 << 20, size, 12 << 20)).encode()
    assert share(64 << 20, size, 12 << 20) == 4 < share(64 << 20, size, size) == 8


def test_a_new_attempt_drops_the_copies_of_steps_after_the_one_it_resumes(store, tmp_path):
    s, _ = store
    for step in (3, 4):
        ckpt.save(step, {"w": torch.zeros(10)})
        s._pass()
    assert F.persisted_steps(s.persist_dir, 1) == [4, 3]
    s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, 3), str(tmp_path), 2, 1)
    assert sorted(os.listdir(os.path.join(s.root, "rank-1"))) == [
        "slot-0", "slot-1", "step-3.manifest", "step-3.meta", "step-3.persisted"]
    assert F.persisted_steps(s.persist_dir, 1) == [3]
    s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, None), str(tmp_path), 3, 1)
    assert sorted(os.listdir(os.path.join(s.root, "rank-1"))) == ["slot-0", "slot-1"]
    assert F.persisted_steps(s.persist_dir, 1) == [3]  # a fresh start may resume from disk


def test_what_a_save_held_and_where_a_load_came_from_reach_status(store, monkeypatch):
    """Per save: bytes and the seconds the training was held; per load: which copy, how long,
    bad copies skipped. The agent reports them in ``held``, the door takes them, and the
    controller's summary (status, Prometheus) shows them for the current attempt."""
    s, outbox = store
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "1")
    held_for = ckpt.save(7, {"w": torch.randn(1 << 16)})
    s._pass()
    held = P.parse(outbox.sent[-1])
    assert isinstance(held, P.Held)
    ((step, size, block),) = held.saves.values()
    assert (step, size) == (7, 4 << 16) and 0 < block <= held_for, held.saves
    # The memory copy broken: the load takes the persisted one, and says it skipped one.
    with open(os.path.join(s.root, "rank-1", "slot-0"), "r+b") as f:
        f.write(b"\xff" * 8)
    monkeypatch.setenv(F.STEP_VAR, "7")
    assert ckpt.load()[0] == 7
    s._pass()
    held = P.parse(outbox.sent[-1])
    assert isinstance(held, P.Held)
    assert held.restored[1][:3] == (1, 7, "persisted") and held.restored[1][4] >= 1
    book = Holdings()
    book.update(0, held)
    shown = book.summary(0)
    assert shown is not None
    assert shown["last_save"] == {"step": 7, "bytes": 4 << 16, "block_s": block}
    assert shown["restored"]["1"]["source"] == "persisted"


def test_the_newest_save_shown_is_one_every_rank_of_the_node_made():
    """Rank 0 reported its save of step 6 before rank 1 did: the node's newest save is still
    step 5, with both ranks' bytes (it showed step 6 with rank 0's alone)."""
    book = Holdings()
    book.update(0, P.Held(2, {0: (5, 6), 1: (5,)}, {}, 3 << 20, None,
                          saves={0: (6, 1 << 20, 0.25), 1: (5, 1 << 20, 0.5)}))
    shown = book.summary(0)
    assert shown is not None
    assert shown["last_save"] == {"step": 5, "bytes": 2 << 20, "block_s": 0.5}
    book.update(0, P.Held(2, {0: (5, 6), 1: (5, 6)}, {}, 4 << 20, None,
                          saves={0: (6, 1 << 20, 0.25), 1: (6, 1 << 20, 0.125)}))
    assert book.summary(0)["last_save"] == {  # type: ignore[index]
        "step": 6, "bytes": 2 << 20, "block_s": 0.25}


@pytest.mark.parametrize("record", [
    '{"attempt": 1, "step": 7, "source": "elsewhere", "seconds": 0.1, "skipped": 0}',
    '{"attempt": 1, "step": -7, "source": "memory", "seconds": 0.1, "skipped": 0}',
    '{"attempt": 1, "step": 7, "source": "memory", "seconds": NaN, "skipped": 0}',
    '[1, 7, "memory", 0.1, 0]', '{"attempt": "1"}', "x" * 5000])
def test_a_load_record_the_worker_garbled_is_not_reported(store, record):
    s, outbox = store
    ckpt.save(7, {"w": torch.zeros(4)})
    with open(os.path.join(s.root, "rank-1", "restored.json"), "w") as f:
        f.write(record)
    s._pass()
    held = P.parse(outbox.sent[-1])
    assert isinstance(held, P.Held) and held.memory == {1: (7,)} and held.restored == {}


@pytest.mark.parametrize("bad", [{"saves": {"1": [7, 10]}}, {"saves": {"1": [7, 10, -1.0]}},
                                 {"saves": {"1": [7, 10, "0.1"]}},
                                 {"restored": {"1": [1, 7, "disk", 0.1, 0]}},
                                 {"restored": {"1": [1, 7, "memory", 0.1, True]}}])
def test_the_door_refuses_a_held_with_a_bad_save_or_load(bad):
    message = {"type": "held", "attempt": 1, "memory": {"1": [7]}, "persisted": {},
               "bytes": 0, **bad}
    assert P.check(message) is not None


def test_a_loaded_rng_state_can_be_set_again(tmp_path):
    """torch.set_rng_state of a state as load() gives it back: with the state a view into the
    copy's one buffer, torch read the wrong bytes (a crash, or 'Invalid mt19937 state').
    In a process of its own, since the failure may be a segfault."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from agents.shims import orchestrator_checkpoint as ckpt\n"
        "ckpt.save(3, {'w': torch.zeros(1 << 18), 'rng': torch.get_rng_state(),\n"
        "              'after': torch.zeros(100)})\n"
        "want = torch.rand(4)\n"
        "step, state = ckpt.load()\n"
        "torch.set_rng_state(state['rng'])\n"
        "assert torch.equal(torch.rand(4), want)\n"
        "assert state['rng'].untyped_storage().nbytes() == state['rng'].numel()\n"
        "print('same draws')\n")
    env = {**os.environ, "RANK": "0", F.DIR_VAR: str(tmp_path / "ck")}
    for name in (F.MEMORY_VAR, F.STEP_VAR):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0 and "same draws" in done.stdout, (done.returncode, done.stderr)


def test_a_save_wakes_the_store_at_once(store, monkeypatch):
    """The store's thread looks for saves rarely when idle (LOOK_EVERY); a save pokes it, so
    it is sealed (and replicated) at once, not at the next look."""
    import time

    from agents import storewake

    monkeypatch.setattr(storewake, "LOOK_EVERY", 60.0)
    monkeypatch.setattr(storewake, "SCAN_EVERY", 60.0)
    s, _ = store
    s.start()
    time.sleep(0.3)  # its first pass done: now it waits
    assert os.path.exists(os.path.join(s.root, F.WAKE_NAME))
    ckpt.save(4, {"w": torch.ones(1000)})
    manifest = os.path.join(s.root, "rank-1", "step-4.manifest")
    deadline = time.monotonic() + 10
    while not os.path.exists(manifest):
        assert time.monotonic() < deadline, os.listdir(os.path.join(s.root, "rank-1"))
        time.sleep(0.01)


def test_a_save_after_the_agent_removed_its_memory_makes_none_again(store):
    """A worker that outlived its agent: its save fails, and the memory the agent removed
    stays removed (a directory made again would stay on /dev/shm)."""
    s, _ = store
    ckpt.save(1, {"w": torch.zeros(4)})
    s.close()
    with pytest.raises(F.CheckpointError, match="is gone"):
        ckpt.save(2, {"w": torch.zeros(4)})
    assert not os.path.exists(s.root)


def test_a_loaded_state_is_mapped_and_no_later_save_changes_it(store, monkeypatch):
    """A memory copy loads as a private mapping of its slot (no copy): the training's writes
    stay its own, and when the same process saves into that slot again, the slot is a new
    file, so the tensors it loaded keep their values and the agent seals the new save."""
    s, _ = store
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: a view of the mapping
    ckpt.save(0, {"w": big})
    ckpt.save(1, {"w": big + 1})
    s._pass()
    monkeypatch.setenv(F.STEP_VAR, "0")
    _, state = ckpt.load()
    w = state["w"]
    assert w.untyped_storage().nbytes() > w.numel() * 4 - 1  # the mapping, not a copy of it
    w[:4] = -1.0  # the training's own writes
    rank_dir = os.path.join(s.root, "rank-1")
    slot0 = os.path.join(rank_dir, "slot-0")
    before = os.stat(slot0).st_ino
    monkeypatch.setenv(F.STEP_VAR, "1")
    ckpt.load()
    ckpt.save(2, {"w": big * 2})  # into slot 0, step 0's: the one this process loaded
    assert os.stat(slot0).st_ino != before
    assert torch.equal(w[4:], big[4:]) and torch.equal(w[:4], torch.full((4,), -1.0))
    s._pass()
    monkeypatch.setenv(F.STEP_VAR, "2")
    assert torch.equal(ckpt.load()[1]["w"], big * 2)  # sealed and verified: the new file
    assert sorted(n for n in os.listdir(rank_dir) if n.startswith("slot-")) == \
        ["slot-0", "slot-1"]


def test_a_loaded_copy_let_go_past_the_share_is_no_blank(store, monkeypatch):
    """A copy past a rank's share goes back as a blank, which the next copy the node writes
    takes; one this process loaded (a private mapping of it) is removed instead, so that
    nothing writes under the tensors it loaded."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    F.write_file(os.path.join(s.root, "retain"), b"0")  # every step kept while memory allows
    big = torch.arange(1 << 18, dtype=torch.float32)
    for step in range(4):
        ckpt.save(step, {"w": big + step})
    s._pass()
    monkeypatch.setenv(F.STEP_VAR, "0")
    w = ckpt.load()[1]["w"]  # step 0's slot, mapped
    loaded = os.stat(os.path.join(s.root, "rank-1", "slot-0")).st_ino
    F.write_file(os.path.join(s.root, F.COPIES_NAME), b"2")
    ckpt.save(4, {"w": big * 0})
    assert loaded not in {os.stat(path).st_ino for _, path in F.blanks(s.root)}
    for length, path in F.blanks(s.root):  # the next copies write into every blank
        with open(path, "r+b") as f:
            f.write(b"\xff" * length)
    assert torch.equal(w, big)


def test_save_every_n_saves_its_multiples_and_the_step_a_planned_move_asks_for(
        store, monkeypatch):
    """``save(step, state, every=N)`` at every step saves the multiples of N, and the step the
    controller asked for (``save_at``), where it then waits until the request is over or its
    hold ends; a new attempt forgets the request."""
    import time

    s, _ = store
    rank_dir = os.path.join(s.root, "rank-1")
    s.save_at(C.SaveAt(7, 0.3))
    assert [ckpt.due(step, every=5) for step in (5, 6, 7, 8)] == [True, False, True, False]
    held = {}
    for step in range(12):
        started = time.monotonic()
        blocked = ckpt.save(step, {"w": torch.full((10,), float(step))}, every=5)
        held[step] = time.monotonic() - started
        assert (blocked > 0) == (step in (0, 5, 7, 10)), (step, blocked)
    assert sorted(M.metas_of(rank_dir)) == [0, 5, 7, 10]
    assert held[7] >= 0.25 and max(v for k, v in held.items() if k != 7) < 0.25, held
    s.save_at(C.SaveAt(None))  # over: the step is saved, and nobody waits for it
    assert not ckpt.due(7, every=5)
    s.save_at(C.SaveAt(13, 60.0))
    s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20), "/tmp", 2, 1)  # the next attempt
    assert not ckpt.due(13, every=5)
    with pytest.raises(F.CheckpointError, match="every must be a positive integer"):
        ckpt.save(15, {"w": torch.zeros(1)}, every=0)


def test_save_reports_the_step_as_a_heartbeat_does_keeping_the_scripts_own(tmp_path,
                                                                         monkeypatch):
    """A script that saves every N steps still tells its agent where it is at every step (a
    planned move agrees on a step ahead of it), into the heartbeat file, with what the
    script's own heartbeat() put there kept; at most five times a second."""
    import json

    from agents.shims.orchestrator_worker import heartbeat

    beat = tmp_path / "heartbeat"
    monkeypatch.setenv("ORCHESTRATOR_HEARTBEAT_FILE", str(beat))
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path / "ck"))
    monkeypatch.delenv(F.MEMORY_VAR, raising=False)
    heartbeat(step=3, total_steps=100, loss=0.5)
    monkeypatch.setattr(F, "_reported", [0.0])
    ckpt.save(4, {"w": torch.zeros(2)}, every=10)  # not saved, but reported
    assert json.loads(beat.read_text()) == {"step": 4, "total_steps": 100,
                                            "metrics": {"loss": 0.5}}
    ckpt.save(5, {"w": torch.zeros(2)}, every=10)  # within 0.2 s: not written again
    assert json.loads(beat.read_text())["step"] == 4


def test_a_node_that_stays_in_a_planned_move_replicates_only_after_it(store, tmp_path):
    """The move waits for the leaving node's copies on a node that stays; the staying nodes'
    own copies are needed nowhere else for it, so they wait, and do not compete with those."""
    from agents.replicas import Server

    s, _ = store
    buddy = Server(str(tmp_path / "buddy"), "s3cret", lambda: 1 << 30, lambda _: None)
    try:
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.port))
        s.save_at(C.SaveAt(7, 0.05, replicate=False))  # this node stays
        ckpt.save(7, {"w": torch.ones(10)})
        s._pass()
        assert "rank-1" in os.listdir(s.root) and buddy.holdings() == ({}, 0)
        s.save_at(C.SaveAt(None))  # the move is over (or undrained): sent now
        s._pass()
        assert buddy.holdings()[0] == {1: [7]}
        s.save_at(C.SaveAt(9, 0.05))  # this node leaves: its copy goes at once
        ckpt.save(9, {"w": torch.ones(10)})
        s._pass()
        assert sorted(buddy.holdings()[0][1]) == [7, 9]
    finally:
        buddy.close()


def test_a_move_sends_only_its_step_and_an_attempt_none_older_than_it_resumed(store, tmp_path):
    """While a move lasts, a leaving node sends only the step it asked for (older ones
    would slow every rank's save of it); a resuming attempt sends nothing until its ranks
    loaded, and no step older than the one it resumed (it will never resume those)."""
    from agents.replicas import Server

    s, _ = store
    for step in (3, 5):
        ckpt.save(step, {"w": torch.full((10,), float(step))})
    s._pass()
    buddy = Server(str(tmp_path / "buddy"), "s3cret", lambda: 1 << 30, lambda _: None)
    try:
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.port))
        s.save_at(C.SaveAt(6, 0.05))
        s._pass()
        assert buddy.holdings() == ({}, 0)  # the asked step is not saved yet: nothing
        ckpt.save(6, {"w": torch.ones(10)})
        s._pass()
        assert buddy.holdings()[0] == {1: [6]}
        s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, restore_step=5), str(tmp_path),
                    2, 1)
        other = Server(str(tmp_path / "other"), "s3cret", lambda: 1 << 30, lambda _: None)
        try:
            s.replicate_to(C.ReplicateTo("127.0.0.1", other.port))
            s._pass()
            assert other.holdings() == ({}, 0)  # its ranks load first
            record = {"attempt": 2, "step": 5, "source": "memory", "seconds": 0.1,
                      "skipped": 0}
            F.write_file(os.path.join(s.root, "rank-1", "restored.json"),
                         json.dumps(record).encode())
            s._pass()
            assert sorted(other.holdings()[0][1]) == [5]  # 6 was discarded: after 5
        finally:
            other.close()
    finally:
        buddy.close()


def test_saves_faster_than_the_network_send_the_newest_not_a_queue(store, tmp_path):
    """Three saves sealed while a push could not keep up: only the newest goes (sending them
    in order, a rank's copies elsewhere fall ever further behind its saves)."""
    from agents.replicas import Server

    s, _ = store
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((10,), float(step))})
    s._pass()
    buddy = Server(str(tmp_path / "buddy"), "s3cret", lambda: 1 << 30, lambda _: None)
    try:
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.port))
        s._pass()
        assert buddy.holdings()[0] == {1: [3]}
        ckpt.save(4, {"w": torch.ones(10)})
        s._pass()
        assert sorted(buddy.holdings()[0][1]) == [3, 4]
    finally:
        buddy.close()


def test_a_slot_that_could_not_grow_still_takes_a_smaller_save(tmp_path, monkeypatch):
    """A full /dev/shm refused a slot's growth after its mapping was closed; the next,
    smaller save found the closed mapping and failed in the user's training."""
    import errno

    path = str(tmp_path / "slot-0")
    slot = M._Slot(path, os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    slot.ensure(4096)
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpt.os, "posix_fallocate", full)
    with pytest.raises(OSError):
        slot.ensure(1 << 20)
    monkeypatch.setattr(ckpt.os, "posix_fallocate", real)
    slot.ensure(4096)
    slot.map[:4] = b"abcd"  # a mapping, open
    slot.map.close()
    os.close(slot.fd)


def test_a_wake_after_the_store_closed_writes_into_no_file(tmp_path):
    """A pull's thread ends (and wakes the store) after the store closed: the wake wrote a
    byte to the closed pipe's descriptor number, into whatever file had it next."""
    from agents.storewake import Wake

    wake = Wake()
    wake.close()
    files = [open(tmp_path / f"f{i}", "wb") for i in range(4)]  # noqa: SIM115
    try:
        wake.set()
        wake.wait()  # a store thread that outlived the close: no error, no read
    finally:
        for f in files:
            f.close()
    assert all((tmp_path / f"f{i}").read_bytes() == b"" for i in range(4))


def test_a_persist_the_disk_refuses_leaves_no_part_of_a_copy(store, tmp_path, monkeypatch):
    """A full disk (or a copy changed while written) failed the persist and left its
    ``.data.tmp`` in checkpoint.dir for good: no later trim looks at it."""
    import errno

    from agents import checkpoints

    s, _ = store
    ckpt.save(1, {"w": torch.ones(1000)})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoints.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):  # the disk's error, said by the
        s._pass()  # store's thread (it was a BufferError: the slot's mapping still in use)
    assert [p.name for p in (tmp_path / "ck").rglob("*.tmp")] == []


def test_a_step_sealed_before_a_stop_asked_it_persisted_is_persisted_then(store, tmp_path,
                                                                          monkeypatch):
    """A move that became a whole-job stop once more nodes were noticed asks every node again
    to persist its step, which their ranks had saved (and the agent sealed) already: the seal
    alone persisted, so the step never reached checkpoint.dir and the job could not stop
    PREEMPTED at it. The request wakes the store, which persists the sealed copy, once."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "1000")  # the script's own saves persist nothing
    s.configure(C.CheckpointConfig("ck", 1000, 2, 64 << 20), str(tmp_path), 1, 1)
    s.save_at(C.SaveAt(7, 0.05, replicate=False))  # a move in which this node stays
    ckpt.save(7, {"w": torch.full((1000,), 7.0)})
    s._pass()
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == []
    woken = []
    monkeypatch.setattr(s._wake, "set", lambda: woken.append(True))
    s.save_at(C.SaveAt(7, 0.05, persist=True, replicate=False))  # now the whole job stops
    assert woken  # its ranks hold at the step: no save of theirs wakes the store
    s._pass()
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == [7]
    _, state = ckpt.persisted_copy(torch, str(tmp_path / "ck"), 7)
    assert torch.equal(state["w"], torch.full((1000,), 7.0))
    (tmp_path / "ck" / os.path.basename(F.persisted_dir("", 7)) / "rank-1.manifest").unlink()
    s._pass()  # tried once
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == []


def test_a_seal_under_way_when_an_attempt_discards_its_step_leaves_nothing_of_it(
        store, tmp_path, monkeypatch):
    """The seal of a big state takes seconds. A new attempt that resumed an older step
    discarded the step being sealed meanwhile, then the seal wrote its manifest and its
    persisted copy all the same: the new timeline's save of that step looked sealed (never
    sealed, persisted or replicated, its load failing), and the load fell to the persisted
    copy of the old timeline, which verified: one rank resumed other weights than every
    other rank's. Found by a reading helper."""
    import threading
    import time

    s, _ = store
    rank_dir = os.path.join(s.root, "rank-1")
    ckpt.save(100, {"w": torch.full((1000,), 100.0)})
    s._pass()
    ckpt.save(110, {"w": torch.full((1000,), 110.0)})  # the old timeline's 110
    checksums = F.checksums

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return checksums(*args, **kwargs)
    monkeypatch.setattr(F, "checksums", slow)
    sealing = threading.Thread(target=s._pass)
    sealing.start()
    time.sleep(0.1)  # in the seal of 110: attempt 2 resumes step 100
    s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, 100), str(tmp_path), 2, 1)
    sealing.join()
    monkeypatch.setattr(F, "checksums", checksums)
    assert [n for n in os.listdir(rank_dir) if n.startswith("step-110")] == []
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == [100]
    ckpt.save(110, {"w": torch.full((1000,), -110.0)})  # the new timeline's 110
    s._pass()
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == [110, 100]
    monkeypatch.setenv(F.STEP_VAR, "110")  # the next attempt resumes it
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "3")
    step, state = ckpt.load()
    assert step == 110 and torch.equal(state["w"], torch.full((1000,), -110.0))


def test_ranks_that_resume_an_older_step_than_told_leave_no_copy_of_the_old_timeline(
        store, tmp_path, monkeypatch):
    """Every rank was told step 100 and resumed 90 (a copy of 100 did not verify). The copies
    of the steps between, saved before the attempt, stayed: the node's newest by number, so
    it was sent (its buddy kept the old timeline's 100) and the new 100 never was; a node's
    loss then resumed ranks from two timelines. Told so (C.Resumed), the node and its buddy
    let go of them, keep what the attempt saved, and the new copies go. Found by a reading
    helper."""
    s, _ = store
    buddy = Store(f"unit-{secrets.token_hex(4)}", 1, Outbox(), "s3cret")  # type: ignore[arg-type]
    buddy.configure(C.CheckpointConfig(memory=64 << 20), str(tmp_path / "b"), 1, 1)
    buddy.start()
    try:
        assert buddy.replicas is not None
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.replicas.port))
        monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "1")
        for step in (90, 100):  # the old timeline
            ckpt.save(step, {"w": torch.full((10,), float(step))})
            s._pass()
        assert sorted(buddy.replicas.holdings()[0][1]) == [90, 100]
        for node in (s, buddy):  # attempt 2 is told step 100 ...
            node.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, 100), str(tmp_path), 2, 1)
        monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "2")
        ckpt.note_restored(90, "memory", 0.0)  # ... and its ranks resumed 90
        ckpt.save(95, {"w": torch.full((10,), -95.0)})
        s._pass()
        for node in (s, buddy):
            node.resumed(C.Resumed(90, 2))
        s._pass()
        rank_dir = os.path.join(s.root, "rank-1")
        assert sorted(M.metas_of(rank_dir)) == [95]  # the old 100 gone (90's slot reused)
        assert 100 not in F.persisted_steps(str(tmp_path / "ck"), 1)
        assert sorted(buddy.replicas.holdings()[0][1]) == [90, 95]
        ckpt.save(100, {"w": torch.full((10,), -100.0)})  # the new timeline's 100
        s._pass()
        meta = json.loads(F.read_bytes(os.path.join(buddy.replicas.root, "rank-1",
                                                    "step-100.meta")))
        assert meta["attempt"] == 2  # the buddy holds the new 100, not the old
    finally:
        buddy.close()


def test_a_copy_under_way_when_an_attempt_resumes_an_older_step_is_of_no_timeline(
        store, tmp_path):
    """A push of step 3 under way while a restart resumes step 1 (the ranks that saved 2
    and 3 never reached them in the new timeline): it ended, and the buddy kept nothing of
    it. It went on before, the buddy kept the old timeline's step 3, the node took it as
    sent, and the new attempt's own step 3 never went: a node's loss could resume a rank
    from a state the other ranks never followed."""
    import threading
    import time

    from agents.replicas import Server

    s, _ = store
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((1 << 18,), float(step))})
    s._pass()
    arrived, go = threading.Event(), threading.Event()

    def room() -> int:  # the buddy takes its time before it answers
        arrived.set()
        go.wait(10)
        return 1 << 30
    buddy = Server(str(tmp_path / "buddy"), "s3cret", room, lambda _: None)
    try:
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.port))
        pushing = threading.Thread(target=s._pass)
        pushing.start()
        assert arrived.wait(10)
        s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, 1), str(tmp_path), 2, 1)
        buddy.attempt = 2  # the buddy's agent is told the new attempt too
        go.set()
        pushing.join(10)
        time.sleep(0.2)
        # Nothing taken as sent: the new timeline's step 3 goes when it is saved.
        assert s._pushed == {} and buddy.holdings()[0] == {}
    finally:
        go.set()
        buddy.close()


def test_each_ranks_copy_is_held_while_the_ranks_before_it_are_sent(store, tmp_path,
                                                                     monkeypatch):
    """Two ranks on the node; while rank 0's copy goes (seconds at 512 MiB), rank 1 saves
    twice more, which writes over the slot of its sealed save: that save still goes, as it
    was held (a shared lock) before the first push began. When it was looked up only at its
    turn, it was gone, and saves that came this fast never had a copy on another node
    (measured: the second rank of each node, and a cut node's job started from scratch)."""
    from agents import checkpoints as store_module
    from agents.replicas import Server

    s, _ = store
    buddy = Server(str(tmp_path / "buddy"), "s3cret", lambda: 1 << 30, lambda _: None)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        ckpt.save(5, {"w": torch.full((10,), 5.0)})
    real_push = store_module.push_replica

    def push_while_rank_1_saves(*args, **kwargs):
        if args[3] == 0:  # rank 0's copy goes; meanwhile rank 1 saves steps 6 and 7
            monkeypatch.setenv("RANK", "1")
            for step in (6, 7):
                ckpt.save(step, {"w": torch.full((10,), float(step))})
        return real_push(*args, **kwargs)

    try:
        monkeypatch.setattr(store_module, "push_replica", push_while_rank_1_saves)
        s.replicate_to(C.ReplicateTo("127.0.0.1", buddy.port))
        s._pass()
        assert buddy.holdings()[0] == {0: [5], 1: [5]}
    finally:
        buddy.close()


def test_heartbeats_and_saves_from_two_threads_never_leave_a_torn_record(tmp_path,
                                                                         monkeypatch):
    """A script's heartbeat() in its training loop and a save() on another thread (DCP's
    async_save writes from one) both write the heartbeat file: each write whole, never one
    cut short by the other (both wrote through the same temporary name: the agent then read
    half a record, or none)."""
    import json
    import threading

    from agents.shims.orchestrator_worker import heartbeat

    beat = tmp_path / "heartbeat"
    monkeypatch.setenv("ORCHESTRATOR_HEARTBEAT_FILE", str(beat))
    monkeypatch.setattr(F, "REPORT_EVERY", 0.0)
    heartbeat(step=0, loss=0.5)
    done = threading.Event()
    torn = []

    def read() -> None:
        while not done.is_set():
            text = beat.read_text()
            try:
                json.loads(text)
            except ValueError:
                torn.append(text)

    def beats() -> None:
        for step in range(1000):
            heartbeat(step=step, total_steps=1000, loss=float(step),
                      **{f"m{i}": 1.0 for i in range(50)})

    def reports() -> None:
        for step in range(1000):
            F.report_step(step)
    threads = [threading.Thread(target=f) for f in (beats, reports)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert not torn, torn[:3]
    assert json.loads(beat.read_text())["step"] in range(1000)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "heartbeat"]


def test_a_save_reports_no_step_older_than_the_one_the_file_says(tmp_path, monkeypatch):
    """A save's step report (``save`` at each step, or a ``dcp.async_save``'s thread writing
    a step the training has passed) puts no older step back over a newer one the script's
    heartbeat wrote: the agreed step of a planned move starts from the highest step reported.
    Its metrics and total stay."""
    from agents.shims.orchestrator_worker import heartbeat

    beat = tmp_path / "heartbeat"
    monkeypatch.setenv("ORCHESTRATOR_HEARTBEAT_FILE", str(beat))
    monkeypatch.setattr(F, "REPORT_EVERY", 0.0)
    heartbeat(step=12, total_steps=100, loss=0.5)
    F.report_step(10)
    assert json.loads(beat.read_text()) == {"step": 12, "total_steps": 100,
                                            "metrics": {"loss": 0.5}}
    F.report_step(13)
    assert json.loads(beat.read_text()) == {"step": 13, "total_steps": 100,
                                            "metrics": {"loss": 0.5}}


def test_a_save_of_this_attempt_persisting_when_its_ranks_resumed_older_stays_persisted(
        store, tmp_path, monkeypatch):
    """Attempt 2's ranks were told step 100 and resumed 90 (C.Resumed, while the agent was
    persisting attempt 2's own save of 95): the seal took any new timeline for a discard of
    its step and removed 95's persisted copy, which stayed sealed in memory and so was never
    persisted again. A Resumed keeps the attempt's own saves: so does the seal. Found by a
    reading helper."""
    from agents import disk

    s, _ = store
    s.configure(C.CheckpointConfig("ck", 1, 2, 64 << 20, 100), str(tmp_path), 2, 1)
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "2")
    persist = disk.persist

    def told_meanwhile(*args, **kwargs):
        persist(*args, **kwargs)
        s.resumed(C.Resumed(90, 2))  # the ranks' loads said 90
    monkeypatch.setattr(disk, "persist", told_meanwhile)
    ckpt.save(95, {"w": torch.full((10,), 95.0)})
    s._pass()
    assert F.persisted_steps(str(tmp_path / "ck"), 1) == [95]
    assert os.path.exists(os.path.join(s.root, "rank-1", F.step_name(95) + ".persisted"))


def test_two_nodes_behind_their_saves_send_copies_that_meet_on_common_steps(
        store, tmp_path, monkeypatch):
    """Two nodes send to one spare, each too slow for every save and out of phase: node A
    finds two new saves at each of its passes (steps 1 and 2, 3 and 4, ...), node B too
    (2 and 3, 4 and 5, ...). Each sending its newest, A sent the even steps and B the odd
    ones: no step of both ranks was on the spare, and a cut node's job resumed far back
    (measured: up to 9 steps of 2 s where the copies were 2 steps behind). Sent at
    multiples of a stride (agents/stride.py), they meet on the newest step B sent."""
    from agents.replicas import Server

    a, _ = store  # its rank 1
    b = Store(f"unit-{secrets.token_hex(4)}", 1, Outbox(), "s3cret")  # type: ignore[arg-type]
    b.configure(C.CheckpointConfig(memory=64 << 20), str(tmp_path / "b"), 1, 1)
    spare = Server(str(tmp_path / "spare"), "s3cret", lambda: 1 << 30, lambda _: None)
    try:
        for node in (a, b):
            node.replicate_to(C.ReplicateTo("127.0.0.1", spare.port))
        for step in range(1, 13):
            for node, rank in ((a, "1"), (b, "0")):
                monkeypatch.setenv(F.MEMORY_VAR, node.root)
                monkeypatch.setenv("RANK", rank)
                ckpt.save(step, {"w": torch.full((10,), float(step))})
            (b if step % 2 else a)._pass()
        kept = spare.holdings()[0]
        assert max(set(kept[0]) & set(kept[1])) == max(kept[0]) == 10, kept
    finally:
        spare.close()
        b.close()
