"""Copies held while they are read (sent to a buddy, pulled by a replacement): a node's own
sealed save and a replica's data, each under a shared lock of its file until the returned
descriptor is closed, so that no save and no blank writes over it meanwhile (a save takes an
exclusive lock, or another slot; F.give_blank leaves a locked file alone).

Files only; calls nothing of the agent's.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os

from agents.shims import orchestrator_checkpoint_format as F


def open_shared(base: str) -> int:
    """The replica's data, open and under a shared lock while it is sent: never made a blank
    and written over meanwhile (F.give_blank)."""
    fd = os.open(base + ".data", os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def hold_save(rank_dir: str, step: int) -> tuple[bytes, bytes, int, int] | None:
    """(meta, manifest, an fd of its slot, size) of a node's own sealed save of ``step`` in
    ``rank_dir``, its slot under a shared lock until the fd is closed: no save writes over
    it meanwhile (a save takes an exclusive one, or another slot). None: not sealed, or its
    slot written again before it was held."""
    base = os.path.join(rank_dir, F.step_name(step))
    meta, manifest = F.read_bytes(base + ".meta"), F.read_bytes(base + ".manifest")
    if meta is None or manifest is None:
        return None
    try:
        described = json.loads(meta)
        size, slot = described["size"], int(described["slot"])
        fd = os.open(os.path.join(rank_dir, f"slot-{slot}"), os.O_RDONLY | os.O_CLOEXEC)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if F.read_bytes(base + ".meta") == meta and type(size) is int \
                and 0 <= size <= os.fstat(fd).st_size:
            return meta, manifest, fd, size
    except OSError:
        pass
    os.close(fd)  # its slot written again meanwhile
    return None


class mapped:
    """A read-only view of the first ``size`` bytes of ``fd`` (nothing to map for 0)."""

    def __init__(self, fd: int, size: int):
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self.map if self.map is not None else b"")

    def __enter__(self) -> memoryview:
        return self.view

    def __exit__(self, *exc: object) -> None:
        self.view.release()  # a mapping with a view on it cannot be closed
        if self.map is not None:
            self.map.close()
