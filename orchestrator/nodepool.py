"""The node pool: the controller's channels to every node's agent, and the threads that
open them.

Connecting blocks (an SSH login, a relay's start, the handshake), so it runs on a bounded
pool of connector threads (at most CONNECT_FANOUT at once: thousands of nodes connect in
rounds); a node to retry is queued again after a backoff, on the event loop's timers. An
attached channel joins the event loop (orchestrator/loop.py), which reads it from then on;
closing one (an SSH session can take seconds) runs on a small pool too. One *pinger*
thread sends the controller's heartbeat to every agent while the controller's loop turns.
The outcome of a connect reaches the controller as an ``Attached`` or ``Unavailable``
event; node state stays with the controller's node book (orchestrator/nodebook.py). What the
pool knows of a node (its attached channel, whether a connect is out, its backoff) is its
``Link``, which each node carries and only the pool writes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from agents import commands as C
from orchestrator import events as E
from orchestrator.channel import Channel
from orchestrator.errors import OrchestratorError
from orchestrator.loop import EventLoop
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import (
    AgentGone,
    ConnectionFactory,
    ProtocolViolation,
    WrongVersion,
    attach_agent,
)

log = logging.getLogger("orchestrator.nodepool")

RECONNECT_FIRST = 0.2  # seconds before the first retry; doubled up to RECONNECT_MAX
RECONNECT_MAX = 5.0
CONNECT_FANOUT = 64  # connects in flight at once


@dataclass
class Link:
    """The pool's side of one node: written by the pool alone (connector threads set
    ``connecting`` and ``reconnect_delay``), read by anyone."""

    channel: Channel | None = None  # attached, read by the loop
    heard: float = 0.0  # when the last channel, now dropped, last had anything to read
    connecting: bool = False  # a connect is out, or its outcome not handled yet
    retry: bool = False  # the connector keeps trying until it succeeds
    launch: bool = False  # the connector may start an agent where none answers
    reconnect_delay: float = RECONNECT_FIRST
    waiting: bool = False  # a retry is due after reconnect_delay (see NodePool.hurry)
    retries: int = 0  # the due retry's number: one brought forward leaves it stale


class Node(Protocol):
    """What the pool needs of a node (orchestrator/nodebook.py's Node)."""

    index: int
    spec: NodeSpec
    acked: int  # what the agent may forget: the attach says so
    link: Link

    @property
    def host(self) -> str: ...


class NodePool:
    """Channels to every node's agent for one job."""

    def __init__(self, job_id: str, spec: JobSpec, secret: str, factory: ConnectionFactory,
                 loop: EventLoop):
        self.job_id = job_id
        self.spec = spec
        self.secret = secret
        self.factory = factory
        self.loop = loop
        self._generations = itertools.count(1)
        self.closing = False
        self.main_tick = time.monotonic()  # the loop's last turn (see _ping)
        self._connectors = ThreadPoolExecutor(CONNECT_FANOUT, thread_name_prefix="connect")
        self._closers = ThreadPoolExecutor(8, thread_name_prefix="close")
        self._channels: dict[int, Channel] = {}  # node index -> its attached channel

    def launch_config(self) -> C.Launch:
        h = self.spec.health
        return C.Launch(self.secret, h.heartbeat_interval, h.node_timeout, h.controller_grace,
                        self.spec.spool_max_bytes, self.spec.stop_grace_period,
                        preemption_check=h.preemption_check,
                        preemption_check_interval=h.preemption_check_interval,
                        sigterm_to_workers=self.spec.on_sigterm == "worker")

    # --- connecting (from the loop's thread) --------------------------------------------------
    def connect(self, node: Node, *, launch: bool, retry: bool = False) -> None:
        """Start connecting ``node`` in the background; the outcome arrives as an event.
        With ``launch``, start an agent where none answers (never a second one: the relay
        on the node decides). With ``retry``, keep trying until it works."""
        link = node.link
        link.retry, link.launch = retry, launch  # a queued connect picks these up
        if link.connecting or self.closing:
            return
        link.connecting = True
        link.reconnect_delay = RECONNECT_FIRST
        self._connectors.submit(self._connect_once, node)

    def hurry(self, node: Node) -> None:
        """Try ``node`` again now if its connector waits out a retry's delay, and from the
        first delay on: the job ended, and an agent that comes back is to be shut down at
        once (a cut node's agent outlived its job by the last delay, up to RECONNECT_MAX)."""
        link = node.link
        link.reconnect_delay = RECONNECT_FIRST  # a connect out now retries soon, if it fails
        if link.waiting and not self.closing:
            link.waiting = False
            link.retries += 1  # the due retry, when its time comes, finds itself stale
            self._connectors.submit(self._connect_once, node)

    @staticmethod
    def settled(node: Node) -> None:
        """The controller handles the outcome of ``node``'s connect (its Attached or
        Unavailable) now: it may ask for a new one from here on."""
        node.link.connecting = False

    @staticmethod
    def forgive(node: Node, seconds: float, now: float) -> None:
        """The controller was not looking for ``seconds``: what the node's channels were
        heard counts that much later (see NodeBook.forgive)."""
        link = node.link
        if link.heard:
            link.heard = min(link.heard + seconds, now)
        if link.channel is not None:
            link.channel.heard = min(link.channel.heard + seconds, now)

    @staticmethod
    def give_up(node: Node) -> None:
        """Retry no more once the connect now out fails (a lost node we do not want back,
        a job that ended)."""
        node.link.retry = False

    def _connect_once(self, node: Node) -> None:
        # ``connecting`` stays set until the controller handles the outcome (``settled``):
        # one that waits for connects to end must find the node attached by then, not its
        # Attached still queued (a resumed controller launched on the nodes that happened to
        # be handled first).
        link = node.link
        if self.closing:
            link.connecting = False
            return
        try:
            channel = self._open(node, link.launch)
            self.loop.post(E.Attached(node.index, channel))
            return
        except AgentGone as gone:
            self.loop.post(E.Unavailable(node.index, str(gone), True, gone.reason, cause=gone))
            return
        except (WrongVersion, ProtocolViolation) as exc:  # no use trying again
            refused = "version" if isinstance(exc, WrongVersion) else "protocol"
            self.loop.post(E.Unavailable(node.index, str(exc), refused=refused, cause=exc))
            return
        except OrchestratorError as exc:
            error, cause = str(exc), exc
        except Exception as exc:  # a bug in a transport must not kill the job
            error, cause = f"{node.host}: {exc!r}", None
        if not link.retry or self.closing:
            self.loop.post(E.Unavailable(node.index, error, cause=cause))
            return
        log.info("%s: not reachable yet: %s", node.host, error)
        delay, link.reconnect_delay = link.reconnect_delay, min(RECONNECT_MAX,
                                                                link.reconnect_delay * 2)
        link.retries += 1
        number = link.retries
        link.waiting = True
        self.loop.call_later(delay, lambda: self._resubmit(node, number))

    def _resubmit(self, node: Node, number: int) -> None:
        link = node.link
        if not self.closing and link.waiting and link.retries == number:
            link.waiting = False
            self._connectors.submit(self._connect_once, node)

    def _open(self, node: Node, launch: bool) -> Channel:
        spec = self.spec
        if node.link.retry:  # a reconnect must not sit in one try longer than the node may be away
            timeout = min(spec.ssh.connect_timeout, max(1.0, spec.health.node_timeout / 2))
            spec = spec.model_copy(update={"ssh": spec.ssh.model_copy(
                update={"connect_timeout": timeout})})
        conn = self.factory(node.spec, spec)
        conn.open()
        # A handshake that hangs (a wedged sshd, a stopped agent) must not hang us.
        hello, launched = attach_agent(
            conn, self.job_id, node.index, self.secret, ack=node.acked,
            launch=self.launch_config() if launch else None,
            timeout=max(spec.launch_timeout, 5.0))
        return Channel(node.index, conn, next(self._generations), hello, launched)

    # --- attached channels (the loop's thread) -----------------------------------------------
    def adopt(self, node: Node, channel: Channel) -> None:
        """``channel`` is the node's from now on: the loop reads it."""
        if node.link.channel is not None and node.link.channel is not channel:
            self.drop_channel(node)
        node.link.channel = channel
        self._channels[node.index] = channel
        self.loop.watch(channel)

    def discard(self, channel: Channel) -> None:
        """Close a channel that never became a node's (in the background)."""
        self.loop.forget(channel)
        channel.end()
        self._closers.submit(channel.conn.close)

    def drop_channel(self, node: Node) -> None:
        """Close the node's channel in the background (closing SSH can take a while)."""
        link = node.link
        channel, link.channel = link.channel, None
        if channel is not None:
            link.heard = max(link.heard, channel.heard)  # silence counts from what it said
            self._channels.pop(node.index, None)
            self.discard(channel)

    def send(self, node: Node, message: C.Command) -> bool:
        """Send on the node's channel; False if there is none or it broke (its end then
        arrives as an event)."""
        channel = node.link.channel
        return channel is not None and channel.send(message)

    # --- pings --------------------------------------------------------------------------------
    def start_pinger(self) -> None:
        threading.Thread(target=self._ping, daemon=True, name="pinger").start()

    def _ping(self) -> None:
        """The controller's heartbeat to every agent, on its own thread so no slow step
        delays it. A wedged loop is not kept alive by it: then the agents hear nothing,
        detach, and keep the workers for controller_grace."""
        health = self.spec.health
        while not self.closing:
            if time.monotonic() - self.main_tick < health.node_timeout:
                for channel in list(self._channels.values()):
                    channel.send(C.Ping())
            time.sleep(health.heartbeat_interval)

    def close(self) -> None:
        self.closing = True
        self._connectors.shutdown(wait=False, cancel_futures=True)
        self._closers.shutdown(wait=False)
