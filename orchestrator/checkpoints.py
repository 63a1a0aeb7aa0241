"""What checkpoints the job's nodes hold, and the step every rank resumes.

Each node's agent reports (``held``, agents/checkpoints.py) the steps of each rank it keeps
in memory, in its ``checkpoint.dir`` and as replicas of its buddy's ranks; a report replaces
that node's last one, and a node whose channel closes is forgotten until it reports again
(its agent re-sends on attach). At the start of an attempt, ``agreed_step`` is the newest
step of which every rank of the new attempt has a copy where it will run (in its node's
memory, or persisted in a directory its node reads: the same store id from several nodes
is a shared filesystem) or a replica on a live node, or a copy in a drained node's memory
(it stays up), which the new node's agent then pulls (``pulls``) as its workers start.
Every rank is told that step (``ORCHESTRATOR_CHECKPOINT_STEP``), so all of them resume the
same one. ``buddies`` says where each node replicates: the next node of the attempt, in
node-rank order.

Pure bookkeeping: the engine owns one and feeds it; nothing here sends or writes.
May call ``plan`` and ``spec`` (types only).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agents import checkpointcommands as CS
from agents import commands as C
from agents import protocol as P
from orchestrator.holders import Holders
from orchestrator.plan import LaunchPlan, node_address
from orchestrator.spec import JobSpec, NodeSpec

log = logging.getLogger("orchestrator.controller")
NOWHERE = C.ReplicateTo("", 0)  # a node that sends its copies nowhere


class Holdings:
    def __init__(self) -> None:
        self._nodes: dict[int, P.Held] = {}
        self._holders = Holders()  # who holds what of each rank: no scan of every node
        self._buddies: dict[int, C.ReplicateTo] = {}  # node -> where it was told to send
        self._moved: set[int] = set()  # nodes whose port changed (or forgotten) since buddies()
        self._told_for: tuple[Any, ...] = ()  # buddies()'s last question and its ring's order
        self._placed: tuple[Any, ...] = ()  # placed()'s last question and answer
        self._addressed: tuple[Any, ...] = ()  # addresses()'s
        self._retained: int | None = None  # the step the nodes were last told to retain
        self.below: int | None = None  # the next attempt resumes a step older than this
        self.fell_back = False  # that happened once in this job (policy.decide)
        self._leaving: frozenset[int] = frozenset()  # drained or noticed: never a spare
        self._up: frozenset[int] = frozenset()  # of them, drained only: their memory serves
        self._loads_of = 0  # the newest attempt whose ranks said which step they loaded
        self._loads: dict[int, int] = {}  # its rank -> that step
        self._oldest_load: int | None = None  # the oldest of them (known once asked)

    def update(self, node_index: int, held: P.Held) -> None:
        old = self._nodes.get(node_index)
        if old is not None:
            self._holders.remove(node_index, old)
        if old is None or old.port != held.port:
            self._moved.add(node_index)
        self._nodes[node_index] = held
        self._holders.add(node_index, held, self._serves(node_index, held))
        for rank, (attempt, step, *_) in held.restored.items():  # each rank's last load
            if attempt > self._loads_of:
                self._loads_of, self._loads, self._oldest_load = attempt, {}, None
            if attempt == self._loads_of and self._loads.get(rank) != step:
                self._loads[rank], self._oldest_load = step, None

    def forget(self, node_index: int) -> None:
        old = self._nodes.pop(node_index, None)
        if old is not None:
            self._holders.remove(node_index, old)
        self._buddies.pop(node_index, None)  # a new agent there is told again
        self._moved.add(node_index)

    def summary(self, node_index: int) -> dict[str, Any] | None:
        """What ``status`` shows of a node's store: bytes of memory, newest steps, the
        newest save and this attempt's loads."""
        held = self._nodes.get(node_index)
        if held is None:
            return None
        newest = [max(s) for s in held.memory.values() if s]
        stored = [max(s) for s in held.persisted.values() if s]
        kept = [max(s) for s in held.replicas.values() if s]
        # The newest step every rank of the node saved (a rank's save of the next one may be
        # reported before its neighbour's: then that one's bytes alone looked like the save).
        saves = list(held.saves.values())
        last = min((s[0] for s in saves), default=None)
        return {"memory_bytes": held.bytes, "ranks": len(held.memory),
                "newest_in_memory": min(newest) if newest else None,
                "newest_persisted": min(stored) if stored else None,
                # Of other nodes' ranks (its buddy's, or every participant's on a spare).
                "replicas": {"ranks": len(kept), "newest": min(kept) if kept else None},
                # Where a loss of this node takes its ranks back to, at best.
                "newest_elsewhere": self._newest_elsewhere(node_index),
                # The newest save: the ranks' latest saves' bytes together, and the longest
                # any held the training.
                "last_save": {"step": last, "bytes": sum(s[1] for s in saves),
                              "block_s": max(s[2] for s in saves)} if saves else None,
                # This attempt's loads: per rank the step, which copy, seconds, bad copies.
                "restored": {str(rank): {"step": r[1], "source": r[2], "seconds": r[3],
                                         "skipped": r[4]}
                             for rank, r in sorted(held.restored.items())
                             if r[0] == held.attempt}}

    def _newest_elsewhere(self, node_index: int) -> int | None:
        """The newest step of which every rank in ``node_index``'s memory has a copy that
        outlives the node: a replica another node keeps and serves (``_replicated``: never a
        noticed node's), or persisted where another node reads it too (a shared
        filesystem); None: some rank has none."""
        held = self._nodes.get(node_index)
        if held is None or not held.memory:
            return None
        shared = held.store is not None and len(self._holders.stores.get(held.store, ())) > 1
        common: set[int] | None = None
        for rank in held.memory:
            steps = {s for s, index in self._replicated(rank).items() if index != node_index}
            if shared:
                steps.update(held.persisted.get(rank, ()))
            common = steps if common is None else common & steps
            if not common:
                return None
        return max(common) if common else None

    def keeping(self, node_index: int) -> list[int]:
        """The other nodes whose ranks ``node_index`` keeps replicas of: what their loss
        costs changes with its report."""
        held = self._nodes.get(node_index)
        if held is None:
            return []
        return sorted({index for rank in held.replicas
                       for index in self._holders.memory.get(rank, ())} - {node_index})

    def loaded_step(self, attempt: int, ranks: int) -> int | None:
        """The oldest step the ranks of ``attempt`` loaded, once ``ranks`` of them said which
        (None before, and where some started fresh: they say nothing)."""
        if attempt != self._loads_of or len(self._loads) < ranks:
            return None
        if self._oldest_load is None:
            self._oldest_load = min(self._loads.values())
        return self._oldest_load

    def _local(self, rank: int, node_index: int) -> set[int]:
        """Steps of ``rank`` that ``node_index`` can read without another node: its memory,
        and what ``_stored`` says."""
        held = self._nodes.get(node_index)
        if held is None:
            return set()
        return set(held.memory.get(rank, ())) | self._stored(rank, node_index)

    def _stored(self, rank: int, node_index: int) -> set[int]:
        """Steps of ``rank`` persisted where ``node_index`` reads them: its checkpoint.dir,
        and any other node's report of that same directory (a shared filesystem)."""
        held = self._nodes.get(node_index)
        if held is None:
            return set()
        steps = set(held.persisted.get(rank, ()))
        if held.store is not None:
            for index in self._holders.stores.get(held.store, ()):
                steps.update(self._nodes[index].persisted.get(rank, ()))
        return steps

    def _replicated(self, rank: int) -> dict[int, int]:
        """Step -> a node index that keeps a replica of ``rank`` at that step (and serves),
        never a noticed one (it goes away, and its replicas with it)."""
        gone = self._leaving - self._up
        return {step: index for index in sorted(self._holders.replicas.get(rank, ()))
                if (held := self._nodes[index]).port is not None and index not in gone
                for step in held.replicas.get(rank, ())}

    def _sources(self, rank: int) -> dict[int, int]:
        """Step -> a node index that serves a copy of ``rank`` at that step: a replica, else a
        leaving node's own memory (drained: it stays up while its replacement pulls)."""
        out = {step: index for index in sorted(self._up)
               if (held := self._nodes.get(index)) is not None and held.port is not None
               for step in held.memory.get(rank, ())}
        out.update(self._replicated(rank))
        return out

    def serving(self, nodes: Iterable[int]) -> bool:
        """Whether each of ``nodes`` has a replica server (it can hand its ranks' copies
        to the nodes that take their place)."""
        return all((held := self._nodes.get(i)) is not None and held.port is not None
                   for i in nodes)

    def agreed_step(self, placement: Mapping[int, int]) -> int | None:
        """The newest step every rank of ``placement`` (rank -> the node index it will run
        on) can load there, or have pulled there from a replica; None: some rank has none
        (all start fresh)."""
        common: set[int] | None = None
        for rank, node_index in placement.items():
            steps = self._local(rank, node_index) | set(self._sources(rank))
            if self.below is not None:  # falling back: the same error came after that step
                steps = {s for s in steps if s < self.below}
            common = steps if common is None else common & steps
            if not common:
                return None
        return max(common) if common else None

    def pulls(self, placement: Mapping[int, int], step: int,
              addresses: Mapping[int, str]) -> dict[int, tuple[C.Pull, ...]]:
        """Node index -> the copies its agent fetches as its workers start: ranks that hold
        ``step`` nowhere they run (a node took a lost or drained one's place)."""
        out: dict[int, list[C.Pull]] = {}
        for rank, node_index in sorted(placement.items()):
            source = self._sources(rank).get(step)
            if step in self._local(rank, node_index) or source is None:
                continue
            if self.holds_replica(node_index, rank, step):
                source = node_index  # a spare that held them: copied from itself
            port = self._nodes[source].port
            assert port is not None
            out.setdefault(node_index, []).append(
                C.Pull(rank, step, addresses[source], port))
        return {node: tuple(p) for node, p in out.items()}

    def where_from(self, pulls: Mapping[int, tuple[C.Pull, ...]], step: int) -> str:
        """Where ``pulls`` of ``step`` come from, for the log: replicas (some held by the node
        that runs them), or a drained node's memory."""
        replicas = held = 0
        for node, its in pulls.items():
            for pull in its:
                held += self.holds_replica(node, pull.rank, step)
                replicas += step in self._replicated(pull.rank)
        parts = [f"{replicas} ranks from replicas, {held} of them held by the node that runs "
                 "them"] if replicas else []
        if sum(map(len, pulls.values())) > replicas:
            parts.append(f"{sum(map(len, pulls.values())) - replicas} ranks from the memory "
                         "of the node(s) leaving")
        return f" ({'; '.join(parts)})" if parts else ""

    def elsewhere(self, placement: Mapping[int, int], step: int,
                  addresses: Mapping[int, str]) -> tuple[C.Copies, ...]:
        """Where the copies of every rank the nodes hold are, at ``step`` and the steps
        before it that every rank has somewhere: a DCP load into fewer ranks reads them
        (agents/borrows.py; a node skips what it holds itself). Only where ranks that saved
        are not placed now (the job goes on with fewer); the same for every node, so that
        it costs the ranks' number, not that times the nodes'."""
        ranks = {r for held in self._nodes.values() for r in (*held.memory, *held.replicas)}
        if ranks <= set(placement):
            return ()
        served = {rank: self._served(rank) for rank in ranks}
        # Only a step that every rank has a copy of somewhere can be loaded: the newest few.
        common = set.intersection(*(set(s) for s in served.values()))
        loadable = set(sorted(s for s in common if s <= step)[-CS.MAX_STEPS:])
        entries: list[C.Copies] = []
        for rank in sorted(ranks):
            by_source: dict[int, list[int]] = {}
            for held_step, index in sorted(served[rank].items()):
                if held_step in loadable and index in addresses:
                    by_source.setdefault(index, []).append(held_step)
            entries.extend(C.Copies(rank, tuple(steps), addresses[index],
                                    self._nodes[index].port or 0)
                           for index, steps in sorted(by_source.items()))
        if len(entries) > CS.MAX_COPIES:
            log.warning("%d copies are more than a start names (%d): a load into fewer ranks "
                        "reads persisted copies only", len(entries), CS.MAX_COPIES)
            return ()
        return tuple(entries)

    def _served(self, rank: int) -> dict[int, int]:
        """Step -> a node index whose replica server hands out ``rank``'s copy of it: a save
        of its own in its memory, else a replica; never a noticed node's (the loads borrow
        once it has gone: nothing there)."""
        gone = self._leaving - self._up
        out = {step: index for index in sorted(self._holders.memory.get(rank, ()))
               if (held := self._nodes[index]).port is not None and index not in gone
               for step in held.memory.get(rank, ())}
        for step, index in self._replicated(rank).items():
            out.setdefault(step, index)
        return out

    def newest_saved(self, placement: Mapping[int, int]) -> int | None:
        """The newest step any rank of ``placement`` holds in its node's memory (None: no
        rank keeps saves there)."""
        if not self._nodes:
            return None
        steps = [max(held.memory[rank]) for rank, node in placement.items()
                 if (held := self._nodes.get(node)) is not None and held.memory.get(rank)]
        return max(steps, default=None)

    def saved(self, step: int, placement: Mapping[int, int], leaving: Iterable[int]) -> bool:
        """Whether every rank of ``placement`` holds ``step`` in its node's memory, and the
        ranks of the ``leaving`` nodes also as a replica on a node that stays."""
        gone = set(leaving)
        for rank, node in placement.items():
            held = self._nodes.get(node)
            if held is None or step not in held.memory.get(rank, ()):
                return False
            if node in gone and not any(index not in gone and self.holds_replica(index, rank, step)
                                        for index in self._holders.replicas.get(rank, ())):
                return False
        return True

    def persisted(self, step: int, placement: Mapping[int, int]) -> bool:
        """Whether every rank of ``placement`` has ``step`` in its node's checkpoint.dir
        (or in another node's, where they share it)."""
        return all(step in self._stored(rank, node) for rank, node in placement.items())

    def holds_replica(self, node_index: int, rank: int, step: int) -> bool:
        held = self._nodes.get(node_index)
        return held is not None and held.port is not None and step in held.replicas.get(rank, ())

    def fall_back(self, below: int | None) -> None:
        """The next attempt resumes a step older than ``below`` (None: no fall back)."""
        if below is not None:
            self.below, self.fell_back = below, True

    def new_attempt(self) -> None:
        """Agents drop what they retained when an attempt starts: tell them again (and a
        fall back is done)."""
        self._retained, self.below = None, None

    def new_timeline(self) -> None:
        """The ranks resumed an older step than they were told: the step every node was
        told to retain may be of the old timeline, and is told again once found."""
        self._retained = None

    def retained(self, ranks: Iterable[int]) -> C.Retain | None:
        """News for every node, when it changed: the newest step of which every rank of
        ``ranks`` has a replica on some node, what they would all resume if a node were lost.
        Nodes keep their copies from that step on (memory and replicas), so that the step
        is still everywhere when it is needed."""
        step = self._holders.newest_everywhere(ranks)  # counted as the reports come
        if step is None or step == self._retained:
            return None
        self._retained = step
        return C.Retain(step)

    def set_leaving(self, nodes: Iterable[int], staying_up: Iterable[int] = ()) -> None:
        """Nodes drained or noticed (orchestrator/drain.py): they take no failed node's place,
        so no copies go to them as a spare's. Of them, ``staying_up`` (drained, with no
        notice: they do not go away) hand their ranks' copies to the nodes that replace them;
        a noticed node's copies count only as replicas elsewhere."""
        self._leaving, self._up = frozenset(nodes), frozenset(staying_up)
        self._holders.recount(self._nodes, [index for index, held in self._nodes.items()
                                            if self._serves(index, held)])

    def _serves(self, node_index: int, held: P.Held) -> bool:
        """Whether ``node_index``'s replicas count (``_replicated``): it serves them, and is
        not noticed (it goes away, and its replicas with it)."""
        return held.port is not None and node_index not in self._leaving - self._up

    def buddies(self, ring: list[int], addresses: Mapping[int, str],
                spares: Sequence[int] = ()) -> dict[int, C.ReplicateTo]:
        """What to tell which node (only news): each node of ``ring`` (the attempt's nodes in
        node-rank order) sends its copies to the next one's replica server, the last to the
        first (a node alone: nowhere), and also to the first hot spare of ``spares`` that is
        not leaving: the one that takes a failed node's place
        (participants.choose_participants), so it holds that node's copies before it is
        needed. A node told before that is out of ``ring`` now sends nowhere (measured: a
        drained node's agent went on sending its last saves for 6 s of the next attempt's
        start)."""
        # Asked at every node's every report: the same nodes have news only where a port
        # changed, and telling every node each time cost O(nodes^2) a round (1,024 nodes'
        # first reports: 2.9 s; benchmarks/bench_holdings.py).
        question = (tuple(ring), tuple(spares), self._leaving)
        moved, self._moved = self._moved, set()
        spares = [i for i in spares if i not in self._leaving]
        also = self._server(spares[0], addresses) if spares else None
        news = {}
        if question == self._told_for[:3] and addresses is self._told_for[3]:
            if not moved:
                return {}
            if spares and spares[0] in moved:
                moved = set(ring)  # where every node sends the spare's copies
            order = self._told_for[4]
            which = sorted({ring[(order[node] - back) % len(ring)] for node in moved
                            if node in order for back in (0, 1)}, key=order.__getitem__)
        else:
            order = {node_index: i for i, node_index in enumerate(ring)}
            self._told_for = (*question, addresses, order)
            which = list(ring)
            for node_index, told in list(self._buddies.items()):
                if node_index not in order and told != NOWHERE:
                    self._buddies[node_index] = news[node_index] = NOWHERE
        for node_index in which:
            after = ring[(order[node_index] + 1) % len(ring)]
            buddy = self._server(after, addresses)
            told = C.ReplicateTo(*(buddy if buddy and after != node_index else ("", 0)),
                                 (also,) if also else ())
            if self._buddies.get(node_index, NOWHERE) != told:
                self._buddies[node_index] = told
                news[node_index] = told
        return news

    def placed(self, plan: LaunchPlan, nprocs: Mapping[int, int],
               default: int) -> dict[int, int]:
        """``placement``'s, kept while the plan and the nodes' nprocs stay the same: asked at
        every node's every report, and it looks at every node."""
        if not self._placed or self._placed[0] is not plan or \
                self._placed[1:3] != (nprocs, default):
            self._placed = (plan, dict(nprocs), default, placement(plan, nprocs, default))
        return self._placed[3]

    def addresses(self, nodes: Sequence[NodeSpec]) -> dict[int, str]:
        """Node index -> the address other nodes reach it at (``node_address``), kept for
        the same ``nodes``."""
        if not self._addressed or self._addressed[0] is not nodes:
            self._addressed = (nodes, {i: node_address(node) for i, node in enumerate(nodes)})
        return self._addressed[1]

    def _server(self, node_index: int, addresses: Mapping[int, str]) -> tuple[str, int] | None:
        """Where ``node_index`` takes replicas (None: it serves none, or is not heard yet)."""
        held = self._nodes.get(node_index)
        if held is None or held.port is None or node_index not in addresses:
            return None
        return addresses[node_index], held.port


