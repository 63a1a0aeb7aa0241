"""Pages made ahead: the blanks a node's checkpoint store writes while its ranks train, for
the saves that would otherwise clear new pages themselves.

A save into a file whose pages exist is a copy; into a new one, most of its time is the
kernel clearing pages (measured on these machines: 512 MiB a rank, 1.6 s of a 1.7 s save
into a new file, 0.08 s into one whose pages exist; docs/benchmarks.md). A rank asks
(``F.ask_blank``: a file among the blanks, under a name no blank has) where it knows a save
will find no such slot: after its first save (the newest copy is never written, so the
second needs a slot of its own) and when a load maps a slot (the save that would write it
writes a new file instead); the store makes the blank in the background, where
checkpoint.memory has room for it, and that save waits for one being made rather than
write new pages beside it. Blanks count as memory held and go where it is short
(agents/checkpoints.py).

Stdlib only; calls nothing of the agent's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from agents.shims import orchestrator_checkpoint_format as F

CHUNK = 1 << 22  # bytes of zeros a write


def asked(memory: str, rank: int, limit: int) -> int | None:
    """The bytes of the blank ``rank`` asked for (the request goes), or None; a request for
    none, or for more than ``limit``, is none."""
    path = F.blank_asked(memory, rank)
    size = F.int_file(path)
    try:
        os.unlink(path)
    except OSError:
        pass
    return size if size is not None and 0 < size <= limit else None


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


def make(memory: str, rank: int, size: int, going: Callable[[], bool]) -> bool:
    """A blank of ``size`` bytes in ``memory`` for ``rank``, whose pages exist (zeros
    written: a file only allocated leaves its pages to be cleared at the first copy into
    it), named as a blank once whole (until then the rank's save waits for it rather than
    write new pages beside it); none when ``going()`` turns true or memory is full. Whether
    it was made."""
    directory = os.path.join(memory, F.BLANK_DIR)
    if not F.blank_dir(memory):
        return False  # the memory is gone (the store closed)
    name = os.urandom(8).hex()
    path = os.path.join(directory, F.making_prefix(rank) + name)  # no taker sees it yet
    zeros = memoryview(bytes(min(size, CHUNK)))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for offset in range(0, size, len(zeros)):
                if going():
                    raise OSError("the store closes")
                os.pwrite(fd, zeros[:size - offset], offset)
        finally:
            os.close(fd)
        os.rename(path, os.path.join(directory, name))
        return True
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return False


class Maker:
    """Blanks the node's ranks asked for, each made on a thread of its own (the store's seals
    and pushes, which protect the training against a node's loss, are not held up: measured,
    two ranks' blanks of 512 MiB delayed a seal by 2.8 s), one a rank at a time, within
    ``room()`` (bytes of checkpoint.memory not held) less those being made."""

    def __init__(self, memory: str, room: Callable[[], int]):
        self.memory, self._room = memory, room
        self._lock = threading.Lock()
        self._making: dict[int, int] = {}  # rank -> bytes of its blank
        self._round = 0  # one more at stop(): the blanks under way go

    def tend(self, ranks: list[int]) -> None:
        """Blanks go while the memory held is over its bound; those ``ranks`` asked for are
        started (a rank whose blank is under way keeps its request for later)."""
        if F.blanks(self.memory):
            drop(self.memory, -self._room())
        for rank in ranks:
            with self._lock:
                if rank in self._making:
                    continue
                size = asked(self.memory, rank, self._room() - sum(self._making.values()))
                if size is None:
                    continue
                self._making[rank] = size
                round_ = self._round
            threading.Thread(target=self._make, args=(rank, size, round_), daemon=True,
                             name="blank").start()

    def _make(self, rank: int, size: int, round_: int) -> None:
        try:
            make(self.memory, rank, size, lambda: self._round != round_)
        finally:
            with self._lock:
                self._making.pop(rank, None)

    def stop(self, made: bool = False) -> None:
        """The blanks under way go (the store closes), and with ``made`` those made too
        (the memory is released)."""
        with self._lock:
            self._round += 1
        if made:
            drop(self.memory, F.blank_bytes(self.memory))
