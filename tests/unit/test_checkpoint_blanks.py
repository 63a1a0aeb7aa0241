"""Blanks: the pages of copies a node's store let go, kept for the next copies it writes
whole (a new pages' cost measured in docs/benchmarks.md). A rank's new slot takes one, cut to
its size; they count as memory held, are free to a buddy's replica, and go once memory is
over checkpoint.memory. A rank whose next save would find no slot with pages asks for one,
which the store makes ahead (agents/pages.py). The replicas' side is in test_replicas.py."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import torch

from agents import pages
from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from tests.unit.test_checkpoint_store import store  # noqa: F401  (a fixture)


def blank(root: str, size: int, fill: int = 7) -> int:
    """A blank of ``size`` bytes in the memory at ``root``, as a let-go replica leaves; its
    inode."""
    path = os.path.join(root, "let-go.data")
    with open(path, "wb") as f:
        f.write(bytes([fill]) * size)
    F.give_blank(root, path)
    assert not os.path.exists(path)
    (found,) = F.blanks(root)
    return os.stat(found[1]).st_ino


def test_a_ranks_new_slot_takes_a_blank_cut_to_its_size(store):  # noqa: F811
    s, _ = store
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}  # 256 KiB
    inode = blank(s.root, (1 << 18) + 4096)  # a bigger one: cut to the save's size
    assert ckpt.save(0, state) > 0
    rank_dir = os.path.join(s.root, "rank-1")
    slots = sorted(n for n in os.listdir(rank_dir) if n.startswith("slot-"))
    assert slots == ["slot-0"] and F.blanks(s.root) == []
    assert os.stat(os.path.join(rank_dir, "slot-0")).st_ino == inode
    assert os.path.getsize(os.path.join(rank_dir, "slot-0")) == 1 << 18
    ckpt.save(1, state)  # a second slot, and no blank left: a file of its own
    s._pass()  # sealed: the copy in the blank's pages verifies
    step, loaded = ckpt.load()
    assert step == 1 and torch.equal(loaded["w"], state["w"])
    ckpt.release()


def test_blanks_are_memory_held_free_to_a_replica_and_go_over_the_bound(store):  # noqa: F811
    s, _ = store
    room = s._room()
    blank(s.root, 1 << 20)
    assert s.holdings()["bytes"] == 1 << 20  # shown in status as held
    assert s._room() == room  # a buddy's replica would take it
    s._pass()
    assert len(F.blanks(s.root)) == 1  # within checkpoint.memory (64 MiB): kept
    s.config = dataclasses.replace(s.config, memory=1 << 19)  # the ranks' slots grew into it
    s._pass()
    assert F.blanks(s.root) == [] and s.holdings()["bytes"] == 0


def made(root: str) -> int:
    """The inode of the one blank the store made on its thread (waited for)."""
    deadline = time.monotonic() + 10
    while not F.blanks(root) and time.monotonic() < deadline:
        time.sleep(0.01)
    (found,) = F.blanks(root)
    return os.stat(found[1]).st_ino


def slot_inode(root: str, number: int) -> int:
    return os.stat(os.path.join(root, "rank-1", f"slot-{number}")).st_ino


def test_a_ranks_second_save_takes_pages_the_store_made_ahead(store, monkeypatch):  # noqa: F811
    """The newest copy is never written, so a rank's second save needs a second slot: the
    first asks, the store writes the pages while the rank trains, the second takes them. A
    rank whose next save has a slot to reuse asks for nothing."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}  # 256 KiB
    ckpt.save(0, state)
    assert F.int_file(F.blank_asked(s.root, 1)) == 1 << 18
    s._pass()
    inode = made(s.root)
    assert not os.path.exists(F.blank_asked(s.root, 1))  # taken
    assert s.holdings()["bytes"] == 2 << 18  # the blank is memory held
    ckpt.save(1, state)
    assert slot_inode(s.root, 1) == inode and F.blanks(s.root) == []
    assert not os.path.exists(F.blank_asked(s.root, 1))  # the next save reuses slot-0
    ckpt.save(2, state)
    assert slot_inode(s.root, 0) != inode and not os.path.exists(F.blank_asked(s.root, 1))
    s._pass()
    monkeypatch.setenv(F.STEP_VAR, "2")
    step, loaded = ckpt.load()  # sealed: the copy in the made pages verifies
    assert step == 2 and torch.equal(loaded["w"], state["w"])
    ckpt.release()


