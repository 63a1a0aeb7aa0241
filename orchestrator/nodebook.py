"""The node book: every node's state, and every change of it, in one owner.

A node is PENDING until its agent first answers; CONNECTED (or RUNNING, or STOPPED) while
its channel is attached; UNREACHABLE while its channel is down, or it is silent, and we
reconnect (the attempt goes on; a silent node keeps its channel meanwhile: a word on it brings
it back); LOST when it has been unheard for ``health.node_timeout``, when its agent is gone
or spoke out of protocol, or when its workers did not stop in time; FAILED when it never
came up; DONE at the end. **A node becomes LOST in one place**: :meth:`NodeBook.lose`.

The book also keeps each node's messages in order (sequence numbers, gaps), decides what an
attaching agent must do (:meth:`NodeBook.attach`), finds silent nodes, and writes the
changes of a loop turn in one transaction (:meth:`NodeBook.flush`). It never raises for a
node's fault: it returns what the controller should do.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agents import protocol as P
from orchestrator.channel import Channel
from orchestrator.nodepool import Link, NodePool
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.state import NodeState
from orchestrator.store import Store

if TYPE_CHECKING:
    from orchestrator.attempt import Attempt

log = logging.getLogger("orchestrator.controller")

LIVE = (NodeState.CONNECTED, NodeState.RUNNING, NodeState.STOPPED)


@dataclass(frozen=True)
class NodeInfo:
    """What the store (and ``status``) keeps of a node: its agent's hello, and why it is
    not usable when it is not."""

    hostname: str | None = None
    python: str | None = None
    torch: str | None = None
    gpus: int | None = None
    pid: int | None = None
    instance: str | None = None
    error: str | None = None
    # The health check's problems while ``error`` is its verdict (orchestrator/healthcheck.py:
    # a node that passes again is cleared of that error, and of no other).
    health_problems: list[str] | None = None
    gone_reason: str | None = None  # what its agent wrote when it gave up
    sync: dict[str, Any] | None = None  # the last sync progress
    checkpoint: dict[str, Any] | None = None  # what its checkpoint store holds (checkpoints.py)
    notice: dict[str, Any] | None = None  # its agent's notice: {source, deadline} (drain.py)

    @classmethod
    def from_hello(cls, hello: P.Hello) -> NodeInfo:
        return cls(hello.hostname, hello.python, hello.torch, hello.gpus, hello.pid,
                   hello.instance)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeInfo:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Node:
    """The controller's live view of one spec node: the node book writes it (on the loop's
    thread), except its ``link``, the node pool's (its channel and connects)."""

    index: int
    spec: NodeSpec
    state: NodeState = NodeState.PENDING
    info: NodeInfo = field(default_factory=NodeInfo)
    node_rank: int | None = None
    heard: float = 0.0  # set when attached or resumed; the channel stamps what it reads
    received: int = 0  # last sequenced message handled
    acked: int = 0  # last sequenced message a checkpoint holds (the agent may forget it)
    unreachable_since: float | None = None
    state_before: NodeState | None = None  # where an UNREACHABLE node goes back to
    draining: int | None = None  # attempt whose leftover workers we stop before a rejoin
    gap_at: int | None = None  # ``received`` when a missing message made us reattach
    prepared: bool = False  # synced and set up for this job (when the spec asks for it)
    preparing: bool = False
    setup_failed: bool = False  # out of this job: its setup failed or ran past its time
    link: Link = field(default_factory=Link)
    longest_silence: float = 0.0  # seconds, the longest this node went unheard while attached

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def channel(self) -> Channel | None:
        """The attached channel (the pool's)."""
        return self.link.channel

    @property
    def connecting(self) -> bool:
        """A connect is out, or its outcome is not handled yet."""
        return self.link.connecting

    @property
    def last_heard(self) -> float:
        channel = self.link.channel
        heard = max(self.heard, self.link.heard)
        return max(heard, channel.heard) if channel is not None else heard

    @property
    def last_heard_unix(self) -> float | None:
        """When it was last heard, as unix time (a lost node's fault time)."""
        heard = self.last_heard
        return time.time() - (time.monotonic() - heard) if heard else None

    @property
    def usable(self) -> bool:
        """Attached and healthy: may run workers."""
        return self.channel is not None and self.state in LIVE and \
            self.draining is None and self.prepared


