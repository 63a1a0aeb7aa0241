"""A DCP checkpoint loaded into another world size (``checkpoint_dcp.StorageReader``).

Each rank's copy holds only its own shards, and a rank reads only its own copy in its node's
memory; when the job comes back with another number of ranks (``nnodes`` MIN:MAX after a
node is lost, or a ``resume`` on fewer or more nodes), the shards a rank needs were saved by
other ranks. Those are read from the copies persisted in ``checkpoint.dir``
(``persist_every``), which every rank must read: a shared filesystem, or one machine.

- **Which step.** The newest step persisted by every rank of the save that did it (a step's
  world size is in its copies), among those every rank of the load can read, agreed across
  the ranks (one ``all_gather_object``). Where the controller's step (``load()``) is
  persisted that is the one; an older one where it is not.
- **Which copy serves a read.** Each old rank's description (its copy's ``.meta``: names,
  offsets, sizes, no tensor data) gives DCP its global Metadata and says who holds each
  chunk; a chunk several ranks hold (a replicated tensor, a per-rank value) comes from the
  rank of the same number where it held one, else from the lowest. A copy is read (and
  verified) only when a read needs it, once per ``dcp.load``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from agents.shims import orchestrator_checkpoint_format as F
from agents.shims.orchestrator_checkpoint import note_restored, persisted_copy
from orchestrator.checkpoint import CheckpointError

Describe = Any  # checkpoint_dcp._describe: (tree, step) -> (items, fragment)


def world() -> tuple[int, int]:
    """(this rank, the number of ranks) of the job now."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return F.int_env("RANK", 0), F.int_env("WORLD_SIZE", 1)


class _Shape:
    """A tensor of a copy's description, not read: only its shape."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = torch.Size(shape)


def _description(root: str, step: int, rank: int) -> dict[str, Any] | None:
    """A persisted copy's tree with its tensors as their shapes (its .meta only)."""
    data = F.read_bytes(os.path.join(F.persisted_dir(root, step), f"rank-{rank}.meta"))
    try:
        meta = json.loads(data.decode("utf-8")) if data is not None else None
        return F.unflatten(meta["tree"], [_Shape(t[1]) for t in meta["tensors"]]) \
            if isinstance(meta, dict) else None  # type: ignore[no-any-return]
    except (ValueError, KeyError, TypeError, IndexError, CheckpointError):
        return None


def saved_world(tree: Any) -> int | None:
    """The number of ranks that saved a checkpoint_dcp tree (None: an older save, which
    did not say)."""
    head = tree.get("dcp") if isinstance(tree, dict) else None
    size = head.get("world_size") if isinstance(head, dict) else None
    return size if type(size) is int and size > 0 else None


def _readable(root: str, world_size: int) -> list[tuple[int, int]]:
    """``(step, ranks that saved it)`` of the steps persisted in ``root`` by every rank of
    another world size than ``world_size``, newest first."""
    out = []
    for step in F.persisted_steps(root, 0):
        tree = _description(root, step, 0)
        saved = saved_world(tree)
        if saved is None or saved == world_size:
            continue
        directory = F.persisted_dir(root, step)
        if all(os.path.exists(os.path.join(directory, f"rank-{r}.manifest"))
               for r in range(1, saved)):
            out.append((step, saved))
    return out


class Resharded:
    """The copies of one step saved by ``saved`` ranks, served to this rank of another
    world size (see the module doc)."""

    def __init__(self, root: str, step: int, saved: int, describe: Describe,
                 started: float) -> None:
        self.root, self.step, self.saved, self._describe = root, step, saved, describe
        self._started: float | None = started  # until the load is told to the agent
        self.rank = world()[0]
        self.fragments: list[dict[str, Any]] = []
        self._holders: dict[Any, list[int]] = {}  # (fqn, offsets) -> old ranks holding it
        for old in range(saved):
            tree = _description(root, step, old)
            if tree is None:
                raise CheckpointError(f"rank {old}'s persisted copy of step {step} in {root} "
                                      "is missing or unreadable")
            items, fragment = describe(tree, step)
            self.fragments.append(fragment)
            for key in items:
                self._holders.setdefault(key, []).append(old)
        self._copies: dict[int, dict[Any, Any]] = {}

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
            found = persisted_copy(torch, self.root, self.step, old)
            if found is None:
                raise CheckpointError(f"rank {old}'s persisted copy of step {self.step} in "
                                      f"{self.root} is not good (named above)")
            self._copies[old] = self._describe(found[1], self.step)[0]
        return self._copies[old].get(key)

    def done(self) -> None:
        """Let go of the copies read for one ``dcp.load``; the first tells the rank's agent
        which step it loaded (status shows it, where load() told the step it found)."""
        self._copies.clear()
        if self._started is not None:
            note_restored(self.step, "persisted", self._started)
            self._started = None


def reshard(found: tuple[int, Any] | None, describe: Describe) -> Resharded | None:
    """Where this rank's restored copy (``load()``'s, or None) is of another world size or
    there is none: the step to load from every old rank's persisted copy, agreed by every
    rank; None when there is nothing to resume. CheckpointError when ``found`` cannot be
    loaded into this world size."""
    started = time.perf_counter()
    _, size = world()
    root = os.environ.get(F.DIR_VAR) or ""
    mine = _readable(root, size) if root else []
    if found is not None:  # the controller's step, or an older one, persisted everywhere
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
            f"{size} needs every rank's copy of it (or of an older step) persisted in "
            "checkpoint.dir where every rank reads it (a shared filesystem): none is")
    step = max(common)
    return Resharded(root, step, dict(mine)[step], describe, started)
