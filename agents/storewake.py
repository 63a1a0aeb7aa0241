"""What wakes an agent's checkpoint store (agents/checkpoints.py): a call of ``set()``, or a
datagram that a worker's save sends to the socket in the store's memory root."""

from __future__ import annotations

import os
import select
import socket
import threading

SCAN_EVERY = 0.2  # seconds between looks for new saves, where saves cannot wake the store
LOOK_EVERY = 2.0  # and where they can (a look all the same: a datagram may be dropped)


class Wake:
    """What wakes the store's thread: ``set()`` here, or a datagram on the socket at
    ``<memory root>/wake`` that a worker's save sends (so a save is sealed and replicated at
    once, and an idle store looks only every LOOK_EVERY). Without the socket (a path too
    long for an address), a look every SCAN_EVERY."""

    def __init__(self) -> None:
        self._event = threading.Event()
        # set() comes from other threads (a pull's end, a replica kept) at any time, close()
        # too: a write to a closed pipe's number went into whatever file had it next.
        self._lock = threading.Lock()
        self._closed = False
        self._sock: socket.socket | None = None
        self._pipe = os.pipe()  # set() wakes a wait on the socket through it
        for fd in self._pipe:
            os.set_blocking(fd, False)

    def listen(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._sock = sock

    def set(self) -> None:
        self._event.set()
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._pipe[1], b"w")
            except OSError:
                pass

    def wait(self) -> None:
        if self._sock is None or self._closed:  # closed: a store thread that outlived it
            self._event.wait(SCAN_EVERY)
        elif not self._event.is_set():
            try:
                select.select([self._sock.fileno(), self._pipe[0]], [], [], LOOK_EVERY)
            except (OSError, ValueError):  # closed meanwhile
                pass
        self._event.clear()
        with self._lock:
            if not self._closed:
                self._drain_socket()
                self._drain_pipe()

    def _drain_socket(self) -> None:
        try:
            while self._sock is not None and self._sock.recv(64):
                pass
        except OSError:
            pass

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._pipe[0], 64):
                pass
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
            for fd in self._pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
