"""A DCP checkpoint loaded into another world size (``checkpoint_dcp.StorageReader``).

Each rank's copy holds only its own shards, and a rank reads only its own copy in its node's
memory; when the job comes back with another number of ranks (``nnodes`` MIN:MAX after a
node is lost, or a ``resume`` on fewer or more nodes), the shards a rank needs were saved by
other ranks. Those are read from the nearest copy of each old rank:

- **memory**: a copy this node keeps (an old rank that ran here, or its replica of another
  node's: a lost node's ranks are replicas on its buddy);
- **buddy**: one in another node's memory, borrowed for the load (agents/borrows.py: the
  controller names where each is when the job goes on with fewer ranks; the descriptions
  come as the attempt starts, the data of the copies a rank's shards overlap when asked);
- **persisted** in ``checkpoint.dir`` (``persist_every``), which every rank must read: a
  shared filesystem, or one machine; a memory copy that is not good falls back to it.

- **Which step.** The newest step every rank of the save that did it has a copy of (a
  step's world size is in its copies), among those every rank of the load can read, agreed
  across the ranks (one ``all_gather_object``). Where the controller's step (``load()``) is
  there that is the one; an older one where it is not.
- **Which copy serves a read.** Each old rank's description (its copy's ``.meta``: names,
  offsets, sizes, no tensor data) gives DCP its global Metadata and says who holds each
  chunk; a chunk several ranks hold (a replicated tensor, a per-rank value) comes from the
  rank of the same number where it held one, else from the lowest. A copy is read (and
  verified) only when a read needs it, once per ``dcp.load``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from agents.shims import orchestrator_checkpoint_format as F
from agents.shims.orchestrator_checkpoint import copy_at, note_restored, persisted_copy
from orchestrator.checkpoint import CheckpointError

Describe = Any  # checkpoint_dcp._describe: (tree, step) -> (items, fragment)
MEMORY, BUDDY, PERSISTED = "memory", "buddy", "persisted"  # where a copy is, as status says
BORROW_WAIT = 600.0  # seconds a read waits for a borrowed copy's data at most (agents/pulls.py)
ASKS = 3  # times a read asks for a borrowed copy whose data went before it was mapped


def world() -> tuple[int, int]:
    """(this rank, the number of ranks) of the job now."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return F.int_env("RANK", 0), F.int_env("WORLD_SIZE", 1)


class _Shape:
    """A tensor of a copy's description, not read: only its shape."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = torch.Size(shape)


class _Copy:
    """One old rank's copy of a step where this rank can read it: ``kind`` (MEMORY, BUDDY
    or PERSISTED), ``base`` its path less the suffix; ``own``: a save of this node's (its
    data in the slot its meta names), not a replica or a borrowed copy (``base.data``)."""

    def __init__(self, kind: str, base: str, own: bool = False) -> None:
        self.kind, self.base, self.own = kind, base, own

    def description(self) -> dict[str, Any] | None:
        """The copy's tree with its tensors as their shapes (its .meta only)."""
        data = F.read_bytes(self.base + ".meta")
        try:
            meta = json.loads(data.decode("utf-8")) if data is not None else None
            return F.unflatten(meta["tree"], [_Shape(t[1]) for t in meta["tensors"]]) \
                if isinstance(meta, dict) else None  # type: ignore[no-any-return]
        except (ValueError, KeyError, TypeError, IndexError, CheckpointError):
            return None

    def read(self, root: str, step: int, rank: int) -> tuple[Any, Any]:
        """(meta, state), verified; CheckpointError naming why not."""
        if self.kind == PERSISTED:
            found = persisted_copy(torch, root, step, rank)
            if found is None:
                raise CheckpointError("not good (named above)")
            return found  # type: ignore[no-any-return]
        if self.own:
            meta = F.read_json(self.base + ".meta")
            slot = meta.get("slot") if meta else None
            return copy_at(torch, self.base, os.path.join(os.path.dirname(self.base),
                                                          f"slot-{slot}"), sealed=False)
        for _ in range(ASKS if self.kind == BUDDY else 1):
            if self.kind == BUDDY:
                self._borrow()
            try:
                return copy_at(torch, self.base, self.base + ".data", sealed=True)
            except CheckpointError as exc:
                if self.kind != BUDDY or "missing" not in str(exc):
                    raise
        raise CheckpointError("its data went each time it came")

    def _borrow(self) -> None:
        """Ask this node's agent for the data (agents/borrows.py) and wait for it."""
        deadline = time.monotonic() + BORROW_WAIT
        if not os.path.exists(self.base + ".data"):
            F.write_file(self.base + ".want", b"")
        while not os.path.exists(self.base + ".data"):
            failed = F.read_bytes(self.base + ".failed", 4096)
            if failed is not None:
                raise CheckpointError(failed.decode("utf-8", "replace"))
            if time.monotonic() > deadline or not os.path.isdir(os.path.dirname(self.base)):
                raise CheckpointError("its data did not come")
            time.sleep(0.02)


