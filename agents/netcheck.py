"""The pairwise network check's two ends on a node (orchestrator/netcheck.py runs it): a
receiver that takes a fixed number of bytes from each peer that names the check's token, and
a sender that times one such transfer.

The receiver listens on every address, on a port the kernel picks, for ``timeout`` seconds
at most, and takes nothing from a connection before its 32-byte token matches: nobody but
the job's own agents can keep it busy, and no connection can make it read more than
``size`` bytes. A transfer ends with one byte back from the receiver, so that the sender's
clock covers the data's arrival, not only its leaving the send buffer.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time

TOKEN_BYTES = 32
CHUNK = 256 * 1024
DONE = b"k"


class Receiver:
    """Takes ``size`` bytes from each connection that first sends ``token``."""

    def __init__(self, token: bytes, size: int, timeout: float):
        if len(token) != TOKEN_BYTES:
            raise ValueError("bad network check token")
        self.token, self.size = token, size
        self.deadline = time.monotonic() + timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept(self) -> None:
        while not self.closed:
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(min(left, 1.0))
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._take, args=(conn,), daemon=True).start()
        if not self.closed:
            self.close()

    def _take(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(max(0.1, self.deadline - time.monotonic()))
            try:
                if not hmac.compare_digest(_read(conn, TOKEN_BYTES), self.token):
                    return
                left = self.size
                while left > 0:
                    chunk = conn.recv(min(CHUNK, left))
                    if not chunk:
                        return
                    left -= len(chunk)
                conn.sendall(DONE)
            except OSError:
                return


def send(address: str, port: int, token: bytes, size: int, timeout: float) -> float:
    """Seconds to carry ``size`` bytes to a receiver at ``address:port``, from the connect
    to its answer. Raises OSError (``TimeoutError`` past ``timeout``)."""
    block = bytes(min(CHUNK, size))
    started = time.monotonic()
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.settimeout(max(0.1, timeout - (time.monotonic() - started)))
        conn.sendall(token)
        left = size
        while left > 0:
            n = min(len(block), left)
            conn.sendall(block[:n])
            left -= n
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{size - left} of {size} bytes sent in {timeout:g}s")
        if _read(conn, 1) != DONE:
            raise ConnectionError("the receiver ended the transfer early")
    return time.monotonic() - started


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
