"""Blanks made ahead, for the saves that would otherwise write new pages (their cost, and
when a rank asks: docs/guides/checkpoints.md, "Pages kept"; F.ask_blank). Stdlib only."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from agents.shims import orchestrator_checkpoint_format as F


class Maker:
    """The blanks ranks asked for, each on a thread of its own (the store's seals and pushes
    wait for none), one a rank at a time, within ``room()`` less those under way."""

    def __init__(self, memory: str, room: Callable[[], int]):
        self.memory, self._room = memory, room
        self._lock = threading.Lock()
        self._making: dict[int, int] = {}  # rank -> bytes
        self._threads: dict[int, threading.Thread] = {}  # rank -> the one making its blank
        self._round = 0  # one more at stop(): those under way go

    def tend(self, ranks: list[int]) -> None:
        """Blanks go while memory is over its bound; those ``ranks`` asked for start."""
        if F.blanks(self.memory):
            drop(self.memory, -self._room())
        for rank in ranks:
            with self._lock:
                size = None if rank in self._making else asked(self.memory, rank)
                if size is None or size > self._room() - sum(self._making.values()):
                    continue  # (what memory holds is looked at only for a request)
                self._making[rank], round_ = size, self._round
                thread = self._threads[rank] = threading.Thread(
                    target=self._make, args=(rank, size, round_), daemon=True)
            thread.start()

    def _make(self, rank: int, size: int, round_: int) -> None:
        try:
            make(self.memory, rank, size, lambda: self._round != round_)
        finally:
            with self._lock:
                self._making.pop(rank, None)
                self._threads.pop(rank, None)

    def stop(self, made: bool = False) -> None:
        """Those under way go (waited for: one finishing beside the store's close left the
        memory behind, a file in it); with ``made``, those made too (the memory is
        released)."""
        with self._lock:
            self._round += 1
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=10.0)  # it looks at its round every 4 MiB
        if made:
            drop(self.memory, F.blank_bytes(self.memory))


def asked(memory: str, rank: int) -> int | None:
    """The bytes ``rank`` asked a blank of (the request goes), or None."""
    path = F.blank_asked(memory, rank)
    size = F.int_file(path)
    try:
        os.unlink(path)
    except OSError:
        pass
    return size if size is not None and size > 0 else None


def make(memory: str, rank: int, size: int, going: Callable[[], bool]) -> bool:
    """A blank of ``size`` bytes for ``rank`` whose pages exist (zeros written: allocated
    pages are cleared at the first write), hidden until whole; none once ``going()``."""
    name = os.urandom(8).hex()
    path = os.path.join(memory, F.BLANK_DIR, F.making_prefix(rank) + name)
    zeros = memoryview(bytes(min(size, 1 << 22)))
    try:
        if not F.blank_dir(memory):
            return False  # the memory is gone
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for offset in range(0, size, len(zeros)):
                if going():
                    raise OSError("stopped")
                os.pwrite(fd, zeros[:size - offset], offset)
        finally:
            os.close(fd)
        if going():
            raise OSError("stopped")
        os.rename(path, os.path.join(memory, F.BLANK_DIR, name))
        return True
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return False


def drop(memory: str, excess: int) -> None:
    """Blanks go, the largest first, until ``excess`` bytes went (or none is left)."""
    for length, path in sorted(F.blanks(memory), reverse=True):
        if excess <= 0:
            return
        try:
            os.unlink(path)
        except OSError:
            continue  # taken meanwhile
        excess -= length
