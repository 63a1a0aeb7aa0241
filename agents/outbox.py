"""The outbox: every message of an agent goes out through here, on one sender thread.

Sequenced messages (protocol.SEQUENCED) are numbered, kept until the controller acknowledges
them and spooled to a file while no controller is attached (or the one attached cannot write:
``spool_while_attached``); output travels in batches of
one rank's lines, behind control messages, within a window of unacknowledged bytes (a
reader stops reading a worker's pipe while the controller is behind: the worker then blocks
on write); past the spool's cap the lines not kept are counted and reported.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any, BinaryIO

from agents import protocol as P
from agents.paths import close_socket

LINES_CAP = 1024 * 1024  # bytes of read-but-unsent worker output; readers wait beyond it
# Output a spool kept in memory holds at most (its disk was full: see _append_spool).
MEMORY_SPOOL_MAX = 64 * 1024 * 1024


class Outbox:
    """Every message of the agent goes out through here, on one sender thread.

    Sequenced messages (protocol.SEQUENCED) get the next ``seq`` when they are sent or
    spooled, and stay in memory until the controller acknowledges them (at most
    ``WINDOW_BYTES`` of output in flight: beyond it output waits, and so do the workers).
    While no controller is attached they are appended to the spool file instead, up to
    ``spool_max_bytes`` for output (control messages are always kept); output past that
    cap is counted, and the count is reported as ``dropped`` messages. A spool whose disk is
    full goes on in memory (MEMORY_SPOOL_MAX of output).

    Control messages go before output that is waiting, except that a rank's ``exited`` is
    only queued once every line that rank printed has been numbered.
    """

    def __init__(self, spool_path: str, spool_max_bytes: int | None):
        self._cond = threading.Condition()
        self._conn: socket.socket | None = None
        self._pending_attach: tuple[socket.socket, int] | None = None
        self._control: collections.deque[dict[str, Any]] = collections.deque()
        # Output read but not yet numbered: per (attempt, rank, stream), oldest first.
        self._lines: collections.OrderedDict[tuple[int, Any, str], list[str]] = \
            collections.OrderedDict()
        self._key_bytes: collections.Counter[tuple[int, Any, str]] = collections.Counter()
        self._line_bytes = 0
        self._lines_since = 0.0
        self._added: collections.Counter[Any] = collections.Counter()  # lines per rank
        self._taken: collections.Counter[Any] = collections.Counter()
        self.seq = 0
        self._unacked: collections.deque[tuple[int, bytes]] = collections.deque()
        self._unacked_bytes = 0
        self._spool_path = spool_path
        self._spool_max = spool_max_bytes
        self._spool: BinaryIO | None = None
        self._spool_bytes = 0  # of output written to the spool since it was last emptied
        self._spool_offset = 0  # replayed up to here
        self._dropped: collections.Counter[tuple[Any, str, int]] = collections.Counter()
        self.detached_since: float | None = time.monotonic()
        self._attached_once = False
        # The attached controller cannot write (its disk is full): spool as while detached,
        # but stay attached (no controller_grace runs) until a controller attaches again.
        self._holding = False
        self.hello: Any = None  # set by the agent: builds the hello message
        self.closed = False
        self.sent_at = 0.0  # monotonic: the last message written to a controller

    # --- producers (any thread) ------------------------------------------------------------
    def put(self, message: dict[str, Any]) -> None:
        with self._cond:
            if message.get("type") == P.EXITED:  # what was lost is said before the exit
                self._control.extend(self._take_dropped(message.get("rank")))
            self._control.append(message)
            self._cond.notify_all()

    def put_live(self, type_: str, lines: list[str]) -> None:
        """Live output (setup's): dropped while detached, and never more than a bounded
        backlog: the producer waits (its process then blocks on write)."""
        with self._cond:
            while len(self._control) > 256 and self._conn is not None and not self.closed:
                self._cond.wait(0.5)
            self._control.append({"type": type_, "attempt": 0, "lines": lines})
            self._cond.notify_all()

    def _take_dropped(self, rank: Any = ...) -> list[dict[str, Any]]:
        """``dropped`` messages for the counted lines of ``rank`` (default: every rank)."""
        out = []
        for key in sorted(self._dropped, key=str):
            r, stream, attempt = key
            if rank is ... or r == rank:
                out.append({"type": P.DROPPED, "attempt": attempt, "rank": r,
                            "stream": stream, "lines": self._dropped.pop(key)})
        return out

    def add_lines(self, attempt: int, rank: Any, stream: str, lines: list[str]) -> None:
        """Queue a worker's lines; blocks while too much output waits (backpressure)."""
        size = sum(map(len, lines)) + len(lines)
        with self._cond:
            while self._line_bytes > LINES_CAP and not self.closed:
                self._cond.wait(0.5)
            if not self._lines:
                self._lines_since = time.monotonic()
            key = (attempt, rank, stream)
            self._lines.setdefault(key, []).extend(lines)
            self._key_bytes[key] += size
            self._line_bytes += size
            self._added[rank] += len(lines)
            self._cond.notify_all()

    def wait_sent(self, rank: Any) -> None:
        """Until every line of ``rank`` queued so far has been numbered (sent or spooled)."""
        with self._cond:
            target = self._added[rank]
            while self._taken[rank] < target and not self.closed:
                self._cond.wait(0.5)

    # --- the controller's side (its connection's reader thread) ----------------------------
    def attach(self, conn: socket.socket, ack: int) -> None:
        with self._cond:
            if self._pending_attach is not None:
                close_socket(self._pending_attach[0])
            self._pending_attach = (conn, ack)
            old = self._conn
            self._cond.notify_all()
        if old is not None and old is not conn:
            try:  # the newer controller wins; this also frees a sender stuck writing to it
                old.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def ack(self, seq: int) -> None:
        with self._cond:
            self._forget(seq)
            self._cond.notify_all()

    def detach(self, conn: socket.socket) -> None:
        """The connection ended (or went silent): spool from now on."""
        with self._cond:
            if self._conn is conn:
                self._conn = None
                self.detached_since = time.monotonic()
                self._cond.notify_all()
        close_socket(conn)

    def current(self) -> socket.socket | None:
        return self._conn

    def attached(self, within: float = 0.0) -> bool:
        """Whether a controller is attached, or was until less than ``within`` seconds ago."""
        since = self.detached_since
        return self._conn is not None or (self._attached_once and since is not None
                                          and time.monotonic() - since < within)

    def spool_while_attached(self, conn: socket.socket) -> None:
        """The controller on ``conn`` cannot write: sequenced messages go to the spool from
        now on, within its cap, until the next attach replays them."""
        with self._cond:
            if self._conn is conn:
                self._holding = True
                self._cond.notify_all()

    def _live(self) -> bool:
        """Whether sequenced messages go to the controller now (else to the spool)."""
        return self._conn is not None and not self._holding

    def _forget(self, seq: int) -> None:
        while self._unacked and self._unacked[0][0] <= seq:
            self._unacked_bytes -= len(self._unacked.popleft()[1])

    # --- the sender thread -----------------------------------------------------------------
    def run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            kind, conn, payload = job
            if kind == "attach":
                self._do_attach(conn, payload)
            elif conn is not None:
                self._write(conn, payload)

    def _next(self) -> tuple[str, Any, Any] | None:
        """The next thing to do: an attach, a control message, or a batch of output."""
        with self._cond:
            while True:
                if self.closed and not self._control:
                    return None
                if self._pending_attach is not None:
                    conn, ack = self._pending_attach
                    self._pending_attach = None
                    return "attach", conn, ack
                if self._control:
                    data = self._number(self._control.popleft())
                    if data is None:
                        continue
                    return "send", self._conn, data
                wait: float | None = None
                if self._lines and (not self._live() or self._unacked_bytes < P.WINDOW_BYTES):
                    age = time.monotonic() - self._lines_since
                    if self._line_bytes >= P.BATCH_BYTES or age >= P.BATCH_DELAY:
                        data = self._take_batch()
                        if data is None:
                            continue
                        return "send", self._conn, data
                    wait = P.BATCH_DELAY - age
                self._cond.wait(wait)

    def _take_batch(self) -> bytes | None:
        key, lines = next(iter(self._lines.items()))
        if self._key_bytes[key] <= P.BATCH_BYTES * 3 // 2:
            batch, rest, size = lines, [], self._key_bytes[key]
        else:
            taken, size = 0, 0
            while taken < len(lines) and size < P.BATCH_BYTES:
                size += len(lines[taken]) + 1
                taken += 1
            batch, rest = lines[:taken], lines[taken:]
        del self._lines[key]
        if rest:
            self._lines[key] = rest  # to the back: ranks take turns
            self._key_bytes[key] -= size
        else:
            del self._key_bytes[key]
        self._line_bytes -= size
        attempt, rank, stream = key
        self._taken[rank] += len(batch)
        self._cond.notify_all()
        if not self._live() and self._spool_bytes + size > self._spool_cap():
            self._dropped[(rank, stream, attempt)] += len(batch)
            return None
        return self._number({"type": P.OUTPUT, "attempt": attempt, "rank": rank,
                             "stream": stream, "lines": batch})

    def _number(self, message: dict[str, Any]) -> bytes | None:
        """Encode a message; number, keep or spool it if it is sequenced. None: nothing to
        write now (spooled, or a live-only message with nobody attached)."""
        if message.get("type") not in P.SEQUENCED:
            return P.encode(message) if self._conn is not None else None
        self.seq += 1
        message["seq"] = self.seq
        data = P.encode(message)
        if self._live() and self._spool is None:
            self._unacked.append((self.seq, data))
            self._unacked_bytes += len(data)
            return data
        self._append_spool(data, message.get("type") == P.OUTPUT)
        return None

    def _spool_cap(self) -> float:
        """Bytes of output the spool may hold (spool_max_bytes; less once in memory)."""
        cap = float("inf") if self._spool_max is None else self._spool_max
        return min(cap, MEMORY_SPOOL_MAX) if isinstance(self._spool, io.BytesIO) else cap

    def _append_spool(self, data: bytes, is_output: bool) -> None:
        """Append one message to the spool. Its file is written through at once: when the
        disk is full (the controller's pause is often the same full disk) the spool moves
        to memory, output within MEMORY_SPOOL_MAX and control messages always, rather than
        the sender thread dying and with it every message of this node."""
        if self._spool is None:
            self._spool = self._open_spool()
            self._spool_offset = 0
        end = self._spool.seek(0, os.SEEK_END)  # a replay reads it from where it got to
        try:
            self._spool.write(data)
            self._spool.flush()
        except OSError:
            self._spool = self._spool_in_memory(self._spool, end)
            self._spool.write(data)
        if is_output:
            self._spool_bytes += len(data)

    @staticmethod
    def _spool_in_memory(spool: BinaryIO, good: int) -> io.BytesIO:
        """What ``spool`` holds up to ``good`` (whole messages: what lies beyond is a write
        that failed halfway), in memory, at the same offsets."""
        kept, fd = bytearray(), spool.fileno()
        while len(kept) < good:
            chunk = os.pread(fd, min(1 << 20, good - len(kept)), len(kept))
            if not chunk:
                break
            kept += chunk
        with contextlib.suppress(OSError):  # closing flushes what the disk refused again
            spool.close()
        memory = io.BytesIO(bytes(kept))
        memory.seek(0, os.SEEK_END)
        return memory

    def _open_spool(self) -> BinaryIO:
        """A file only this thread knows, read back through the same descriptor: it needs no
        name (and keeps what it holds if its directory is removed under the agent)."""
        try:
            return tempfile.TemporaryFile(dir=os.path.dirname(self._spool_path))
        except OSError:  # the directory was removed under the agent (see Agent._keep_listening)
            pass
        try:
            return tempfile.TemporaryFile()  # unnamed, 0600: safe in any temp directory
        except OSError:  # no disk anywhere: memory (see _append_spool)
            return io.BytesIO()

    def _write(self, conn: socket.socket, data: bytes) -> bool:
        try:
            conn.sendall(data)
            self.sent_at = time.monotonic()
            return True
        except OSError:
            self.detach(conn)
            return False

    def _do_attach(self, conn: socket.socket, ack: int) -> None:
        """A controller proved the secret: hello, then everything it has not kept, in order."""
        with self._cond:
            old, self._conn = self._conn, conn
            self._holding, self._attached_once = False, True
            self.detached_since = None
            self._forget(ack)
            replay = list(self._unacked)
            self._control.extendleft(reversed(self._take_dropped()))
            hello = P.encode(self.hello())
        if old is not None and old is not conn:
            close_socket(old)
        if not self._write(conn, hello):
            return
        for _, data in replay:
            if not self._write(conn, data):
                return
        self._replay_spool(conn)

    def _replay_spool(self, conn: socket.socket) -> None:
        while True:
            with self._cond:
                if self._spool is None or self._conn is not conn or self._holding:
                    return
                # A controller that pauses (it cannot write) acknowledges nothing: waiting for
                # its window here held the sender, and the workers' output behind it, for as
                # long as the pause lasted. The rest of the spool waits for the next attach.
                while self._unacked_bytes >= P.WINDOW_BYTES and self._conn is conn and \
                        not self._holding:
                    self._cond.wait(0.5)
                if self._conn is not conn or self._holding:
                    return
                self._spool.flush()
                self._spool.seek(self._spool_offset)
                chunk = self._spool.readlines(256 * 1024)
                if not chunk:  # caught up: live from here on
                    self._spool.close()
                    self._spool = None
                    self._spool_bytes = 0
                    self._cond.notify_all()
                    return
                self._spool.seek(0, os.SEEK_END)
                for data in chunk:
                    self._spool_offset += len(data)
                    seq = json.loads(data).get("seq", 0)
                    self._unacked.append((seq, data))
                    self._unacked_bytes += len(data)
            if not self._write(conn, b"".join(chunk)):
                return

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
