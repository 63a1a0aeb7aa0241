"""How much of ``checkpoint.memory`` a node's checkpoint store gives each of its parts: its
ranks' own copies and the replicas it keeps of other nodes' ranks (agents/checkpoints.py).

Pure arithmetic, and a look at the replicas' files; calls nothing of the agent's.
"""

from __future__ import annotations

import os

from agents import commands as C
from agents.paths import entries, steps_in
from agents.shims import orchestrator_checkpoint_format as F


def default_memory() -> int:
    """Half of the node's shared memory, when the spec sets no bound."""
    try:
        st = os.statvfs("/dev/shm")
        return st.f_blocks * st.f_frsize // 2
    except OSError:
        return 1 << 30


def budget(config: C.CheckpointConfig) -> int:
    """checkpoint.memory, in bytes."""
    return config.memory or default_memory()


def share(budget: int, mine: int, theirs: int) -> int:
    """How many copies each rank of a node keeps, of ``mine`` bytes a step for all its ranks
    and ``theirs`` for the replicas it keeps: three at least (the newest, one being written,
    one being sent: with two, a save waits for the push), beside two of each replica (the
    newest, one arriving); what memory holds beyond that goes to both alike. Two where
    memory is short of that: the replicas keep their two."""
    spare = budget - 3 * mine - 2 * theirs
    if spare >= 0:
        return 3 + spare // (mine + theirs)
    return max(2, min(3, (budget - 2 * theirs) // mine))


def replica_bytes(root: str, own: dict[int, str]) -> int:
    """The newest replica's bytes of each rank kept in ``root`` (a replica server's), together;
    not of ``own`` ranks (a spare that took a node's place keeps its old copies of them)."""
    total = 0
    for name in entries(root):
        rank = F.parse_step(name, prefix="rank-")
        directory = os.path.join(root, name)
        steps = steps_in(directory, ".manifest") if rank is not None and rank not in own \
            else []
        if steps:
            try:
                total += os.path.getsize(os.path.join(directory, f"step-{max(steps)}.data"))
            except OSError:
                pass
    return total


def copies_for(root: str, saves: dict[int, list[int | float]], own: dict[int, str],
               node_budget: int) -> int | None:
    """How many copies each of the node's ranks may keep (``F.COPIES_NAME`` in the memory
    root ``root``, which their saves obey; None: none of ``own`` saved yet): the memory split
    between the node's own copies (``saves``: rank -> its newest save's [step, bytes, ...])
    and the replicas it keeps of other nodes' ranks, so that both keep as many steps. Without
    it the saves kept every step from the retained one on while memory allowed, took all of
    it, and no replica had room from then on: the retained step stayed where that happened
    (measured: step 8 of a job at step 200, 1 GiB and 2 ranks of 32 MiB a node), and a
    node's loss would have cost every step since."""
    mine = sum(int(v[1]) for rank, v in saves.items() if rank in own)
    if not mine:
        return None
    # A buddy's copies are as large as this node's own until they come (a spare's are
    # every rank's, and it saves none).
    theirs = replica_bytes(os.path.join(root, "replicas"), own)
    return share(node_budget, mine, theirs or mine)
