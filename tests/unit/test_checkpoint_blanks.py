"""Blanks: the pages of copies a node's store let go, kept for the next copies it writes
whole (a new pages' cost measured in docs/benchmarks.md). A rank's new slot takes one, cut to
its size; they count as memory held, are free to a buddy's replica, and go once memory is
over checkpoint.memory. The replicas' side is in test_replicas.py."""

from __future__ import annotations

import dataclasses
import os

import torch

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
