"""A channel to one node's agent once it is attached, and the one request helper.

Commands are typed (agents/commands.py) and encoded here, the one place a command becomes a
line. A request gets an id (``req``); its reply, parsed at the door (agents/protocol.py),
completes the request's future on the controller's event loop (orchestrator/loop.py) when it
is of the type the request is answered by (``Request.REPLY``) or ``Failed``; any other reply
fails the request. A reply nobody waits for any more (a late one) is dropped; when the
channel ends, every request still open gets None. ``ask_all`` asks many channels at once
(``ask_each``: each its own request) and waits for all the replies, either by turning the
caller's event loop (the controller) or by blocking (any other thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeAlias, TypeVar

from agents import commands as C
from agents import protocol as P
from orchestrator.errors import TransportError
from orchestrator.transport.base import NodeConnection

K = TypeVar("K")
R = TypeVar("R", bound=P.Reply)
#: What a request gets: its reply, ``Failed`` (the node could not), or None (no reply: the
#: channel ended, or the time was up).
Answer: TypeAlias = R | P.Failed | None
#: Run the caller's event loop until ``done()`` or ``timeout`` seconds (None: no limit).
Waiter = Callable[[Callable[[], bool], "float | None"], object]


class Channel:
    """An attached channel: its connection, what the agent said on attaching, and the
    requests that wait for a reply. ``heard`` is when it last had anything to read."""

    def __init__(self, node_index: int, conn: NodeConnection, generation: int,
                 hello: P.Hello, launched: bool):
        self.node_index = node_index
        self.conn = conn
        self.generation = generation
        self.hello = hello
        self.launched = launched
        self.heard = time.monotonic()
        self.closed = False
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future[Any], type[P.Reply]]] = {}
        self._next = 0

    def send(self, command: C.Command) -> bool:
        """False when the channel is gone (its end arrives as an event)."""
        return self._send(C.wire(command))

    def _send(self, line: dict[str, Any]) -> bool:
        try:
            self.conn.send(line)
            return True
        except TransportError:
            return False

    def request(self, request: C.Request[R]) -> Future[Answer[R]]:
        """Send ``request``; the future gets its reply, or None if the channel ends first.
        From any thread."""
        future: Future[Answer[R]] = Future()
        with self._lock:
            self._next += 1
            req = self._next
            if not self.closed:
                self._pending[req] = (future, request.REPLY)
        future.req = req  # type: ignore[attr-defined]
        if self.closed or not self._send(C.wire(request, req)):
            self.forget(future)
            future.set_result(None)
        return future

    def resolve(self, reply: P.Reply) -> None:
        """A reply arrived (on the event loop): its asker gets it, or ``Failed`` when it is
        not what the request is answered by; a late one is dropped."""
        with self._lock:
            future, expected = self._pending.pop(reply.req, (None, P.Reply))
        if future is None or future.done():
            return
        if not isinstance(reply, (expected, P.Failed)):
            reply = P.Failed(reply.req, f"answered {type(reply).__name__}, not "
                                        f"{expected.__name__}")
        future.set_result(reply)

    def forget(self, future: Future[Any]) -> None:
        """Nobody waits for this request any more: its reply, if it comes, is dropped."""
        with self._lock:
            self._pending.pop(getattr(future, "req", -1), None)

    def end(self) -> None:
        """The channel ended: every open request gets None."""
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_result(None)

    def read(self) -> list[dict[str, Any]] | None:
        """What the connection has now, as decoded messages (None: it ended)."""
        try:
            data = self.conn.read()
        except BlockingIOError:  # something else was readable (an SSH channel's stderr)
            self.heard = time.monotonic()
            return []
        except (OSError, EOFError, ValueError, TransportError):
            data = b""
        if not data:
            return None
        self.heard = time.monotonic()
        self.conn.framer.feed(data)
        return self.conn.framer.take()


def ask_all(channels: Mapping[K, Channel], request: C.Request[R], within: float | None,
            wait: Waiter | None = None) -> dict[K, Answer[R]]:
    """Ask every channel ``request`` at once and wait up to ``within`` seconds for all the
    replies: a node's entry is its reply, or None (no reply in time, or its channel ended).
    ``wait`` turns the caller's event loop meanwhile; without it, this thread blocks."""
    return ask_each({key: (ch, request) for key, ch in channels.items()}, within, wait)


def ask_each(requests: Mapping[K, tuple[Channel, C.Request[R]]], within: float | None,
             wait: Waiter | None = None) -> dict[K, Answer[R]]:
    """``ask_all`` with each channel's own request: ``requests`` maps a key to (channel,
    request)."""
    futures = {key: (ch, ch.request(request)) for key, (ch, request) in requests.items()}
    if wait is not None:
        wait(lambda: all(f.done() for _, f in futures.values()), within)
    else:  # a wait beyond what a lock can wait (a spec's huge timeout) is no limit
        wait_futures([f for _, f in futures.values()],
                     None if within is None or within >= threading.TIMEOUT_MAX else within)
    out: dict[K, Answer[R]] = {}
    for key, (channel, future) in futures.items():
        if future.done():
            out[key] = future.result()
        else:
            channel.forget(future)
            out[key] = None
    return out


def ask(channel: Channel, request: C.Request[R], within: float | None,
        wait: Waiter | None = None) -> Answer[R]:
    """One request, one reply (see ask_all)."""
    return ask_all({0: channel}, request, within, wait)[0]
