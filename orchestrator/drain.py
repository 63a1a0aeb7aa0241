"""Planned interruptions: a node an operator drains (``orchestrator drain``), or whose agent
has a notice (a SIGTERM from its host or Slurm, a cloud's ``preemption_check``: the node's
info, from its heartbeats; the notice's deadline is the move's time), leaves the job at a
step every rank saved, and a spare (or the remaining nodes, within ``nnodes`` MIN) takes
over from that step: no restart charged, nothing redone. When every node leaves, or a
noticed node the job cannot do without, the agreed step is also persisted
(``save_at.persist``) and the job stops PREEMPTED (a failure naming no node:
``policy.decide``), for ``resume``.

The store keeps the drains (for every job, or for one, where a node index may name the
node). The engine's checks call :meth:`Mover.look` four times a second. When a participant
of the running attempt is drained and the job can go on without it, the mover picks the
agreed step: where the ranks are now (the highest step any rank reported, a heartbeat's or a
save's, and their pace since), plus what they do in 1.5 s (reports lag) and one. It tells
every participant's agent (``save_at``; again to one that attaches again meanwhile); a
script that saves every step, or with ``checkpoint.save(step, state, every=N)`` (called at
every step: it reports the step as it goes), saves it and waits there (up to ``within``), so
that no step is done twice. Once every rank holds it in its node's memory, and each noticed
node's ranks also have a replica elsewhere (it may go away: a drained node stays up, and
the nodes taking its place pull its ranks' copies from its memory while their workers
start), the attempt ends with cause PREEMPTED (class preempted: restarted at once, not
charged), and the next one runs without the leaving nodes from that step. Past the
drain's ``within`` seconds it ends all the same, and the next attempt resumes the newest
step every rank holds (the failure says so). A job that cannot go on without a drained node
keeps it (a drain stops new work, as Slurm's does) and says so once. A job whose ranks keep
nothing in the agents' memory (none reported within 15 s) moves then, and resumes from its
own checkpoints.

May call ``attempt``, ``reputation`` (host names) and the store's drains; the engine is
handed in.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agents import commands as C
from orchestrator import checkpoints
from orchestrator.attempt import Attempt, Failure
from orchestrator.reputation import host_key
from orchestrator.state import FailureCause, JobState
from orchestrator.store import Store

if TYPE_CHECKING:
    from orchestrator.engine import Engine

log = logging.getLogger("orchestrator.controller")

DEFAULT_WITHIN = 120.0  # seconds a drain gives the ranks to save the agreed step
# The agreed step is ahead of the highest reported one by what the ranks do in LEAD seconds
# (reports lag: a heartbeat file read, a save sealed and reported) and one, at least MARGIN.
LEAD = 1.5
MARGIN = 2
NO_SAVES_WAIT = 15.0  # seconds a drain waits for a first save reported before moving
STOP_MARGIN = 1.0  # seconds of a notice's grace kept for stopping the workers
PACE_CHANGES = 8  # the last changes of the highest step reported: the ranks' pace


def matches(drain: dict[str, Any], job_id: str, node_index: int, host: str) -> bool:
    """Whether ``drain`` (a row of the store's drains) holds node ``node_index`` of
    ``job_id``, whose spec host is ``host``."""
    if drain["job_id"] not in ("", job_id):
        return False
    target = drain["target"]
    return target in ("*", host, host_key(host)) or (
        drain["job_id"] == job_id and target == str(node_index))


def drained(drains: list[dict[str, Any]], job_id: str,
            hosts: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Node index -> the drain that holds it (of ``hosts``: node index -> spec host)."""
    out: dict[int, dict[str, Any]] = {}
    for index, host in hosts.items():
        for drain in drains:
            if matches(drain, job_id, index, host):
                out.setdefault(index, drain)
    return out


def noticed(nodes: list[Any], job_id: str) -> dict[int, dict[str, Any]]:
    """Node index -> a drain (as the store's rows) for each node whose agent has a notice:
    the move has until its deadline, less STOP_MARGIN for the stop itself."""
    out = {}
    for node in nodes:
        notice = node.info.notice
        if notice is not None:
            within = max(0.0, notice["deadline"] - time.time() - STOP_MARGIN)
            out[node.index] = {"target": str(node.index), "job_id": job_id,
                               "since": time.time(), "reason": notice["source"],
                               "within": within, "notice": True}
    return out


@dataclass
class Move:
    """A planned move under way: ``nodes`` leave once every rank saved ``step``."""

    attempt: int
    nodes: tuple[int, ...]
    reason: str
    step: int
    deadline: float  # monotonic
    within: float
    whole: bool = False  # every node leaves: the job stops PREEMPTED (persisted, if it can)
    in_memory: float | None = None  # seconds from its start to every rank's save in memory
    persist: bool = False
    # The leaving nodes stay up (drained, not noticed) and serve their ranks' copies: the move
    # ends once every rank holds the step in memory, and the nodes taking their places pull
    # those copies from them while their workers start (no replica sent during the move).
    pull: bool = False
    # Node index -> the channel it was told the step on (None: it had none). A node that
    # attaches again meanwhile (a notice's SIGTERM may take its relay: Slurm's) is told again.
    told: dict[int, Any] = field(default_factory=dict)
    again: bool = False  # agreed once more: every rank was past the first step when told


@dataclass
class Lift:
    """A move undrained before it ended: every participant is told the step is off, as it
    was told the step (again on a channel it attaches on later). One not told would hold its
    ranks at the step until the move's deadline, and send no replicas for the rest of the
    attempt (its agent defers them during a move)."""

    attempt: int
    deadline: float  # the move's (monotonic)
    told: dict[int, Any] = field(default_factory=dict)  # as Move.told


class Mover:
    """The planned moves of one job (the engine's; its checks call :meth:`look`)."""

    def __init__(self, job_id: str, store: Store, hosts: dict[int, str],
                 taken_over: bool = False):
        self.job_id, self.store, self.hosts = job_id, store, hosts
        # A controller that takes over a running attempt knows no move of the last one's: a
        # step its ranks hold at, undrained since, would hold them until the move's time ran
        # out (120 s), and their agents send no replicas meanwhile. Told off once, unless a
        # move begins first.
        self._unknown_move = taken_over
        self.drained: dict[int, dict[str, Any]] = {}  # node index -> its drain, as last read
        self.move: Move | None = None
        self._said: set[tuple[int, ...]] = set()
        # (monotonic time, attempt, highest step reported) where it changed: the ranks' pace.
        self._seen: deque[tuple[float, int, int]] = deque(maxlen=PACE_CHANGES)
        self._placed: tuple[int, dict[int, int]] | None = None
        # (attempt, leaving) -> when a drain was first seen before any save of that attempt
        self._unsaved: dict[tuple[int, tuple[int, ...]], float] = {}
        self._lift: Lift | None = None
        self._released: dict[int, Any] = {}  # node index -> the channel it was told on

    def look(self, engine: Engine) -> None:
        for node in engine.nodes:  # a notice another agent took over: past its deadline,
            notice = node.info.notice  # the node is still here (nodebook.py attach)
            if notice is not None and notice.get("carried") and time.time() >= notice["deadline"]:
                log.warning("%s is still here past its notice's deadline: usable again",
                            self.hosts[node.index])
                engine.book.note(node, replace(node.info, notice=None))
        # A notice over a drain of the same node: it goes away by its deadline whatever we
        # do (a drain's longer wait, and its memory taken to stay up, failed the next attempt).
        self.drained = {**drained(self.store.drains(), self.job_id, self.hosts),
                        **noticed(engine.nodes, self.job_id)}
        engine.holdings.set_leaving(self.drained, [i for i, d in self.drained.items()
                                                   if not d.get("notice")])
        # Undrained: a spare again (it takes replicas), to be released again if drained again.
        self._released = {i: c for i, c in self._released.items() if i in self.drained}
        attempt = engine.current
        if attempt is None or attempt.ended or attempt.failure is not None or \
                attempt.stopping or engine.state != JobState.RUNNING:
            return
        if self._unknown_move:
            self._unknown_move = False
            self._lift = Lift(attempt.number, time.monotonic())
        highest = self._highest(engine, attempt)
        if highest is not None and (not self._seen or self._seen[-1][1:] != (attempt.number,
                                                                             highest)):
            self._seen.append((time.monotonic(), attempt.number, highest))  # when it changed
        move = self.move
        if move is not None and move.attempt != attempt.number:
            self.move = move = None  # its attempt ended otherwise (a rank failed meanwhile)
        if move is not None:
            if all(i in self.drained for i in move.nodes):
                attempt.held()
                self._widen(engine, attempt, move)
                self._check(engine, attempt)
            else:  # undrained meanwhile: the ranks held at the step go on
                log.warning("%s undrained: the job goes on there", self._names(move.nodes))
                self.move = None
                self._lift = Lift(attempt.number, move.deadline)
        elif self.drained:
            self._begin(engine, attempt)
        self._tell_lift(engine, attempt)
        if self.move is None:
            self._release(engine, attempt)

    def leave_out(self, healthy: list[Any], min_nodes: int) -> list[Any]:
        """``healthy`` nodes less the drained ones, where ``min_nodes`` allows."""
        kept = [n for n in healthy if n.index not in self.drained]
        if len(kept) == len(healthy):
            return healthy
        if len(kept) >= min_nodes:
            log.warning("leaving out drained node(s) %s",
                        ", ".join(self.hosts[n.index] for n in healthy if n not in kept))
            return kept
        log.warning("drained node(s) run all the same: without them fewer than nnodes MIN "
                    "(%d) are left", min_nodes)
        return healthy

    # --- a move ------------------------------------------------------------------------------
    def _begin(self, engine: Engine, attempt: Attempt) -> None:
        leaving = tuple(i for i in attempt.participants if i in self.drained)
        shape = self._shape(engine, attempt, leaving) if leaving else None
        if shape is None:
            return
        leaving, whole, reason, within = shape
        drains = [self.drained[i] for i in leaving]
        placement = self._placement(engine, attempt)
        step = self._agreed_step(engine, attempt, placement)
        if step is None:
            # No save reported yet: the agents report after sealing and replicating, which
            # takes seconds for big states. Only a while without any is a script that saves
            # nothing in their memory.
            self._unsaved = {k: v for k, v in self._unsaved.items() if k[0] == attempt.number}
            since = self._unsaved.setdefault((attempt.number, leaving), time.monotonic())
            if time.monotonic() - since < min(within, NO_SAVES_WAIT):
                return
            self._end(attempt, leaving, reason, "its ranks keep no checkpoint in the agents' "
                      "memory: the next attempt resumes from the job's own checkpoints", whole)
            return
        persist = whole and engine.spec.checkpoint.dir is not None
        pull = not whole and not any(d.get("notice") for d in drains) and \
            engine.holdings.serving(leaving)
        self.move = Move(attempt.number, leaving, reason, step, time.monotonic() + within,
                         within, whole, persist=persist, pull=pull)
        self._tell_step(engine, attempt, self.move)
        log.warning("%s drained (%s): every rank saves step %d%s, then the job %s",
                    self._names(leaving), reason, step, " and persists it" if persist else "",
                    "stops PREEMPTED" if whole else "goes on without it")

    def _shape(self, engine: Engine, attempt: Attempt, leaving: tuple[int, ...]
               ) -> tuple[tuple[int, ...], bool, str, float] | None:
        """(leaving, whole, reason, within) of a move of ``leaving`` off the attempt (fewer
        where drains wait beside notices); None where a drain keeps them running (said
        once)."""
        spares = [n for n in engine.nodes if n.usable and n.index not in attempt.node_plans
                  and n.index not in self.drained]

        def stuck(going: tuple[int, ...]) -> bool:
            return len(attempt.participants) - len(going) + len(spares) < engine.spec.min_nodes

        def keeps_running(nodes: tuple[int, ...]) -> None:
            self._say_once(nodes, "%s drained, but the job cannot go on without it (nnodes "
                           "MIN %d, %d spare(s)): it keeps running there", self._names(nodes),
                           engine.spec.min_nodes, len(spares))

        noticed = tuple(i for i in leaving if self.drained[i].get("notice"))
        if noticed != leaving and stuck(leaving) and noticed and not stuck(noticed):
            # Drains the job cannot do without beside noticed nodes it can: those go, the
            # drains wait, as alone (it was a whole stop, for the user to resume, though
            # the noticed nodes had spares to go to).
            keeps_running(tuple(i for i in leaving if i not in noticed))
            leaving = noticed
        staying = len(attempt.participants) - len(leaving)
        # Nowhere to go on: a drain leaves the job running there (a drain stops new work),
        # but when every node leaves, or one goes away whatever we do (a notice), the job
        # stops at a saved step (persisted), until resumed.
        whole = stuck(leaving) and (staying == 0 or bool(noticed))
        if stuck(leaving) and not whole:
            keeps_running(leaving)
            return None
        drains = [self.drained[i] for i in leaving]
        reason = "; ".join(sorted({d["reason"] for d in drains if d["reason"]})) or "drained"
        return leaving, whole, reason, min(float(d["within"]) for d in drains)

    def _widen(self, engine: Engine, attempt: Attempt, move: Move) -> None:
        """Participants drained or noticed since the move began leave with it, at its step:
        the notices of one preemption reach the nodes a heartbeat or more apart (a Slurm
        allocation's, a cloud reclaiming several), and a move begun for the first went on
        without the others, so that a job whose every node was noticed moved onto its spare
        and never stopped PREEMPTED with the step persisted. Every participant is told
        again: what the move persists and who replicates may have changed (an agent that
        sealed the step already persists it then: agents/checkpoints.py)."""
        leaving = tuple(i for i in attempt.participants if i in self.drained or i in move.nodes)
        # A drained node noticed since: it goes away by the notice's deadline, its memory
        # serves no pull, and its copies must go elsewhere first.
        noticed = move.pull and any(self.drained[i].get("notice") for i in move.nodes)
        if leaving == move.nodes and not noticed and (move.whole or all(
                i in attempt.node_plans for i in self.drained)):
            return  # no one new, and no spare drained or noticed since
        shape = self._shape(engine, attempt, leaving)
        if shape is None or (shape[0] == move.nodes and not shape[1] and not noticed):
            # The job cannot do without the new ones: the move goes on without them. The
            # same nodes: unless the spares it moves onto were noticed too (a whole stop).
            return
        leaving, whole, reason, within = shape
        joined = tuple(i for i in leaving if i not in move.nodes)
        began = move.deadline - move.within
        deadline = min(move.deadline, time.monotonic() + within)
        persist = whole and engine.spec.checkpoint.dir is not None
        pull = move.pull and not whole and \
            not any(self.drained[i].get("notice") for i in leaving) and \
            engine.holdings.serving(joined)
        self.move = replace(move, nodes=leaving, reason=reason, deadline=deadline,
                            within=deadline - began, whole=whole, persist=persist, pull=pull,
                            told={})
        self._tell_step(engine, attempt, self.move)
        log.warning("%s drained too (%s): every rank saves step %d%s, then the job %s",
                    self._names(joined) if joined else "the spare(s)", reason, move.step,
                    " and persists it" if persist else "",
                    "stops PREEMPTED" if whole else "goes on without them")

    def _check(self, engine: Engine, attempt: Attempt) -> None:
        move = self.move
        assert move is not None
        self._tell_step(engine, attempt, move)  # those that attached again since
        placement = self._placement(engine, attempt)
        where = engine.spec.checkpoint.dir if move.whole else None
        began = move.deadline - move.within
        if move.in_memory is None and engine.holdings.saved(move.step, placement, ()):
            move.in_memory = time.monotonic() - began  # what the rest of the move took is
            log.info("every rank holds step %d in its node's memory, %.2fs after the move "
                     "began", move.step, move.in_memory)  # copies elsewhere (or persisted)
        elsewhere = () if move.whole or move.pull else move.nodes
        if engine.holdings.saved(move.step, placement, elsewhere) and \
                (where is None or engine.holdings.persisted(move.step, placement)):
            took = time.monotonic() - began
            log.warning("every rank saved step %d%s, %.2fs after the move began", move.step,
                        f" in {where}" if where else "" if move.whole else
                        " (the leaving ranks' copies are pulled from their node)" if move.pull
                        else " and its copies elsewhere", took)
            self._end(attempt, move.nodes, move.reason, f"every rank saved step {move.step}" +
                      (f", persisted in {where}" if where else "") + f" (in {took:.1f}s)",
                      move.whole)
        elif time.monotonic() > move.deadline:
            within = round(move.within, 1)
            self._end(attempt, move.nodes, move.reason,
                      f"not every rank saved step {move.step} within {within:g}s: the next "
                      "attempt resumes the newest step every rank holds", move.whole)
        elif not move.again and len(attempt.last_steps) >= len(placement) and \
                min(attempt.last_steps.values()) > move.step:
            # Every rank was past the step when told (fast steps just after a start or a
            # controller's takeover: no pace known yet): none saves it, and the move waited
            # for its deadline. Another step, agreed now.
            step = self._agreed_step(engine, attempt, placement)
            if step is not None and step > move.step:
                log.warning("every rank was past step %d when told: every rank saves step %d",
                            move.step, step)
                self.move = replace(move, step=step, told={}, in_memory=None, again=True)
                self._tell_step(engine, attempt, self.move)

    def _end(self, attempt: Attempt, leaving: tuple[int, ...], reason: str, what: str,
             whole: bool = False) -> None:
        self.move = None
        if whole:  # a failure naming no node: the job stops PREEMPTED (policy.decide)
            who = "every node" if set(leaving) == set(attempt.participants) else \
                f"{self._names(leaving)}, without which the job cannot go on,"
            attempt.fail(Failure(FailureCause.PREEMPTED, f"{who} drained ({reason}): {what}; "
                                 "the job stops until `orchestrator resume`"))
            return
        first = leaving[0]
        attempt.fail(Failure(
            FailureCause.PREEMPTED, f"{self._names(leaving)} drained ({reason}): {what}; the "
            "job goes on without it", node_index=first, node_rank=attempt.node_ranks.get(first),
            host=self.hosts[first]))

    def _highest(self, engine: Engine, attempt: Attempt) -> int | None:
        """The highest step any rank reported (a heartbeat, or a save its agent holds)."""
        saved = engine.holdings.newest_saved(self._placement(engine, attempt))
        return max([*attempt.last_steps.values(), *([] if saved is None else [saved])],
                   default=None)

    def _placement(self, engine: Engine, attempt: Attempt) -> dict[int, int]:
        """Rank -> the node index it runs on (once per attempt: looked at four times a
        second, for thousands of ranks). Counted as the checkpoint store counts them: a
        torchrun-style or per-node launch names no worker's rank, and a move of such a job
        found no rank, agreed on no step, and stopped a whole job without a save."""
        if self._placed is None or self._placed[0] != attempt.number:
            per_node = engine.spec.nproc_per_node
            self._placed = (attempt.number, checkpoints.placement(
                attempt.plan, attempt.nprocs, per_node if isinstance(per_node, int) else 1))
        return self._placed[1]

    def _agreed_step(self, engine: Engine, attempt: Attempt,
                     placement: dict[int, int]) -> int | None:
        """Where the ranks are now (the highest step reported, and their pace since: a
        script that saves every N steps reports every N steps), plus what they do in LEAD
        seconds and one, at least MARGIN past the highest; None when no rank keeps saves in
        its agent's memory."""
        if engine.holdings.newest_saved(placement) is None:
            return None
        seen = [(t, s) for t, number, s in self._seen if number == attempt.number]
        highest = self._highest(engine, attempt)
        assert highest is not None
        if len(seen) < 2 or seen[-1][0] - seen[0][0] < 0.5:
            return highest + MARGIN
        pace = (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])
        since = time.monotonic() - seen[-1][0]
        step = max(highest + MARGIN, math.ceil(highest + pace * (since + LEAD)) + 1)
        log.info("agreed step %d: step %d reported %.2fs ago, at %.2f steps/s", step, highest,
                 since, pace)
        return step

    def _release(self, engine: Engine, attempt: Attempt) -> None:
        """A drained node out of the job lets go of its checkpoint memory once the ranks
        that took its place loaded their copies (pulled from it, or from replicas): it kept
        its ranks' copies and its buddy's replicas, gigabytes of a node the operator wants
        back, for as long as the job ran."""
        for index, drain in self.drained.items():
            node = engine.nodes[index]
            held = engine.holdings.summary(index)
            if drain.get("notice") or index in attempt.node_plans or not held or \
                    not held["memory_bytes"] or node.channel is None or \
                    self._released.get(index) is node.channel:
                continue
            if attempt.restored_step is not None and engine.holdings.loaded_step(
                    attempt.number, len(self._placement(engine, attempt))) is None:
                return  # its copies may still be pulled: once every rank loaded
            self._released[index] = node.channel
            engine.pool.send(node, C.Release())
            log.info("%s lets go of its checkpoint memory (%d bytes): drained and out of "
                     "the job", self._names((index,)), held["memory_bytes"])

    def _tell_lift(self, engine: Engine, attempt: Attempt) -> None:
        """An undrained move's end to each participant not yet told it on the channel it has
        now; until a new move, the next attempt, or the old deadline once every participant
        was told on a channel."""
        lift = self._lift
        if lift is None:
            return
        if self.move is not None or lift.attempt != attempt.number or (
                time.monotonic() > lift.deadline and
                all(lift.told.get(i) is not None for i in attempt.participants)):
            self._lift = None
            return
        for node in _untold(engine, attempt, lift.told):
            engine.pool.send(node, C.SaveAt(None))

    @staticmethod
    def _tell_step(engine: Engine, attempt: Attempt, move: Move) -> None:
        """The agreed step to each participant not yet told it on the channel it has now,
        holding for what is left of the move; only the leaving nodes replicate meanwhile
        (none, where their copies are pulled from them after it)."""
        command: C.SaveAt | None = None
        first = not move.told
        for node in _untold(engine, attempt, move.told):
            index = node.index
            if not first:
                log.info("%s attached again during the move: told step %d again", node.host,
                         move.step)
            if command is None:
                command = C.SaveAt(move.step, max(0.0, move.deadline - time.monotonic()),
                                   move.persist)
            engine.pool.send(node, replace(
                command, replicate=not move.whole and not move.pull and index in move.nodes))

    def _names(self, nodes: tuple[int, ...]) -> str:
        return ", ".join(f"node {i} ({self.hosts[i]})" for i in nodes)

    def _say_once(self, key: tuple[int, ...], text: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(text, *args)


def _untold(engine: Engine, attempt: Attempt, told: dict[int, Any]) -> list[Any]:
    """The participants not yet told on the channel each has now (a command sent while a
    node's channel is down is lost with it), marked told in ``told`` (index -> channel)."""
    out = []
    for index in attempt.participants:
        node = engine.nodes[index]
        channel = node.channel
        if index in told and told[index] is channel:
            continue
        told[index] = channel
        if channel is not None:
            out.append(node)
    return out