Table = dict[int, dict[int, list[_Copy]]]  # step -> old rank -> its copies, nearest first


def _add(table: Table, step: int, rank: int, copy: _Copy) -> None:
    table.setdefault(step, {}).setdefault(rank, []).append(copy)


def _ranked(directory: str) -> list[tuple[int, str]]:
    """(rank, path) of the ``rank-<r>`` entries of ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [(r, os.path.join(directory, n)) for n in names
            if (r := F.parse_step(n, prefix="rank-")) is not None]


def _borrowed(memory: str) -> str:
    """Where this attempt's borrowed copies are (agents/borrows.py)."""
    return os.path.join(memory, F.BORROWED_DIR,
                        f"attempt-{F.int_env('ORCHESTRATOR_ATTEMPT', 0)}")


def _in_memory(table: Table, memory: str) -> None:
    """This node's copies: its saves, its replicas, then what it borrowed (waited for)."""
    borrowed = _borrowed(memory)
    F.await_pull(borrowed)  # the descriptions, coming as the attempt starts
    for directory, kind, suffix, own in (
            (memory, MEMORY, ".meta", True),
            (os.path.join(memory, "replicas"), MEMORY, ".manifest", False),
            (borrowed, BUDDY, ".manifest", False)):
        for rank, rank_dir in _ranked(directory):
            try:
                names = set(os.listdir(rank_dir))
            except OSError:
                continue
            for name in names:
                step = F.parse_step(name, suffix=suffix)
                if step is not None and F.step_name(step) + ".corrupt" not in names and \
                        F.step_name(step) + ".meta" in names:
                    _add(table, step, rank, _Copy(kind, os.path.join(rank_dir,
                                                                     F.step_name(step)), own))


def _persisted(table: Table, root: str) -> None:
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        step = F.parse_step(name, prefix="step-")
        if step is None:
            continue
        directory = F.persisted_dir(root, step)
        for entry in os.listdir(directory) if os.path.isdir(directory) else ():
            rank = F.parse_step(entry, prefix="rank-", suffix=".manifest")
            if rank is not None:
                _add(table, step, rank, _Copy(PERSISTED, os.path.join(directory,
                                                                      f"rank-{rank}")))


def _readable(table: Table, world_size: int) -> list[tuple[int, int]]:
    """``(step, ranks that saved it)`` of the steps of ``table`` that every rank of a world
    size other than ``world_size`` saved, newest first."""
    out = []
    for step in sorted(table, reverse=True):
        trees = (c.description() for c in table[step].get(0, ()))
        saved = next((n for t in trees if (n := saved_world(t)) is not None), None)
        if saved is not None and saved != world_size and \
                all(table[step].get(r) for r in range(saved)):
            out.append((step, saved))
    return out


def saved_world(tree: Any) -> int | None:
    """The number of ranks that saved a checkpoint_dcp tree (None: an older save, which
    did not say)."""
    head = tree.get("dcp") if isinstance(tree, dict) else None
    size = head.get("world_size") if isinstance(head, dict) else None
    return size if type(size) is int and size > 0 else None


