"""Leases on what an agent uses in the node's cache (``~/.cache/orchestrator``, see
agents/cache.py): the synced tree its setup and workers run in, the blobs it is receiving.

A lease is a small file under ``leases/`` that its agent holds an flock on for as long as it
lives. The kernel drops the lock when the agent dies, however it dies, so a pruner (any
job's agent sharing the cache, also on another machine over an NFS home) tells a live
lease from a dead one without clocks or pids: what a live lease names is never pruned,
however long a setup or an upload takes. Dead leases are removed by the pruner.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import time

from agents.paths import cache

_held: Lease | None = None  # this agent's lease (one agent per process)


class Lease:
    def __init__(self) -> None:
        base = directory()
        name = f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it has its name: a pruner never sees it unlocked, so never as dead.
        hidden = os.path.join(base, "." + name)
        self.fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.path = os.path.join(base, name)
        os.rename(hidden, self.path)
        self.trees: set[str] = set()
        self.blobs: set[str] = set()

    def hold(self, trees: tuple[str, ...] = (), blobs: tuple[str, ...] = ()) -> None:
        """Add to what this agent uses. Call it under the cache's prune lock, before looking
        at what is there, so that no pruner removes it between the look and the lease."""
        self.trees.update(trees)
        self.blobs.update(blobs)
        data = json.dumps({"trees": sorted(self.trees), "blobs": sorted(self.blobs)}).encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


def directory() -> str:
    path = os.path.join(cache(), "leases")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def held() -> Lease:
    """This agent's lease, taken on first use."""
    global _held
    if _held is None:
        _held = Lease()
    return _held


def release() -> None:
    global _held
    if _held is not None:
        _held.release()
        _held = None


def in_use() -> tuple[set[str], set[str]] | None:
    """(trees, blobs) that live leases hold; None when a live lease cannot be read (then
    nothing may be pruned). Removes dead leases. Call it under the prune lock."""
    base = directory()
    trees: set[str] = set()
    blobs: set[str] = set()
    for name in os.listdir(base):
        path = os.path.join(base, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # released meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its agent lives
                record = json.loads(os.pread(fd, 1 << 24, 0) or b"{}")
                trees.update(record.get("trees", ()))
                blobs.update(record.get("blobs", ()))
                continue
            # Dead: its agent died (a hidden one, between its creation and its name).
            if not name.startswith(".") or time.time() - os.fstat(fd).st_mtime > 60:
                os.unlink(path)
        except (OSError, ValueError, AttributeError, TypeError):
            return None  # half written as we read, or not ours: keep everything this time
        finally:
            os.close(fd)
    return trees, blobs
