"""The bytes of the replica protocol (agents/replicas.py): the handshake that proves a peer
knows the job's secret, JSON lines and exact reads within a deadline, every header field
bounded, a manifest checked before it is trusted, and a copy received into a file chunk by
chunk, each chunk checked against the manifest (on a thread, while the next one comes).

Sockets and files only; calls nothing of the agent's but the file helpers.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import secrets
import socket
import time
import zlib
from typing import Any

from agents.fields import Fields, ProtocolError
from agents.paths import remove
from agents.shims import orchestrator_checkpoint_format as F
from agents.transfers import ReplicaError

MAX_MANIFEST = 1 << 20
MAX_HEADER = 4096
CONTEXT = b"orchestrator-replica-1"
BLOCK = 1 << 20  # bytes a read or a send takes at once


def _digest(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), CONTEXT + nonce, hashlib.sha256).digest()


def _recv(conn: socket.socket, n: int, deadline: float | None) -> bytes:
    """Up to ``n`` bytes; by ``deadline`` (monotonic) at the latest, however slowly they come."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplicaError("the peer said too little in time")
        conn.settimeout(left)
    return conn.recv(n)


def _read_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = _recv(conn, min(n - got, BLOCK), deadline)
        if not chunk:
            raise ReplicaError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_line(conn: socket.socket, deadline: float | None = None) -> Fields:
    """The peer's next line, its fields read only through the checked readers."""
    data = b""
    while not data.endswith(b"\n"):
        byte = _recv(conn, 1, deadline)
        if not byte or len(data) > MAX_HEADER:
            raise ReplicaError("no request line")
        data += byte
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # nested past Python's limit: not ours either
        raise ReplicaError("a request line that is not JSON") from None
    if not isinstance(value, dict):
        raise ReplicaError("a request line that is not an object")
    return Fields({**value, "type": "replica"})


def _send_line(conn: socket.socket, value: dict[str, Any]) -> None:
    conn.sendall(json.dumps(value).encode() + b"\n")


def _number(header: Fields, name: str, high: int) -> int:
    try:
        return int(header.integer(name, 0, high))
    except ProtocolError as exc:
        raise ReplicaError(str(exc)) from None


def data_digest(man: dict[str, Any]) -> str:
    """What identifies a copy's data: its size and every chunk's CRC (not its meta, whose
    slot and origin differ from node to node)."""
    text = json.dumps([man["size"], man["chunk"], man["crc"]]).encode()
    return hashlib.sha256(text).hexdigest()[:32]


def _answer(conn: socket.socket) -> bool:
    """The peer's ``{"ok": true}`` (True: with ``"have": true``), or ReplicaError with what
    it said instead."""
    answer = _read_line(conn)
    try:
        if answer.flag("ok", False):
            return bool(answer.flag("have", False))
        error = answer.text("error", 1000, True)
    except ProtocolError as exc:
        error = str(exc)
    raise ReplicaError(str(error))


def _manifest(meta: bytes, manifest: bytes, size: int) -> dict[str, Any]:
    """The manifest a peer sent, if it can vouch for ``size`` bytes with this meta."""
    try:
        man = json.loads(manifest)
    except (ValueError, RecursionError):
        raise ReplicaError("a manifest that is not JSON") from None
    why = F.check_manifest(meta, man)
    if why is None and man["size"] != size:
        why = f"its manifest is of {man['size']} bytes, not {size}"
    if why is not None:
        raise ReplicaError(f"the copy cannot be verified: {why}")
    return man


def _receive_to(conn: socket.socket, path: str, meta: bytes, man: dict[str, Any],
                memory: str | None = None) -> None:
    """``man["size"]`` bytes from the peer into a new file at ``path`` (a blank of
    ``memory``'s, where it has one: its pages exist), verified against the
    manifest as they come: each chunk is received into one of two buffers while the other
    chunk's CRC is taken and it is written (pwrite) on a thread. Not received into a mapping
    of the new file: each of its pages was a page fault in the agent (131,072 for 512 MiB),
    while a drain's copies arrive as the next attempt's ranks load and save (measured, an
    idle machine, 512 MiB over loopback: a push 0.50-0.60 s that way, 0.39-0.51 s this way;
    a pull 0.54-0.60 s, 0.39-0.59 s). Removed if it fails."""
    size, chunk = man["size"], man["chunk"]
    fresh = 0 if memory is not None and F.take_blank(memory, path, size) else \
        os.O_CREAT | os.O_EXCL
    fd = os.open(path, os.O_RDWR | fresh | os.O_CLOEXEC, 0o600)
    try:
        if size:  # the pages now: a full /dev/shm is an error here, not a short write later
            os.posix_fallocate(fd, 0, size)
        buffers = [memoryview(bytearray(min(chunk, size))) for _ in range(2 if size else 0)]
        crcs: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            kept: concurrent.futures.Future[int] | None = None
            for i, at in enumerate(range(0, size, chunk)):
                view = buffers[i % 2][:min(chunk, size - at)]
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:], min(len(view) - got, BLOCK))
                    if not n:
                        raise ReplicaError("the peer closed the connection mid-copy")
                    got += n
                if kept is not None:  # the other buffer's chunk is written: it may be reused
                    crcs.append(kept.result())
                kept = pool.submit(_keep, fd, view, at)
            if kept is not None:
                crcs.append(kept.result())
        why = F.verify(meta, man, range(size), crcs)
        if why is not None:
            raise ReplicaError(f"the copy failed verification: {why}")
    except BaseException:
        remove(path)
        raise
    finally:
        os.close(fd)


def _keep(fd: int, view: memoryview, at: int) -> int:
    """One received chunk into the file at ``at``; its CRC-32."""
    crc = zlib.crc32(view)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at + done)
    return crc


def _handshake_server(conn: socket.socket, secret: str, deadline: float) -> None:
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    nonce = secrets.token_bytes(16)
    conn.sendall(nonce)
    if not hmac.compare_digest(_read_exact(conn, 32, deadline), _digest(secret, nonce)):
        raise ReplicaError("the peer does not know the job's secret")


def _handshake_client(conn: socket.socket, secret: str) -> None:
    conn.sendall(_digest(secret, _read_exact(conn, 16)))