class Resharded:
    """The copies of one step saved by ``saved`` ranks, served to this rank of another
    world size (see the module doc)."""

    def __init__(self, root: str, step: int, saved: int, copies: dict[int, list[_Copy]],
                 describe: Describe, started: float) -> None:
        self.root, self.step, self.saved, self._describe = root, step, saved, describe
        self._started: float | None = started  # until the load is told to the agent
        self.rank = world()[0]
        self.fragments: list[dict[str, Any]] = []
        self._where = copies
        self._holders: dict[Any, list[int]] = {}  # (fqn, offsets) -> old ranks holding it
        for old in range(saved):
            tree = next((t for c in copies.get(old, ()) if (t := c.description()) is not None),
                        None)
            if tree is None:
                raise CheckpointError(f"rank {old}'s copy of step {step} is missing or "
                                      "unreadable")
            items, fragment = describe(tree, step)
            self.fragments.append(fragment)
            for key in items:
                self._holders.setdefault(key, []).append(old)
        self._copies: dict[int, dict[Any, Any]] = {}
        self._kinds: set[str] = set()  # where the copies read came from

    def ordered_fragments(self) -> list[dict[str, Any]]:
        """The old ranks' descriptions, the one of this rank's number first (it wins where
        ranks differ, as a rank's own copy does)."""
        own = self.rank if self.rank < self.saved else 0
        return [self.fragments[own]] + [f for i, f in enumerate(self.fragments) if i != own]

    def find(self, key: Any) -> Any | None:
        """The stored item ``key`` (checkpoint_dcp._Stored), from the copy that serves it
        (read and verified at its first use); None when no rank saved it."""
        holders = self._holders.get(key)
        if not holders:
            return None
        old = self.rank if self.rank in holders else holders[0]
        if old not in self._copies:
            self._copies[old] = self._describe(self._read(old), self.step)[0]
        return self._copies[old].get(key)

    def _read(self, old: int) -> Any:
        """Old rank ``old``'s state, from its nearest copy that is good."""
        for copy in self._where.get(old, ()):
            try:
                state = copy.read(self.root, self.step, old)[1]
            except (CheckpointError, ValueError, KeyError, TypeError) as exc:
                _say(f"rank {old}'s {copy.kind} copy of step {self.step} ({copy.base}) is "
                     f"not good: {exc}; skipped")
                continue
            self._kinds.add(copy.kind)
            return state
        raise CheckpointError(f"no good copy of rank {old}'s step {self.step} (each named "
                              "above)")

    def done(self) -> None:
        """Let go of the copies read for one ``dcp.load``; the first tells the rank's agent
        which step it loaded (status shows it, where load() told the step it found), each
        that this rank needs what it borrowed no more (agents/borrows.py)."""
        self._copies.clear()
        memory = os.environ.get(F.MEMORY_VAR)
        if memory and BUDDY in self._kinds:
            try:
                F.write_file(os.path.join(_borrowed(memory), f"done-{self.rank}"), b"")
            except OSError:
                pass  # gone with its attempt
        if self._started is not None:
            source = next(k for k in (PERSISTED, BUDDY, MEMORY)
                          if k in self._kinds or k == MEMORY)
            note_restored(self.step, source, self._started)
            self._started = None


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"[orchestrator] checkpoint: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def reshard(found: tuple[int, Any] | None, describe: Describe) -> Resharded | None:
    """Where this rank's restored copy (``load()``'s, or None) is of another world size or
    there is none: the step to load from every old rank's nearest copy, agreed by every
    rank; None when there is nothing to resume. CheckpointError when ``found`` cannot be
    loaded into this world size."""
    started = time.perf_counter()
    _, size = world()
    root = os.environ.get(F.DIR_VAR) or ""
    memory = os.environ.get(F.MEMORY_VAR)
    table: Table = {}
    if memory and found is not None:  # the nodes hold the step the controller chose
        _in_memory(table, memory)
    if root:
        _persisted(table, root)
    mine = _readable(table, size)
    if found is not None:  # the controller's step, or an older one, everywhere
        mine = [(s, n) for s, n in mine if s <= found[0]]
    steps = [s for s, _ in mine]
    if dist.is_available() and dist.is_initialized() and size > 1:
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, steps)
        common = set(everyone[0]).intersection(*everyone[1:])
    else:
        common = set(steps)
    if not common:
        if found is None:
            return None
        raise CheckpointError(
            f"step {found[0]} was saved by {saved_world(found[1])} ranks; loading it into "
            f"{size} needs every rank's copy of it (or of an older step), in the nodes' "
            "memory or persisted in checkpoint.dir where every rank reads it (a shared "
            "filesystem): none is")
    step = max(common)
    return Resharded(root, step, dict(mine)[step], table[step], describe, started)
