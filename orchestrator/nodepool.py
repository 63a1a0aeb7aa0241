"""The node pool: one channel per node to its agent, and the threads that keep them.

Threads, one owner each: up to CONNECT_FANOUT *connectors*, which take the nodes to connect
or reconnect from a queue (open the channel, ``connect`` to the relay, ``attach`` to the
agent; a node that is to be retried is queued again after a delay); a *reader* per open channel
(stamps ``last_heard`` on every message, hands replies to the channel's mailbox and
everything else to ``events``); and one *pinger* for the whole pool, which also closes
handshakes that hang past their deadline. Node state and every
decision stay with the controller's main thread, which consumes ``events``:

    ("attached", index, channel)   a channel is ready: hello received
    ("unavailable", index, error, gone, outcome)
                                   no channel: ``gone`` when the relay found no agent
    ("message", index, gen, msg)   a message of channel ``gen``
    ("closed", index, gen)         channel ``gen`` ended
    ("wake",)                      nothing: look at the cancel flag
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents import protocol as P
from orchestrator.errors import OrchestratorError, TransportError
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.state import NodeState
from orchestrator.transport.base import (
    AgentGone,
    ConnectionFactory,
    NodeConnection,
    attach_agent,
)

log = logging.getLogger("orchestrator.nodepool")

RECONNECT_FIRST = 0.2  # seconds before the first retry; doubled up to RECONNECT_MAX
RECONNECT_MAX = 5.0
CONNECT_FANOUT = 64  # connects in flight at once


@dataclass
class Channel:
    """An open, attached channel and what the agent said on it."""

    conn: NodeConnection
    generation: int
    hello: dict[str, Any]
    launched: bool
    mailbox: P.Mailbox
    # Messages its reader queued for the main thread, and how many of them the main thread
    # handled (one writer each): a node whose messages wait in the queue is not silent, the
    # controller is behind.
    queued: int = 0
    handled: int = 0

    def ask(self, op: str, timeout: float | None, **fields: Any) -> dict[str, Any] | None:
        """Send a request on this channel and wait for its reply (None: no reply within
        ``timeout``, None meaning no limit, or the channel ended). From any thread."""
        req, message = self.mailbox.request(op, **fields)
        try:
            self.conn.send(message)
        except TransportError:
            return None
        return self.mailbox.wait(req, timeout)


@dataclass
class Node:
    """The controller's live view of one spec node (owned by the main thread, except
    ``last_heard``, which the reader stamps)."""

    index: int
    spec: NodeSpec
    state: NodeState = NodeState.PENDING
    channel: Channel | None = None
    info: dict[str, Any] = field(default_factory=dict)
    node_rank: int | None = None
    last_heard: float = 0.0
    received: int = 0  # last sequenced message handled
    acked: int = 0  # last sequenced message a checkpoint holds (the agent may forget it)
    unreachable_since: float | None = None
    state_before: NodeState | None = None  # where an UNREACHABLE node goes back to
    draining: int | None = None  # attempt whose leftover workers we stop before a rejoin
    gap_at: int | None = None  # ``received`` when a missing message made us reattach
    prepared: bool = False  # synced and set up for this job (when the spec asks for it)
    preparing: bool = False
    connecting: bool = False
    retry: bool = False  # the connector keeps trying until it succeeds
    launch: bool = False  # the connector may start an agent where none answers
    reconnect_delay: float = RECONNECT_FIRST

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def usable(self) -> bool:
        """Attached and healthy: may run workers."""
        return self.channel is not None and self.state in (
            NodeState.CONNECTED, NodeState.RUNNING, NodeState.STOPPED) and \
            self.draining is None and self.prepared


class NodePool:
    """Channels to every node's agent for one job."""

    def __init__(self, job_id: str, spec: JobSpec, secret: str, factory: ConnectionFactory):
        self.job_id = job_id
        self.spec = spec
        self.secret = secret
        self.factory = factory
        self.nodes = [Node(i, n) for i, n in enumerate(spec.nodes)]
        # SimpleQueue: the controller's signal handler puts into it too.
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._generations = itertools.count(1)
        self.closing = False
        self.main_tick = time.monotonic()  # the main loop's last turn (see _ping)
        self._connect_queue: queue.SimpleQueue[Node] = queue.SimpleQueue()
        self._connectors_lock = threading.Lock()
        self._connectors = 0  # connector threads alive
        self._busy = 0  # ... of which connecting now
        self._handshakes: dict[int, tuple[float, NodeConnection]] = {}

    def launch_config(self) -> dict[str, Any]:
        h = self.spec.health
        return {"secret": self.secret, "heartbeat_interval": h.heartbeat_interval,
                "node_timeout": h.node_timeout, "controller_grace": h.controller_grace,
                "spool_max_bytes": self.spec.spool_max_bytes,
                "stop_grace": self.spec.stop_grace_period}

    # --- connecting ------------------------------------------------------------------------
    def connect(self, node: Node, *, launch: bool, retry: bool = False) -> None:
        """Start connecting ``node`` in the background; the outcome arrives as an event.
        With ``launch``, start an agent where none answers (never a second one: the relay
        on the node decides). With ``retry``, keep trying until it works."""
        node.retry, node.launch = retry, launch  # a queued connect picks these up
        if node.connecting:
            return
        node.connecting = True
        node.reconnect_delay = RECONNECT_FIRST
        self._queue_connect(node)

    def _queue_connect(self, node: Node) -> None:
        """Connects run on at most CONNECT_FANOUT threads at a time, started as needed and
        gone when idle: thousands of nodes connect in rounds, not on thousands of threads
        (each SSH connect costs CPU here: a storm of them is no faster)."""
        self._connect_queue.put(node)
        with self._connectors_lock:
            idle = self._connectors - self._busy
            if self._connectors < CONNECT_FANOUT and self._connect_queue.qsize() > idle:
                self._connectors += 1
                threading.Thread(target=self._connector, daemon=True,
                                 name=f"connect-{self._connectors}").start()

    def _connector(self) -> None:
        while True:
            try:
                node = self._connect_queue.get(timeout=1.0)
            except queue.Empty:
                with self._connectors_lock:
                    if self._connect_queue.empty():
                        self._connectors -= 1
                        return
                continue
            with self._connectors_lock:
                self._busy += 1
            try:
                self._connect_once(node)
            finally:
                with self._connectors_lock:
                    self._busy -= 1

    def _connect_once(self, node: Node) -> None:
        # ``connecting`` is cleared before the outcome is posted: the main thread may ask for
        # a new connection as soon as it sees it, and must not find this one still "running".
        if self.closing:
            node.connecting = False
            return
        try:
            channel = self._open(node, node.launch)
            node.connecting = False
            # The event goes first: its messages must find the channel installed.
            self.events.put(("attached", node.index, channel))
            threading.Thread(target=self._read, args=(node, channel), daemon=True,
                             name=f"read-{node.index}").start()
            return
        except AgentGone as gone:
            node.connecting = False
            self.events.put(("unavailable", node.index, str(gone), True, gone.outcome))
            return
        except OrchestratorError as exc:
            error = str(exc)
        except Exception as exc:  # a bug in a transport must not kill the job
            error = f"{node.host}: {exc!r}"
        if not node.retry:
            node.connecting = False
            self.events.put(("unavailable", node.index, error, False, None))
            return
        log.info("%s: not reachable yet: %s", node.host, error)
        delay, node.reconnect_delay = node.reconnect_delay, min(RECONNECT_MAX,
                                                                node.reconnect_delay * 2)
        timer = threading.Timer(delay, self._queue_connect, args=(node,))
        timer.daemon = True
        timer.start()

    def _open(self, node: Node, launch: bool) -> Channel:
        spec = self.spec
        if node.retry:  # a reconnect must not sit in one try longer than the node may be away
            timeout = min(spec.ssh.connect_timeout, max(1.0, spec.health.node_timeout / 2))
            spec = spec.model_copy(update={"ssh": spec.ssh.model_copy(
                update={"connect_timeout": timeout})})
        conn = self.factory(node.spec, spec)
        conn.open()
        # A handshake that hangs (a wedged sshd, a stopped agent) must not hang us: the
        # pinger closes it at the deadline (one watchdog for all, not a timer per node).
        with self._connectors_lock:
            self._handshakes[id(conn)] = (time.monotonic() + max(spec.launch_timeout, 5.0),
                                          conn)
        try:
            hello, launched = attach_agent(
                conn, self.job_id, node.index, self.secret, ack=node.acked,
                launch=self.launch_config() if launch else None)
        finally:
            with self._connectors_lock:
                self._handshakes.pop(id(conn), None)
        node.last_heard = time.monotonic()
        return Channel(conn, next(self._generations), hello, launched, P.Mailbox())

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        with self._connectors_lock:
            late = [conn for deadline, conn in self._handshakes.values() if deadline < now]
        for conn in late:
            try:
                conn.close()
            except Exception:
                pass

    def _read(self, node: Node, channel: Channel) -> None:
        conn, gen, mailbox, events = channel.conn, channel.generation, channel.mailbox, \
            self.events
        while True:
            try:
                message = conn.receive()
            except Exception:
                message = None
            if message is None:
                mailbox.deliver(None)
                events.put(("closed", node.index, gen))
                return
            node.last_heard = time.monotonic()
            if message.get("type") == P.HEARTBEAT and "seq" not in message:
                continue  # its only news is last_heard: the main thread need not see it
            if not mailbox.deliver(message):
                channel.queued += 1
                events.put(("message", node.index, gen, message))

    # --- talking -------------------------------------------------------------------------------
    def send(self, node: Node, message: dict[str, Any]) -> bool:
        """Send on the node's channel; False if there is none or it broke (its reader then
        reports it closed)."""
        channel = node.channel
        if channel is None:
            return False
        try:
            channel.conn.send(message)
            return True
        except TransportError:
            return False

    def request(self, node: Node, op: str, timeout: float,
                check: Callable[[], None] | None = None, **fields: Any) -> dict[str, Any] | None:
        """Send a request and wait for its reply (None: no reply within ``timeout``, or the
        channel closed). ``check`` runs between short waits (e.g. the cancel check)."""
        channel = node.channel
        if channel is None:
            return None
        req, message = channel.mailbox.request(op, **fields)
        if not self.send(node, message):
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.main_tick = time.monotonic()  # the caller is the main loop, and it is alive
            reply = channel.mailbox.wait(req, min(0.1, deadline - time.monotonic()))
            if reply is not None or channel.mailbox.closed:
                return reply
            if check:
                check()
        return None

    def drop_channel(self, node: Node) -> None:
        """Close the node's channel in the background (closing SSH can take a while)."""
        channel, node.channel = node.channel, None
        if channel is not None:
            threading.Thread(target=channel.conn.close, daemon=True).start()

    # --- pings -------------------------------------------------------------------------------
    def start_pinger(self) -> None:
        threading.Thread(target=self._ping, daemon=True, name="pinger").start()

    def _ping(self) -> None:
        """The controller's heartbeat to every agent, on its own thread so no slow step
        delays it. A wedged main loop is not kept alive by it: then the agents hear nothing,
        detach, and keep the workers for controller_grace."""
        health = self.spec.health
        while not self.closing:
            self._expire_handshakes()
            if time.monotonic() - self.main_tick < health.node_timeout:
                for node in self.nodes:
                    channel = node.channel
                    if channel is not None:
                        try:
                            channel.conn.send({"op": P.PING})
                        except Exception:
                            pass  # the reader reports the closed channel
            time.sleep(health.heartbeat_interval)

    def close(self) -> None:
        self.closing = True
