"""What checkpoints the job's nodes hold, and the step every rank resumes.

Each node's agent reports (``held``, agents/checkpoints.py) the steps of each rank it keeps
in memory and in its ``checkpoint.dir``; a report replaces that node's last one, and a node
whose channel closes is forgotten until it reports again (its agent re-sends on attach). At
the start of an attempt, ``agreed_step`` is the newest step of which every rank of the new
attempt has a copy where it will run: in its node's memory, or persisted in a directory its
node reads (the same store id from several nodes: a shared filesystem). Every rank is then
told that step (``ORCHESTRATOR_CHECKPOINT_STEP``), so all of them resume the same one.

Pure bookkeeping: the engine owns one and feeds it; nothing here sends or writes.
May call ``plan`` and ``spec`` (types only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator.plan import LaunchPlan
from orchestrator.spec import JobSpec

log = logging.getLogger("orchestrator.controller")


class Holdings:
    def __init__(self) -> None:
        self._nodes: dict[int, P.Held] = {}

    def update(self, node_index: int, held: P.Held) -> None:
        self._nodes[node_index] = held

    def forget(self, node_index: int) -> None:
        self._nodes.pop(node_index, None)

    def summary(self, node_index: int) -> dict[str, Any] | None:
        """What ``status`` shows of a node's store: bytes of memory, newest steps."""
        held = self._nodes.get(node_index)
        if held is None:
            return None
        newest = [max(s) for s in held.memory.values() if s]
        stored = [max(s) for s in held.persisted.values() if s]
        return {"memory_bytes": held.bytes, "ranks": len(held.memory),
                "newest_in_memory": min(newest) if newest else None,
                "newest_persisted": min(stored) if stored else None}

    def agreed_step(self, placement: Mapping[int, int]) -> int | None:
        """The newest step every rank of ``placement`` (rank -> the node index it will run
        on) can load where it runs; None: some rank has none (all start fresh)."""
        if not placement or not self._nodes:
            return None
        shared: dict[str, dict[int, set[int]]] = {}  # store id -> rank -> steps
        for report in self._nodes.values():
            if report.store is not None:
                into = shared.setdefault(report.store, {})
                for rank, stored in report.persisted.items():
                    into.setdefault(rank, set()).update(stored)
        common: set[int] | None = None
        for rank, node_index in placement.items():
            held = self._nodes.get(node_index)
            steps: set[int] = set()
            if held is not None:
                steps.update(held.memory.get(rank, ()))
                steps.update(held.persisted.get(rank, ()))
                if held.store is not None:
                    steps.update(shared.get(held.store, {}).get(rank, ()))
            common = steps if common is None else common & steps
            if not common:
                return None
        return max(common) if common else None


def attempt_config(spec: JobSpec, holdings: Holdings, plan: LaunchPlan,
                   nprocs: Mapping[int, int]) -> C.CheckpointConfig:
    """What the nodes of ``plan`` are told: the spec's settings, and the step every rank
    can load where it will run (None: start fresh)."""
    per_node = spec.nproc_per_node if isinstance(spec.nproc_per_node, int) else 1
    step = holdings.agreed_step(placement(plan, nprocs, per_node))
    if step is not None:
        log.info("attempt %d resumes checkpoint step %d", plan.attempt, step)
    section = spec.checkpoint
    return C.CheckpointConfig(section.dir, section.persist_every, section.keep,
                              section.memory, step)


def placement(plan: LaunchPlan, nprocs: Mapping[int, int], default: int) -> dict[int, int]:
    """Rank -> the node index it runs on (ranks counted in node order where the plan does
    not name them: torchrun's and per-node launches, of ``nprocs`` or ``default`` each)."""
    out, first = {}, 0
    for node in plan.nodes:
        named = [w.rank for w in node.workers if w.rank is not None]
        count = len(named) or int(node.env.get("LOCAL_WORLD_SIZE") or 0) or \
            nprocs.get(node.node_index) or default
        for rank in named or range(first, first + count):
            out[rank] = node.node_index
        first += count
    return out
