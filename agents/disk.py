"""A node's copies into ``checkpoint.dir`` (local disk, or a shared filesystem that several
nodes read): each one's bytes checked against its manifest as they are written, synced,
the manifest last (a copy without one is no copy); what a directory holds; and the id that
says which nodes read the same one. The checkpoint store (agents/checkpoints.py) calls it
on its thread.

Files only; calls nothing of the agent's but the file helpers.
"""

from __future__ import annotations

import json
import os
import secrets
import zlib
from typing import Any

from agents.holds import hold_save, mapped
from agents.paths import entries, remove
from agents.shims import orchestrator_checkpoint_format as F

STORE_ID = ".orchestrator-store"  # names a checkpoint.dir: nodes that read the same one share it


def persist(root: str, rank: int, step: int, meta_bytes: bytes, manifest: dict[str, Any],
            view: memoryview) -> None:
    """One sealed copy into ``root`` (checkpoint.dir), its bytes checked against ``manifest``
    as they are written, synced, the manifest last."""
    directory = F.persisted_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, f"rank-{rank}")
    for suffix in (".manifest", ".corrupt"):  # an older copy of this step is no copy now
        try:
            os.unlink(base + suffix)
        except OSError:
            pass
    size, chunk = manifest["size"], manifest["chunk"]
    tmp = base + ".data.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            for i, at in enumerate(range(0, size, chunk)):
                # Released however this ends: a view left in a failure's traceback kept the
                # slot's mapping from closing (BufferError, in place of the disk's error).
                with view[at:min(at + chunk, size)] as piece:
                    if zlib.crc32(piece) != manifest["crc"][i]:
                        raise OSError(f"step {step} of rank {rank} changed in memory while "
                                      "being persisted")
                    done = 0
                    while done < len(piece):
                        done += os.write(fd, piece[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, base + ".data")
    except BaseException:
        remove(tmp)  # a full disk: no part of a copy stays in checkpoint.dir for good
        raise
    F.write_file(base + ".meta", meta_bytes, sync=True)
    F.write_file(base + ".manifest", json.dumps(manifest).encode(), sync=True)
    sync_dir(directory)


def persist_sealed(root: str, keep: int, rank: int, rank_dir: str, step: int,
                   tried: set[tuple[int, int]]) -> None:
    """A planned stop's step, sealed before the stop asked for it, persisted into ``root``:
    a move that became a whole-job stop once more nodes were noticed (their notices come a
    heartbeat apart) asks every node again, after its ranks saved the step. Tried once
    (``tried``): a disk that refuses it is said once, as a seal's persist is; one not sealed
    yet the seal persists."""
    base = os.path.join(rank_dir, F.step_name(step))
    if (rank, step) in tried or os.path.exists(base + ".persisted"):
        return
    copy = hold_save(rank_dir, step)
    if copy is None:
        return
    tried.add((rank, step))
    meta, manifest, fd, size = copy
    try:
        with mapped(fd, size) as view:
            persist(root, rank, step, meta, json.loads(manifest), view)
        open(base + ".persisted", "w").close()
        F.trim(root, rank, keep)
    finally:
        os.close(fd)


def remove_copy(root: str, rank: int, step: int) -> None:
    """The persisted copy of ``rank`` at ``step`` in ``root``, gone (the manifest first: a
    copy without one is no copy)."""
    for suffix in (".manifest", ".corrupt", ".meta", ".data"):
        remove(os.path.join(F.persisted_dir(root, step), f"rank-{rank}{suffix}"))


def steps(root: str) -> dict[int, list[int]]:
    """``{rank: [steps]}`` with a sealed copy in ``root``."""
    out: dict[int, list[int]] = {}
    for name in entries(root):
        step = F.parse_step(name)
        if step is None:
            continue
        for entry in entries(os.path.join(root, name)):
            rank = F.parse_step(entry, prefix="rank-", suffix=".manifest")
            if rank is not None:
                out.setdefault(rank, []).append(step)
    return out


def store_id(directory: str) -> str | None:
    """The id of a checkpoint.dir, made by the first node to use it: two nodes that read the
    same id read the same files (a shared filesystem)."""
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, STORE_ID)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            data = F.read_bytes(path, 64)
            return data.decode("ascii", "replace").strip() if data else None
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
        return F.read_bytes(path, 64).decode("ascii").strip()  # type: ignore[union-attr]
    except OSError:
        return None


def sync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
