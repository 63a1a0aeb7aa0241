"""Checkpoint replicas between nodes: each agent keeps copies of its buddy's ranks' newest
saves, so that a node's loss costs no more than the steps since its last save.

Agent to agent over TCP, never through the controller's channel. Every connection is
authenticated first: the server sends a random nonce, the client answers with an HMAC-SHA256
of it under the job's secret (which only the job's agents and controller know). Then one
request, a JSON line:

- ``put`` (the client's agent replicates a save): ``{"op": "put", "rank", "step", "meta",
  "manifest", "size", "data"}`` (``data``: the digest of the data's checksums, optional);
  the server answers ``{"ok": true, "have": true}`` if it holds that very data already (the
  client sends nothing more), else, once it said ``{"ok": true}`` (it has room), that many
  bytes of meta, manifest and data. The server writes them aside (a file of the transfer's
  own: a blank, where the node's memory has one), verifies the data against the manifest as
  it comes, and only then keeps them
  (``<memory>/replicas/rank-<r>/step-<s>.{data,meta,manifest}``: every step from the one
  the controller retains, and the newest; the ``KEEP`` newest until it retains one: the data
  of one that goes is kept as a blank for the next); it answers ``{"ok": true}`` or
  ``{"ok": false, "error"}``.
- ``get`` (a replacement node's agent pulls a copy): ``{"op": "get", "rank", "step"}``,
  answered by ``{"ok": true, "meta", "manifest", "size"}`` and the bytes, which the puller
  verifies before it trusts them: a replica this node keeps, else a sealed save of its own
  ranks in its memory (a drained node's ranks, pulled by the nodes that take their place).
  With ``"describe": true``, no bytes after the manifest (a load into fewer ranks reads the
  descriptions of every rank's copy first, the data of those it needs after:
  agents/borrows.py).

Everything a peer sends is bounded and checked; a peer that fails authentication or sends
anything malformed is dropped with nothing kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from agents.fields import MAX_COUNT, MAX_RANK, Fields, ProtocolError
from agents.holds import hold_save, open_shared
from agents.paths import close_socket, entries, remove, steps_in
from agents.replicawire import (
    BLOCK,
    MAX_MANIFEST,
    _answer,
    _handshake_client,
    _handshake_server,
    _manifest,
    _number,
    _read_exact,
    _read_line,
    _receive_to,
    _send_line,
    data_digest,
)
from agents.shims import orchestrator_checkpoint_format as F
from agents.transfers import ReplicaError, Transfers

KEEP = 4  # replicas kept per rank until the controller says which step to retain
TIMEOUT = 60.0  # seconds a peer may stall a transfer
CONNECT_TIMEOUT = 5.0  # a buddy that does not answer: the next save tries again
HELLO_TIMEOUT = 5.0  # seconds a connection has to prove it knows the secret and ask
GREETING = 32  # connections at once not yet known (beside the transfers)
SEAL_WAIT = 10.0  # seconds a pull of a node's own save waits for the agent to seal it
_T = TypeVar("_T")


class Server:
    """This node's side: takes its buddy's replicas and hands them to a replacement."""

    def __init__(self, root: str, secret: str, room: Callable[[], int],
                 problem: Callable[[str], None], kept: Callable[[], None] = lambda: None):
        self.memory = root  # the node's own saves: served too (see _own)
        self.root = os.path.join(root, "replicas")
        self.kept = kept  # a replica was kept: the node's report of what it holds is news
        self.secret = secret
        self.room = room  # bytes of the node's checkpoint memory still free
        self.problem = problem
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("0.0.0.0", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self._slots = threading.BoundedSemaphore(8)  # transfers at once
        self._greeting = threading.BoundedSemaphore(GREETING)  # connections not yet known
        self._serving = Transfers()  # ended when the store closes
        self._lock = threading.Lock()
        self._closed = False
        self._incoming = 0  # bytes the puts under way may write (_reserve)
        self.retain: int | None = None  # replicas of older steps may go
        self.keep: frozenset[tuple[int, int]] = frozenset()  # (rank, step): never pruned
        self.attempt = 0  # the newest attempt seen: copies of older ones are of another timeline
        threading.Thread(target=self._accept, daemon=True, name="replicas").start()

    def close(self, wait: float = 10.0) -> None:
        """Take nothing more, end the transfers under way, and return once they are over
        (bounded): the store removes its memory next, and a copy that went on writing
        made files again that outlived the agent (CI: a job's memory on /dev/shm)."""
        with self._lock:  # a transfer under way makes nothing from now on (see _put)
            if self._closed:
                return
            self._closed = True
        self._serving.end()
        close_socket(self.listener)  # shut down: a close alone leaves accept() listening
        self._serving.wait(wait)  # one not yet writing finds the store closed (see _put)

    def holdings(self) -> tuple[dict[int, list[int]], int]:
        """``({rank: [steps]}, bytes)`` of the replicas kept here, a step only with its data
        (not under the lock: ``_reserve`` asks the room, which asks this, holding it)."""
        held: dict[int, list[int]] = {}
        used = 0
        for name in entries(self.root):
            rank = F.parse_step(name, prefix="rank-")
            if rank is None:
                continue
            directory = os.path.join(self.root, name)
            for entry in entries(directory):
                step = F.parse_step(entry, suffix=".manifest")
                if step is None:
                    continue
                try:
                    used += os.path.getsize(os.path.join(directory, f"step-{step}.data"))
                except OSError:
                    continue  # going (its manifest goes first) or taken (take()): not held
                held.setdefault(rank, []).append(step)
        return held, used

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if not self._greeting.acquire(blocking=False):
                conn.close()  # too many at once: the peer tries again with its next save
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        held: threading.BoundedSemaphore | None = self._greeting  # the place it takes
        try:
            # Who it is and what it wants, within HELLO_TIMEOUT: anything on the network
            # can connect, and a connection that said nothing held a transfer's place for
            # TIMEOUT (eight of them: no buddy's copy came).
            deadline = time.monotonic() + HELLO_TIMEOUT
            _handshake_server(conn, self.secret, deadline)
            header = _read_line(conn, deadline)
            self._greeting.release()
            held = self._slots if self._slots.acquire(blocking=False) else None
            if held is None:
                raise ReplicaError("too many transfers at once here")
            conn.settimeout(TIMEOUT)
            op = header.text("op", 16)
            if op == "put":
                self._put(conn, header)
            elif op == "get":
                self._get(conn, header)
            else:
                raise ReplicaError(f"unknown op {op!r}")
        except (OSError, ReplicaError, ProtocolError) as exc:
            try:
                _send_line(conn, {"ok": False, "error": str(exc)[:500]})
            except OSError:
                pass
        finally:
            self._serving.discard(conn)
            conn.close()
            if held is not None:
                held.release()

    def _put(self, conn: socket.socket, header: Fields) -> None:
        rank, step = _number(header, "rank", MAX_RANK), _number(header, "step", F.MAX_STEP)
        meta_len = _number(header, "meta", F.MAX_META)
        manifest_len = _number(header, "manifest", MAX_MANIFEST)
        size = _number(header, "size", MAX_COUNT)
        attempt = int(header.integer("attempt", 0, MAX_COUNT, optional=True) or 0)
        if attempt < self.attempt:
            raise ReplicaError(f"a copy of attempt {attempt}, before this node's {self.attempt}")
        self.attempt = max(self.attempt, attempt)  # two puts at once: never back
        data = header.text("data", 64, True)
        if not self._closed and data is not None and data == self._held_data(rank, step):
            # The same bytes: nothing to send, and no room made for them (it evicted).
            _send_line(conn, {"ok": True, "have": True})
            self.kept()
            return
        if not self._reserve(size):
            raise ReplicaError(f"no room for a {size}-byte replica in checkpoint.memory")
        reserved = [size]
        try:
            self._take(conn, header, rank, step, meta_len, manifest_len, reserved, attempt)
        finally:
            with self._lock:
                self._incoming -= reserved[0]

    def _take(self, conn: socket.socket, header: Fields, rank: int, step: int, meta_len: int,
              manifest_len: int, reserved: list[int], attempt: int) -> None:
        """The rest of a put, ``reserved[0]`` bytes reserved for it until its copy counts
        as held (then 0)."""
        size = reserved[0]
        if self._closed:  # said before the bytes come: a refusal with bytes unread is a reset
            raise ReplicaError("this node's checkpoint store is closing")
        _send_line(conn, {"ok": True})  # go on: the sender does not send what is refused
        meta, manifest = _read_exact(conn, meta_len), _read_exact(conn, manifest_len)
        man = _manifest(meta, manifest, size)
        directory = os.path.join(self.root, f"rank-{rank}")
        base = os.path.join(directory, f"step-{step}")
        with self._lock:
            if self._closed:  # the node's memory is being removed: never made again here
                raise ReplicaError("this node's checkpoint store is closing")
            self._serving.add(conn)  # from here it writes: a close ends it, and waits
            try:
                os.mkdir(directory, 0o700)  # not makedirs: a removed store stays removed
            except FileExistsError:
                pass
            for suffix in (".manifest", ".meta"):  # an older copy of this step goes
                remove(base + suffix)
            F.give_blank(self.memory, base + ".data")
        # A name of this transfer's own: two nodes may send the same copy at once (a spare's
        # and the leaving node's), and a file cut short under a mapping is a SIGBUS.
        tmp = f"{base}.data.{secrets.token_hex(8)}.tmp"
        _receive_to(conn, tmp, meta, man, self.memory)
        with self._lock:  # a new attempt's discard of later steps came meanwhile: not kept
            if attempt < self.attempt or self._closed:
                remove(tmp)
                raise ReplicaError(f"a copy of attempt {attempt}, before this node's "
                                   f"{self.attempt}")
            os.replace(tmp, base + ".data")
            F.write_file(base + ".meta", meta)
            F.write_file(base + ".manifest", manifest)
            self._incoming -= size  # held now: counted in the room as the node's
            reserved[0] = 0
        self.prune(directory)
        _send_line(conn, {"ok": True})
        self.kept()

    def _held_data(self, rank: int, step: int) -> str | None:
        """The digest of the data of this node's replica of ``rank`` at ``step`` (None: it
        holds none): a second node sending the same copy (a spare taking a leaving node's
        place sends what that node sent already) is told so and sends nothing."""
        base = os.path.join(self.root, f"rank-{rank}", f"step-{step}")
        with self._lock:
            manifest = F.read_bytes(base + ".manifest", MAX_MANIFEST)
            if manifest is None or not os.path.exists(base + ".data"):
                return None
        try:
            return data_digest(json.loads(manifest))
        except (ValueError, TypeError, KeyError):
            return None

    def discard(self, which: Callable[[int | None, str], bool]) -> None:
        """Replicas that ``which`` names go (by step and the path of their meta: a new
        attempt, or ranks that resumed an older step, left them behind)."""
        for name in entries(self.root):
            rank_dir = os.path.join(self.root, name)
            with self._lock:
                for entry in entries(rank_dir):
                    base = os.path.join(rank_dir, entry[:-9])
                    if which(F.parse_step(entry, suffix=".manifest"), base + ".meta"):
                        self._let_go(base)

    def retain_from(self, step: int, keep: Iterable[tuple[int, int]]) -> None:
        """Replicas older than ``step`` may go, except ``keep``'s (rank, step): the copies an
        attempt's loads into fewer ranks read (agents/borrows.py). The new ranks' first
        copies on their buddies can make the controller retain their step while the loads
        still read older ones, and the prune took them: every rank then failed, none of the
        steps every old rank had was left whole."""
        self.retain, self.keep = step, frozenset(keep)
        self.prune()

    def prune(self, directory: str | None = None) -> None:
        """Replicas older than the retained step go (the newest of a rank always stays,
        unless the rank runs here now and this node holds its own copy of a step from the
        retained one on: a spare that took a node's place kept its last replica of each
        rank it runs for good, outside the memory's share)."""
        for rank_dir in [directory] if directory else [
                os.path.join(self.root, n) for n in entries(self.root)]:
            with self._lock:
                steps = sorted(steps_in(rank_dir, ".manifest"))
                retain = self.retain
                newest = [] if retain is None or self._own_newest(rank_dir) < retain else \
                    steps[-1:]
                old = steps[:-KEEP] if retain is None else \
                    [s for s in steps[:-1] + newest if s < retain]
                rank = F.parse_step(os.path.basename(rank_dir), prefix="rank-")
                for step in [s for s in old if (rank, s) not in self.keep]:
                    self._let_go(os.path.join(rank_dir, f"step-{step}"))

    def _own_newest(self, rank_dir: str) -> int:
        """The newest step of the node's own sealed saves of the rank whose replicas
        ``rank_dir`` holds (-1: none: the rank does not run here)."""
        own = os.path.join(self.memory, os.path.basename(rank_dir))
        return max(steps_in(own, ".manifest"), default=-1)

    def _reserve(self, size: int) -> bool:
        """Room for ``size`` more bytes, kept for one put until it ends (whether there is):
        puts at once each found the room free that the others were about to fill (a spare
        takes every node's copies), and the node's memory went past checkpoint.memory.
        Replicas older than their rank's newest go, the oldest first but the retained step
        last, until they fit (it went for another rank's copy of a step the other ranks had
        not sent yet, and a node's loss then found no step of every rank there). Kept
        from the retained step on, they filled the room while the nodes' pushes met on no
        common step, and from then on no copy came (measured: a job at step 200 whose
        buddies held step 8). Never ``keep``'s: the copies this attempt's loads into fewer
        ranks read (the new ranks' first copies made room by evicting them, and the loads
        found nothing to read). One of the retained step on going is said (once: the step a
        node's loss would resume from may then be in no memory but the disk's)."""
        retained_went = False
        with self._lock:
            fits = size <= self.room() - self._incoming
            if not fits:
                older = sorted((
                    (step, os.path.join(self.root, name, f"step-{step}"))
                    for name in entries(self.root)
                    for step in sorted(steps_in(os.path.join(self.root, name),
                                                ".manifest"))[:-1]
                    if (F.parse_step(name, prefix="rank-"), step) not in self.keep),
                    key=lambda old: (old[0] == self.retain, old))
                evictable = sum(_size(base + ".data") for _, base in older)
                if size > self.room() - self._incoming + evictable:
                    older = []  # none goes for a copy that would not fit all the same
                for step, base in older:
                    self._let_go(base)
                    retained_went = retained_went or (self.retain is not None
                                                      and step == self.retain)
                    fits = size <= self.room() - self._incoming
                    if fits:
                        break
            if fits:
                self._incoming += size
        if retained_went:  # (outside the lock: the problem goes to the outbox)
            self.problem("checkpoint.memory is full: replicas of the retained step went for "
                         "newer copies (a node's loss may resume from an older step; a "
                         "larger checkpoint.memory keeps them)")
        return fits

    def _let_go(self, base: str) -> None:
        """A replica goes; its data's pages stay for the next copy (a blank)."""
        for suffix in (".manifest", ".meta"):
            remove(base + suffix)
        F.give_blank(self.memory, base + ".data")

    def take(self, rank: int, step: int, data_path: str) -> tuple[bytes, bytes] | None:
        """This node's replica of ``rank`` at ``step`` moved to ``data_path``, and its (meta,
        manifest); None if it holds none. For a node that now runs the ranks it held copies
        of: a rename, not a copy (1 GiB took 2.1 s through ``pull``). Verified on receipt,
        and again by the rank's load."""
        def move(base: str) -> None:
            os.rename(base + ".data", data_path)
            for suffix in (".manifest", ".meta"):
                remove(base + suffix)

        found = self._held(rank, step, move)
        return None if found is None else (found[0], found[1])

    def _get(self, conn: socket.socket, header: Fields) -> None:
        rank, step = _number(header, "rank", MAX_RANK), _number(header, "step", F.MAX_STEP)
        self._serving.add(conn)  # a close ends it: the puller is told nothing more
        found = self._replica(rank, step) or self._own(rank, step)
        if found is None:
            raise ReplicaError(f"no replica of step {step} of rank {rank} here")
        meta, manifest, fd, size = found
        try:
            _send_line(conn, {"ok": True, "meta": len(meta), "manifest": len(manifest),
                              "size": size})
            conn.sendall(meta + manifest)
            if header.flag("describe", False):
                return  # its description only (agents/borrows.py)
            with os.fdopen(os.dup(fd), "rb") as data:
                conn.sendfile(data, 0, size)
        finally:
            os.close(fd)  # and with it the shared lock of an own save's slot

    def _replica(self, rank: int, step: int) -> tuple[bytes, bytes, int, int] | None:
        """(meta, manifest, an open fd, size) of this node's replica of ``rank`` at ``step``."""
        found = self._held(rank, step, open_shared)
        if found is None:
            return None
        meta, manifest, fd = found
        return meta, manifest, fd, os.fstat(fd).st_size

    def _held(self, rank: int, step: int,
              act: Callable[[str], _T]) -> tuple[bytes, bytes, _T] | None:
        """(meta, manifest, ``act(base)``) of this node's replica of ``rank`` at ``step``,
        under the lock (a prune or discard waits); None where it holds none, or ``act``
        finds its data gone (OSError)."""
        base = os.path.join(self.root, f"rank-{rank}", f"step-{step}")
        with self._lock:
            meta, manifest = F.read_bytes(base + ".meta"), F.read_bytes(base + ".manifest")
            if meta is None or manifest is None:
                return None
            try:
                return meta, manifest, act(base)
            except OSError:
                return None

    def _own(self, rank: int, step: int) -> tuple[bytes, bytes, int, int] | None:
        """The same of a save of this node's own ranks, in its memory (a drained node's,
        pulled by its replacement: agents/pulls.py), held while it is sent (``hold_save``);
        one not sealed yet is waited for up to SEAL_WAIT seconds (the agent seals it: a CRC
        pass over its bytes)."""
        rank_dir = os.path.join(self.memory, f"rank-{rank}")
        base = os.path.join(rank_dir, F.step_name(step))
        deadline = time.monotonic() + SEAL_WAIT
        while not os.path.exists(base + ".manifest") and time.monotonic() <= deadline:
            if not os.path.exists(base + ".meta") or os.path.exists(base + ".corrupt"):
                return None
            time.sleep(0.02)
        return None if os.path.exists(base + ".corrupt") else hold_save(rank_dir, step)


def _connect(address: str, port: int, transfers: Transfers | None) -> socket.socket:
    """``socket.create_connection``, each socket registered with ``transfers`` before it
    connects: a buddy whose link is down drops the SYN, and the store's close then ends the
    connect at once (Linux: shutdown wakes a connect under way) instead of CONNECT_TIMEOUT
    later."""
    if transfers is None:
        return socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
    error: OSError = OSError(f"no address for {address}")
    for family, kind, proto, _, where in socket.getaddrinfo(address, port,
                                                             type=socket.SOCK_STREAM):
        conn = socket.socket(family, kind, proto)
        try:
            transfers.add(conn)  # ReplicaError once the store closes
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(where)
            return conn
        except BaseException as exc:
            transfers.discard(conn)
            conn.close()
            if not isinstance(exc, OSError):
                raise
            error = exc
    raise error


@contextlib.contextmanager
def _connection(address: str, port: int, secret: str,
                transfers: Transfers | None = None) -> Iterator[socket.socket]:
    conn = _connect(address, port, transfers)
    try:
        conn.settimeout(TIMEOUT)
        _handshake_client(conn, secret)
        yield conn
    finally:
        if transfers is not None:
            transfers.discard(conn)
        conn.close()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def push(address: str, port: int, secret: str, rank: int, step: int, meta: bytes,
         manifest: bytes, view: memoryview, transfers: Transfers | None = None,
         attempt: int = 0) -> None:
    """Replicate one sealed save of ``attempt`` to the buddy at ``address:port``;
    ReplicaError or OSError when it did not take it."""
    with _connection(address, port, secret, transfers) as conn:
        _send_line(conn, {"op": "put", "rank": rank, "step": step, "meta": len(meta),
                          "manifest": len(manifest), "size": len(view), "attempt": attempt,
                          "data": data_digest(json.loads(manifest))})
        if _answer(conn):
            return  # it holds these very bytes already
        conn.sendall(meta + manifest)
        for at in range(0, len(view), BLOCK):
            conn.sendall(view[at:at + BLOCK])
        _answer(conn)


def describe(address: str, port: int, secret: str, rank: int,
             step: int) -> tuple[bytes, bytes, int]:
    """(meta, manifest, size) of the copy of ``rank`` at ``step`` that the server at
    ``address:port`` serves, without its data (checked as ``pull`` checks them)."""
    with _connection(address, port, secret) as conn:
        meta, manifest, size = _header(conn, rank, step, describe=True)
        _manifest(meta, manifest, size)
        return meta, manifest, size


def _header(conn: socket.socket, rank: int, step: int,
            describe: bool = False) -> tuple[bytes, bytes, int]:
    _send_line(conn, {"op": "get", "rank": rank, "step": step, "describe": describe})
    header = _read_line(conn)
    if not _ok(header):
        raise ReplicaError(f"the peer has no replica of step {step} of rank {rank}")
    meta = _read_exact(conn, _number(header, "meta", F.MAX_META))
    manifest = _read_exact(conn, _number(header, "manifest", MAX_MANIFEST))
    return meta, manifest, _number(header, "size", MAX_COUNT)


def pull(address: str, port: int, secret: str, rank: int, step: int,
         data_path: str, memory: str | None = None) -> tuple[bytes, bytes]:
    """Fetch a replica into ``data_path`` (into a blank of ``memory``'s where it has one),
    verified; its (meta, manifest)."""
    with _connection(address, port, secret) as conn:
        meta, manifest, size = _header(conn, rank, step)
        try:
            _receive_to(conn, data_path, meta, _manifest(meta, manifest, size), memory)
        except ReplicaError as exc:
            raise ReplicaError(f"the replica of step {step} of rank {rank} at {address}:"
                               f"{port}: {exc}") from None
    return meta, manifest


def _ok(line: Fields) -> bool:
    try:
        return bool(line.flag("ok", False))
    except ProtocolError:
        return False
