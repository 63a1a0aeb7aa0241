"""Which nodes hold what of each rank, kept up to date as their reports come (the
``Holdings`` of orchestrator/checkpoints.py asks it instead of looking at every node).

Every node of a job saving each step reports at each save, and each report made the
controller look at every node, for each rank of the job: a round of saves cost it
O(nodes^3), 20.7 s of CPU at 256 nodes of 8 ranks (benchmarks/bench_holdings.py). With this
index a report costs what the reporting node holds.

Pure bookkeeping, of the reports it is given; imports nothing of the orchestrator's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from agents import protocol as P


class Holders:
    def __init__(self) -> None:
        self.memory: dict[int, set[int]] = {}  # rank -> nodes with its saves in memory
        self.replicas: dict[int, set[int]] = {}  # rank -> nodes keeping replicas of it
        self.stores: dict[str, set[int]] = {}  # a checkpoint.dir's id -> nodes that read it
        # The retained step, counted: per rank, per step, the nodes that keep and serve a
        # replica of it (``serving``), and per step how many of ``_ranks`` have one at least.
        self._kept: dict[int, Counter[int]] = {}
        self._counted: dict[int, tuple[tuple[int, int], ...]] = {}  # node -> what it adds
        self._ranks: frozenset[int] = frozenset()
        self._have: Counter[int] = Counter()

    def add(self, index: int, held: P.Held, serving: bool) -> None:
        """``index`` reported ``held`` (its report before it was ``remove``d); ``serving``:
        its replicas count for the retained step."""
        for rank in held.memory:
            self.memory.setdefault(rank, set()).add(index)
        for rank in held.replicas:
            self.replicas.setdefault(rank, set()).add(index)
        if held.store is not None:
            self.stores.setdefault(held.store, set()).add(index)
        self._count(index, held if serving else None)

    def remove(self, index: int, held: P.Held) -> None:
        """``index``'s report ``held`` is no longer its word."""
        for ranks, keys in ((self.memory, held.memory), (self.replicas, held.replicas)):
            for rank in keys:
                _discard(ranks, rank, index)
        if held.store is not None:
            _discard(self.stores, held.store, index)
        self._count(index, None)

    def recount(self, reports: dict[int, P.Held], serving: Iterable[int]) -> None:
        """Which nodes serve changed (drained or noticed ones): count again."""
        counted = set(serving)
        for index, held in reports.items():
            self._count(index, held if index in counted else None)

    def newest_everywhere(self, ranks: Iterable[int]) -> int | None:
        """The newest step of which every rank of ``ranks`` has a replica on a serving node
        (None: some rank has none)."""
        wanted = frozenset(ranks)
        if wanted != self._ranks:
            self._ranks = wanted
            self._have = Counter(step for rank in wanted for step in self._kept.get(rank, ()))
        full = len(wanted)
        return max((step for step, count in self._have.items() if count == full),
                   default=None) if full else None

    def _count(self, index: int, held: P.Held | None) -> None:
        """``index`` now adds ``held``'s replicas to the counts (None: nothing)."""
        for rank, step in self._counted.pop(index, ()):
            kept = self._kept[rank]
            kept[step] -= 1
            if not kept[step]:
                del kept[step]
                if rank in self._ranks:
                    self._have[step] -= 1
                    if not self._have[step]:
                        del self._have[step]
                if not kept:
                    del self._kept[rank]
        if held is None:
            return
        adds = tuple((rank, step) for rank, steps in held.replicas.items() for step in set(steps))
        for rank, step in adds:
            kept = self._kept.setdefault(rank, Counter())
            kept[step] += 1
            if kept[step] == 1 and rank in self._ranks:
                self._have[step] += 1
        if adds:
            self._counted[index] = adds


def _discard(sets: dict, key: object, index: int) -> None:
    found = sets.get(key)
    if found is not None:
        found.discard(index)
        if not found:
            del sets[key]
