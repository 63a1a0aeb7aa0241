"""The connections a node's checkpoint store has under way (agents/replicas.py): each one
ended at once when the store closes, and the close waits for them.

Calls nothing of the agent's.
"""

from __future__ import annotations

import socket
import threading


class ReplicaError(Exception):
    """A transfer that did not happen (the message says why)."""


class Transfers:
    """The copies a node's store is sending, or its server taking: ended at once when it
    closes (a buddy cut off mid-transfer, its link down, answers nothing and resets
    nothing: the store's thread waited TIMEOUT for it, and the agent's end with it)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._ended = False

    def add(self, conn: socket.socket) -> None:
        with self._changed:
            if self._ended:
                raise ReplicaError("the store is closing")
            self._conns.add(conn)

    def discard(self, conn: socket.socket) -> None:
        with self._changed:
            self._conns.discard(conn)
            self._changed.notify_all()

    def end(self) -> None:
        """Wake every transfer under way (a shut down socket fails its send or receive)."""
        with self._changed:
            self._ended = True
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def wait(self, timeout: float) -> None:
        """Until every transfer is over (each is discarded once it did all it does)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._conns, timeout)
