"""A channel to one node's agent once it is attached, and the one request helper.

A request gets an id (``req``); its reply, parsed at the door (agents/protocol.py), completes
the request's future on the controller's event loop (orchestrator/loop.py). A reply nobody
waits for any more (a late one) is dropped; when the channel ends, every request still open
gets None. ``ask_all`` asks many channels at once (``ask_each``: each with its own fields)
and waits for all the replies, either by turning the caller's event loop (the controller) or
by blocking (any other thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from agents import protocol as P
from orchestrator.errors import TransportError
from orchestrator.transport.base import NodeConnection

K = TypeVar("K")
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
        self._pending: dict[int, Future[P.Reply | None]] = {}
        self._next = 0

    def send(self, message: dict[str, Any]) -> bool:
        """False when the channel is gone (its end arrives as an event)."""
        try:
            self.conn.send(message)
            return True
        except TransportError:
            return False

    def request(self, op: str, **fields: Any) -> Future[P.Reply | None]:
        """Send request ``op``; the future gets its reply, or None if the channel ends first.
        From any thread."""
        future: Future[P.Reply | None] = Future()
        with self._lock:
            self._next += 1
            req = self._next
            if not self.closed:
                self._pending[req] = future
        future.req = req  # type: ignore[attr-defined]
        if self.closed or not self.send({"op": op, "req": req, **fields}):
            self.forget(future)
            future.set_result(None)
        return future

    def resolve(self, reply: P.Reply) -> None:
        """A reply arrived (on the event loop): its asker gets it; a late one is dropped."""
        with self._lock:
            future = self._pending.pop(reply.req, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def forget(self, future: Future[P.Reply | None]) -> None:
        """Nobody waits for this request any more: its reply, if it comes, is dropped."""
        with self._lock:
            self._pending.pop(getattr(future, "req", -1), None)

    def end(self) -> None:
        """The channel ended: every open request gets None."""
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
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


def ask_all(channels: Mapping[K, Channel], op: str, within: float | None,
            wait: Waiter | None = None, **fields: Any) -> dict[K, P.Reply | None]:
    """Ask every channel ``op`` at once and wait up to ``within`` seconds for all the
    replies: a node's entry is its reply, or None (no reply in time, or its channel ended).
    ``wait`` turns the caller's event loop meanwhile; without it, this thread blocks."""
    return ask_each({key: (ch, fields) for key, ch in channels.items()}, op, within, wait)


def ask_each(requests: Mapping[K, tuple[Channel, Mapping[str, Any]]], op: str,
             within: float | None, wait: Waiter | None = None) -> dict[K, P.Reply | None]:
    """``ask_all`` with each channel's own fields: ``requests`` maps a key to (channel,
    fields)."""
    futures = {key: (ch, ch.request(op, **fields)) for key, (ch, fields) in requests.items()}
    if wait is not None:
        wait(lambda: all(f.done() for _, f in futures.values()), within)
    else:
        wait_futures([f for _, f in futures.values()], within)
    out: dict[K, P.Reply | None] = {}
    for key, (channel, future) in futures.items():
        if future.done():
            out[key] = future.result()
        else:
            channel.forget(future)
            out[key] = None
    return out


def ask(channel: Channel, op: str, within: float | None, wait: Waiter | None = None,
        **fields: Any) -> P.Reply | None:
    """One request, one reply (see ask_all)."""
    return ask_all({0: channel}, op, within, wait, **fields)[0]