def attempt_config(spec: JobSpec, holdings: Holdings, plan: LaunchPlan,
                   nprocs: Mapping[int, int]
                   ) -> tuple[C.CheckpointConfig, dict[int, C.CheckpointConfig]]:
    """What the nodes of ``plan`` are told: the spec's settings, the step every rank can
    load where it will run (None: start fresh), and, for the nodes that have them, the
    replicas to fetch first and where the copies of ranks they do not hold are."""
    per_node = spec.nproc_per_node if isinstance(spec.nproc_per_node, int) else 1
    where = placement(plan, nprocs, per_node)
    step = holdings.agreed_step(where)
    pulls: dict[int, tuple[C.Pull, ...]] = {}
    copies: tuple[C.Copies, ...] = ()
    if step is not None:
        addresses = {i: node_address(spec.nodes[i]) for i in range(len(spec.nodes))}
        pulls = holdings.pulls(where, step, addresses)
        copies = holdings.elsewhere(where, step, addresses)
        log.info("attempt %d resumes checkpoint step %d%s", plan.attempt, step,
                 holdings.where_from(pulls, step))
    config = settings(spec, step)
    return config, {node: dataclasses.replace(config, pulls=pulls.get(node, ()), copies=copies)
                    for node in set(pulls) | (set(where.values()) if copies else set())}


def settings(spec: JobSpec, step: int | None) -> C.CheckpointConfig:
    """The spec's ``checkpoint`` section as every node is told it, with the step to resume."""
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