def test_the_slot_a_load_mapped_is_written_again_into_pages_made_ahead(store, monkeypatch):  # noqa: F811,E501
    """A restarted rank maps the copy it loads; the save that would write that slot writes a
    new file in its place (nothing changes under the loaded tensors), and that file is a
    blank the store made once the load asked for it."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    big = torch.arange(1 << 16, dtype=torch.float32)
    ckpt.save(0, {"w": big})
    s._pass()
    made(s.root)
    ckpt.save(1, {"w": big + 1})  # takes it
    s._pass()
    assert F.blanks(s.root) == []
    ckpt.release()
    monkeypatch.setenv(F.STEP_VAR, "1")
    w = ckpt.load()[1]["w"]  # slot-1, mapped; and pages asked for
    assert F.int_file(F.blank_asked(s.root, 1)) == 1 << 18
    ckpt.save(2, {"w": big * 0})  # into slot-0; the next save writes slot-1 again
    s._pass()
    inode = made(s.root)
    ckpt.save(3, {"w": big * 0})
    assert slot_inode(s.root, 1) == inode
    assert torch.equal(w, big + 1)  # the loaded tensors as they were
    ckpt.release()


def test_a_blank_asked_for_past_checkpoint_memory_or_not_a_size_is_none(store):  # noqa: F811
    s, _ = store
    room = s.config.memory - s.holdings()["bytes"]
    os.makedirs(os.path.join(s.root, F.BLANK_DIR), exist_ok=True)
    for asked in ("-5", "0", "lots"):
        F.write_file(F.blank_asked(s.root, 3), asked.encode())
        assert pages.asked(s.root, 3) is None
        assert not os.path.exists(F.blank_asked(s.root, 3))  # the request went all the same
    maker = pages.Maker(s.root, lambda: room)
    F.write_file(F.blank_asked(s.root, 3), str(room + 1).encode())
    maker.tend([3])  # more than the room it has
    assert maker._making == {} and F.blanks(s.root) == []
    assert not os.path.exists(F.blank_asked(s.root, 3))


def test_a_save_waits_for_the_blank_being_made_for_it_and_withdraws_its_request(
        store, monkeypatch):  # noqa: F811
    """Writing new pages beside the agent writing them took longer than either alone: a
    rank's save that needs a new slot waits for the blank its agent is making for it; one
    whose request the agent has not taken up yet withdraws it (the blank would lie idle)."""
    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "0")
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    ckpt.save(0, state)  # asks
    directory = os.path.join(s.root, F.BLANK_DIR)
    making = os.path.join(directory, F.making_prefix(1) + "x")
    with open(making, "wb") as f:
        f.write(bytes(1 << 18))
    inode = os.stat(making).st_ino
    done = threading.Timer(0.3, os.rename, (making, os.path.join(directory, "made")))
    done.start()
    started = time.monotonic()
    ckpt.save(1, state)
    done.join()
    assert time.monotonic() - started >= 0.3
    assert slot_inode(s.root, 1) == inode
    assert F.blanks(s.root) == [] and not os.path.exists(F.blank_asked(s.root, 1))
    ckpt.release()


def test_stop_waits_for_a_blank_under_way(store):  # noqa: F811
    """The store's close removes its memory once its makers are done: one still writing
    beside the removal left the memory behind with a file in it (a leak of /dev/shm)."""
    s, _ = store
    maker = pages.Maker(s.root, lambda: 1 << 30)
    assert F.blank_dir(s.root)
    F.write_file(F.blank_asked(s.root, 5), str(256 << 20).encode())
    maker.tend([5])
    time.sleep(0.02)  # under way
    maker.stop()
    directory = os.path.join(s.root, F.BLANK_DIR)
    assert not [n for n in os.listdir(directory) if n.startswith(".making")]
    assert maker._threads == {}
    maker.stop(made=True)
    assert F.blanks(s.root) == []
