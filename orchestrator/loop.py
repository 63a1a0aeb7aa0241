"""The controller's one event loop: every channel's input through one selector, what other
threads post (connects, preparations, signals), and timers.

No thread per channel: each turn reads once from every channel that has something (at most
64 KiB each, so a flooding node cannot starve the others), stamps when each was last heard,
and turns what it read into events. The queue is bounded by construction: what the
controller has not read stays in the kernel's buffers and in the agents' windows (4 MiB of
output each), which is where backpressure belongs. Replies complete their requests here and
heartbeats only stamp their channel; a message out of protocol becomes a ``Rejected`` event
for its node, never an exception.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import select
import selectors
import threading
import time
from collections.abc import Callable

from agents import protocol as P
from orchestrator import events as E
from orchestrator.channel import Channel


class EventLoop:
    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()  # the timers'
        # SimpleQueue: put() is safe in a signal handler, a lock taken there could deadlock.
        self._posted: queue.SimpleQueue[E.Event] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._backlog: set[Channel] = set()  # read before they joined: their messages wait
        self._channels: set[Channel] = set()
        self._ready: set[Channel] = set()  # read at the last turn

    # --- channels ---------------------------------------------------------------------------
    def watch(self, channel: Channel) -> None:
        """Read ``channel`` from now on (messages its handshake read already come first)."""
        try:
            self._selector.register(channel.conn.fileno(), selectors.EVENT_READ, channel)
        except (ValueError, KeyError, OSError):
            self.post(E.Closed(channel))
            return
        self._channels.add(channel)
        if channel.conn.framer.pending:
            self._backlog.add(channel)

    def forget(self, channel: Channel) -> None:
        """Stop reading ``channel`` (the controller dropped it)."""
        if channel in self._channels:
            self._channels.discard(channel)
            self._backlog.discard(channel)
            try:
                self._selector.unregister(channel.conn.fileno())
            except (ValueError, KeyError, OSError):
                pass

    def readable(self, channels: list[Channel], *, now: bool = False) -> list[Channel]:
        """Those of ``channels`` that had something at the last turn (``now``: that have
        something right now, asked of the kernel: for a few channels only)."""
        watched = [c for c in channels if c in self._channels]
        if not now:
            return [c for c in watched if c in self._backlog or c in self._ready]
        poller = select.poll()
        by_fd = {}
        for c in watched:
            by_fd[c.conn.fileno()] = c
            poller.register(c.conn.fileno(), select.POLLIN)
        ready = {fd for fd, _ in poller.poll(0)} if by_fd else set()
        return [c for c in watched if c in self._backlog or c.conn.fileno() in ready]

    # --- from other threads ---------------------------------------------------------------------
    def post(self, event: E.Event) -> None:
        """Hand an event to the loop (from any thread, or a signal handler)."""
        self._posted.put(event)
        self._wake()

    def call_later(self, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the loop's thread after ``delay`` seconds (from any thread)."""
        with self._lock:
            heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), action))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake

    # --- one turn ---------------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[E.Event]:
        """Wait up to ``timeout`` for anything, then return every event it brought."""
        self._run_timers()
        if not self._posted.empty() or self._backlog:
            timeout = 0.0
        else:
            with self._lock:
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - time.monotonic()))
        out: list[E.Event] = []
        self._ready = set(self._backlog)
        for channel in list(self._backlog):
            self._backlog.discard(channel)
            self._messages(channel, channel.conn.framer.take(), out)
        for key, _ in self._selector.select(timeout):
            channel = key.data
            if channel is None:
                self._drain_wake()
                continue
            if channel not in self._channels:
                continue
            self._ready.add(channel)
            raw = channel.read()
            if raw is None:  # its end
                self.forget(channel)
                channel.end()
                out.append(E.Closed(channel))
                continue
            self._messages(channel, raw, out)
        while not self._posted.empty():
            out.append(self._posted.get_nowait())
        return out

    def _messages(self, channel: Channel, raw: list[dict], out: list[E.Event]) -> None:
        for message in raw:
            try:
                parsed = P.parse(message)
            except P.ProtocolError as exc:
                out.append(E.Rejected(channel, str(exc)))
                return  # nothing more is trusted from it
            if isinstance(parsed, P.Reply):
                channel.resolve(parsed)
            elif not isinstance(parsed, P.Heartbeat) or parsed.notice is not None:
                out.append(E.Received(channel, parsed))

    def _run_timers(self) -> None:
        now = time.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
        for action in due:
            action()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for channel in list(self._channels):
            self.forget(channel)
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