class Order(enum.Enum):
    """What to do with a sequenced message (NodeBook.order)."""

    HANDLE = "handle"
    DUPLICATE = "duplicate"  # replayed, and handled before
    GAP = "gap"  # one went missing: reattach, and the agent replays


@dataclass(frozen=True)
class AttachPlan:
    """What the controller does for an agent that just attached."""

    start: bool = False  # it never got its participant's start
    drain: int | None = None  # stop its leftover workers of this attempt first
    stop: int | None = None  # the attempt is stopping: stop it there too
    prepare: bool = False  # a new agent, maybe a new machine: sync and set up first


class NodeBook:
    def __init__(self, job_id: str, spec: JobSpec, store: Store, pool: NodePool):
        self.job_id = job_id
        self.spec = spec
        self.store = store
        self.pool = pool
        self.nodes = [Node(i, n) for i, n in enumerate(spec.nodes)]
        self._writes: list[tuple[int, NodeState, str | None, dict[str, Any]]] = []
        # Told when a node becomes LOST (the controller's notifications): node, message.
        self.on_lost: Callable[[Node, str | None], None] | None = None
        # Told a node's index when its channel goes with it (no Closed comes then): what it
        # held is forgotten until its agent says again (the engine's checkpoint holdings).
        self.on_gone: Callable[[int], None] = lambda index: None

    # --- states and writes ------------------------------------------------------------------
    def set(self, node: Node, state: NodeState, message: str | None = None, *,
            info: NodeInfo | None = None, **fields: Any) -> None:
        if state != node.state:
            log.info("%s: %s -> %s%s", node.host, node.state.value, state.value,
                     f" ({message})" if message else "")
            if state == NodeState.LOST and self.on_lost is not None:
                self.on_lost(node, message)
        node.state = state
        if info is not None:
            node.info = info
            fields["info"] = info.to_dict()
        self._writes.append((node.index, state, message, fields))

    def note(self, node: Node, info: NodeInfo) -> None:
        """Keep new information about the node; its state stays."""
        node.info = info
        self._writes.append((node.index, node.state, None, {"info": info.to_dict()}))

    def flush(self) -> None:
        """Write the changes since the last flush in one transaction: at the end of each turn
        of the loop, and before any change of the job's state."""
        writes, self._writes = self._writes, []
        self.store.set_nodes(self.job_id, writes)

    def restore(self, records: list[Any]) -> None:
        """A replaced controller takes the nodes as the last one left them."""
        for record in records:
            node = self.nodes[record.node_index]
            node.state, node.node_rank = record.state, record.node_rank
            node.info = NodeInfo.from_dict(record.info)
            node.received = node.acked = record.acked_seq
            node.heard = time.monotonic()
            node.longest_silence = record.longest_silence or 0.0
            if record.state == NodeState.UNREACHABLE:
                # Where it goes back to, and whether losing it fails the attempt: a node
                # UNREACHABLE when its controller died was never blamed on the attempt (the
                # job hung in its peers' collectives, then a restart was charged to the user).
                before = [e.state for e in record.history if e.state != NodeState.UNREACHABLE]
                node.state_before = before[-1] if before else NodeState.RUNNING
                node.unreachable_since = time.monotonic()

    # --- losing a node ------------------------------------------------------------------------
    def unreachable(self, node: Node, why: str, *, keep_channel: bool = False) -> None:
        """The channel is gone but the agent may be fine: reconnect, the attempt goes on.
        With ``keep_channel`` (a node only silent: busy, not cut), its channel stays read
        meanwhile: a node that speaks again on it is back at once (:meth:`heard_again`), not
        silent until a new relay is up (on an oversubscribed node, longer than the rest of
        node_timeout: a false LOST)."""
        if not keep_channel:
            self.pool.drop_channel(node)
        if node.state != NodeState.UNREACHABLE:
            node.state_before = node.state
            node.unreachable_since = time.monotonic()
            self.set(node, NodeState.UNREACHABLE, f"{node.host}: {why}")
        self.pool.connect(node, launch=False, retry=True)

    def heard_again(self, node: Node, attempt: Attempt | None) -> None:
        """An UNREACHABLE node spoke on the channel it kept: back where it was, as when it
        attaches again."""
        target, away = _way_back(node, _in_attempt(node, attempt))
        self.set(node, target, f"heard again after {away:.1f}s unreachable")

    def lose(self, node: Node, message: str, *, retry: bool = True) -> bool:
        """The node is LOST (or FAILED, if it never came up): its channel goes, and, with
        ``retry``, we keep trying in the background (its old workers are stopped first when
        it answers, and it may rejoin). True when it was running workers."""
        was_running = node.state == NodeState.RUNNING or (
            node.state == NodeState.UNREACHABLE and node.state_before == NodeState.RUNNING)
        self.pool.drop_channel(node)
        self.on_gone(node.index)  # a cut link's node held copies nobody can pull any more
        new = NodeState.FAILED if node.state == NodeState.PENDING else NodeState.LOST
        self.set(node, new, message, info=replace(node.info, error=message,
                                                  health_problems=None))
        if retry:
            self.pool.connect(node, launch=True, retry=True)
        else:
            self.pool.give_up(node)
        return was_running

    def silent(self, now: float) -> list[tuple[Node, str]]:
        """Nodes silent long enough to act on, and what to say: UNREACHABLE first (and we
        reconnect), then, after ``health.node_timeout``, LOST."""
        health = self.spec.health
        # A busy node is not a broken channel: reconnecting costs a new relay (and, on an
        # oversubscribed machine, minutes): only after half of node_timeout.
        silence = max(health.node_timeout / 2, health.heartbeat_interval * 1.5)
        out = []
        for node in self.nodes:
            quiet = now - node.last_heard
            if node.channel is not None and node.state in LIVE:
                node.longest_silence = max(node.longest_silence, quiet)
            if node.channel is not None and node.state in LIVE and quiet > silence:
                out.append((node, f"no message for {quiet:.1f}s"))
            elif node.state == NodeState.UNREACHABLE and quiet > health.node_timeout:
                out.append((node, f"{node.host}: no heartbeat for {health.node_timeout:g}s "
                                  "(health.node_timeout)"))
        return out

    def forgive(self, seconds: float, now: float) -> None:
        """The controller was not looking for ``seconds`` (stopped, swapped out, a long
        pause of its own): no node's silence counts that time (and none is heard later
        than ``now``: what it read since it woke is news of now already)."""
        for node in self.nodes:
            if node.heard:
                node.heard = min(node.heard + seconds, now)
            self.pool.forgive(node, seconds, now)
            if node.unreachable_since is not None:
                node.unreachable_since = min(node.unreachable_since + seconds, now)

    # --- messages in order --------------------------------------------------------------------
    def order(self, node: Node, seq: int | None) -> Order:
        """Whether a sequenced message is the next one, one seen before, or after a gap."""
        if seq is None:
            return Order.HANDLE
        if seq <= node.received:
            return Order.DUPLICATE
        if seq != node.received + 1:
            if node.gap_at != node.received:
                # Never skip one: attach again, and the agent replays from the checkpoint.
                log.warning("%s: messages %d..%d missing: reattaching", node.host,
                            node.received + 1, seq - 1)
                node.gap_at = node.received
                return Order.GAP
            # The agent no longer has them (a checkpoint lost with the controller's host,
            # after the agent had been told to forget): say so, and go on.
            log.error("%s: messages %d..%d are lost for good", node.host, node.received + 1,
                      seq - 1)
        node.gap_at = None
        node.received = seq
        return Order.HANDLE

    # --- an agent attached --------------------------------------------------------------------
    def attach(self, node: Node, channel: Channel, attempt: Attempt | None, *,
               resuming: bool, needs_prep: bool) -> AttachPlan:
        """Take ``channel`` as the node's and decide what it must do: run the attempt it
        belongs to, stop leftover workers of another attempt before it may run anything
        (one node never runs two attempts), or be prepared (sync, setup) first."""
        hello = channel.hello
        self.pool.adopt(node, channel)
        node.heard = time.monotonic()
        if channel.launched or hello.instance != node.info.instance:
            node.received = node.acked = 0  # another agent: its messages are numbered from 1
        info = NodeInfo.from_hello(hello)
        notice = node.info.notice
        if hello.instance is not None and hello.instance == node.info.instance:
            # The same agent, back on a new channel (a notice's SIGTERM can take its relay):
            # its notice holds until it says otherwise. Dropped here, the move under way
            # was called off and begun again at another step at the next heartbeat.
            info = replace(info, notice=notice)
        elif notice is not None and time.time() < notice["deadline"]:
            # Another agent on a node told to go (the first left once its workers stopped,
            # and the transport started this one): the host still goes away by the deadline,
            # so the node is no spare until then (drain.py forgets it past the deadline).
            info = replace(info, notice={**notice, "carried": True})
        in_attempt = _in_attempt(node, attempt)
        # Its workers belong to the attempt we run (a LOST node's never do: the attempt
        # failed without it). Any others go before the node runs anything: split-brain guard.
        ours = in_attempt and attempt is not None and node.state != NodeState.LOST and \
            hello.attempt == attempt.number
        stale = hello.running and not ours
        target: NodeState | None
        message: str | None = None
        if resuming and ours:
            target, message = NodeState.RUNNING, "reattached by a new controller"
        elif node.state == NodeState.UNREACHABLE:
            target, away = _way_back(node, in_attempt)
            message = f"reattached after {away:.1f}s unreachable"
        elif node.state in LIVE:
            target = node.state
        elif stale:
            target = None  # CONNECTED once its old workers have stopped
        else:
            target, message = NodeState.CONNECTED, "agent attached"
        start = (in_attempt and attempt is not None and not stale and not attempt.stopping
                 and hello.attempt < attempt.number and node.state != NodeState.LOST
                 and node.state in (*LIVE, NodeState.UNREACHABLE))
        if start:
            target = NodeState.RUNNING  # it never got the start
        if target is None:
            self.note(node, info)
        else:
            self.set(node, target, message, info=info)
        if stale:
            node.draining = hello.attempt
            log.info("%s: stopping its leftover workers of attempt %d before it may run "
                     "again", node.host, hello.attempt)
        prepare = False
        if ours or not needs_prep:
            node.prepared = True  # its workers run already, or there is nothing to prepare
        elif not node.preparing:
            node.prepared = False  # a new agent, maybe a new machine: sync and set up first
            node.preparing = prepare = True
        return AttachPlan(
            start=start and not stale, drain=hello.attempt if stale else None,
            stop=attempt.number if (in_attempt and attempt is not None and attempt.stopping
                                    and not stale and not start) else None,
            prepare=prepare)

    def kept(self) -> list[Node]:
        """A checkpoint holds every message handled: the nodes with messages not yet
        acknowledged, now acknowledged (``acked``: tell their agents)."""
        out = []
        for node in self.nodes:
            if node.received > node.acked:
                node.acked = node.received
                out.append(node)
        return out

    # --- preparing (sync, setup) ---------------------------------------------------------
    @staticmethod
    def preparing(node: Node) -> None:
        """Its preparation starts (again, on a newer channel)."""
        node.preparing = True

    @staticmethod
    def prepared(node: Node, ok: bool) -> None:
        """Its preparation ended: done (``ok``), or interrupted, or the job's to fail."""
        node.preparing = False
        if ok:
            node.prepared = True

    def setup_failed(self, node: Node, message: str) -> None:
        """Its setup failed while the job can go on without it: it stays out of the job."""
        node.preparing = False
        node.setup_failed = True
        self.lose(node, message, retry=False)

    def place(self, node: Node, node_rank: int | None, state: NodeState | None = None) -> None:
        """The node's place in the attempt starting (None: none, a spare or out of the
        job), and its state with it."""
        node.node_rank = node_rank
        self.set(node, node.state if state is None else state, node_rank=node_rank)

    def drained(self, node: Node, attempt_number: int) -> bool:
        """The node's leftover workers of ``attempt_number`` stopped: it may rejoin."""
        if node.draining is None or attempt_number != node.draining:
            return False
        node.draining = None
        self.set(node, NodeState.CONNECTED,
                 f"rejoined: workers of attempt {attempt_number} stopped first")
        return True


def _in_attempt(node: Node, attempt: Attempt | None) -> bool:
    """Whether ``node`` is a participant of ``attempt``, which still runs."""
    return attempt is not None and not attempt.ended and node.index in attempt.node_plans


def _way_back(node: Node, in_attempt: bool) -> tuple[NodeState, float]:
    """Where an UNREACHABLE node goes back to, and how long it was away: where it was (a
    node that ran workers of an attempt that ended meanwhile: STOPPED)."""
    away = time.monotonic() - (node.unreachable_since or time.monotonic())
    target = node.state_before or NodeState.CONNECTED
    if target == NodeState.RUNNING and not in_attempt:
        target = NodeState.STOPPED
    return target, away
