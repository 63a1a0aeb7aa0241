"""What a node keeps between jobs under ``~/.cache/orchestrator`` (see orchestrator/sync.py):
blobs by content, synced trees built from them (``sync/<tree>/``, each with its manifest
beside it as ``sync/<tree>.manifest.json``, outside the user's files), setup markers
(agents/setup.py), flight recorder dumps. Nodes may share the cache (an NFS home):
every file is written aside and renamed into place, and markers name the machine. What a
live agent uses is leased (agents/leases.py) and never pruned."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any

from agents import leases
from agents.paths import Lock, cache, traces

# Seconds unused before a tree or blob that no lease holds may go (beyond the ``keep`` most
# recent trees): agents of versions before leases only touched what they used.
PRUNE_AFTER = 3600.0
OLD_MANIFEST = ".orchestrator-manifest.json"  # inside trees built before it moved beside them


def prune_traces(keep_seconds: float = 7 * 24 * 3600) -> None:
    root, old = traces(), time.time() - keep_seconds
    for job in os.listdir(root):
        path = os.path.join(root, job)
        try:
            if os.lstat(path).st_mtime < old:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def tree_root(workdir: str) -> str:
    """The synced tree a workdir lies in (or the workdir itself)."""
    base = os.path.join(os.path.expanduser("~/.cache/orchestrator"), "sync") + os.sep
    if workdir.startswith(base):
        return base + workdir[len(base):].split(os.sep, 1)[0]
    return workdir


def blob(sha: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError(f"bad blob name {sha!r}")
    return os.path.join(cache(), "blobs", sha[:2], sha)


def missing_blobs(shas: list[Any]) -> list[str]:
    """Which of these blobs (sha256) this node's cache lacks. All of them are leased first:
    none goes between this answer and the tree's build, however slow the upload."""
    paths = {str(sha): blob(str(sha)) for sha in shas}
    missing = []
    with _prune_lock():
        leases.held().hold(blobs=tuple(paths))
        for sha, path in paths.items():
            try:
                os.utime(path)  # in use again (for pruners of older versions)
            except FileNotFoundError:
                missing.append(sha)
    return missing


def put_chunk(sha: str, offset: int, data: str, last: bool, part_id: Any = 0) -> str | None:
    """One chunk of a blob; the last one checks the whole blob's sha256. Returns what went
    wrong, or None."""
    final = blob(sha)
    # Our own file, unique even across machines sharing this home (NFS).
    part = f"{final}.part-{socket.gethostname()}-{os.getpid()}-{part_id}"
    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
    with open(part, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(base64.b64decode(data))
    if last:
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != sha:
            os.unlink(part)
            return f"blob {sha[:12]} arrived corrupt"
        os.replace(part, final)
    return None


def build_tree(tree: str, files: list[Any], keep: int) -> str:
    """Build tree ``tree`` from cached blobs (once), prune old trees, return its path.
    Shipped files are read-only: a job that edits its copy would change it for every later
    job of the same tree (outputs belong outside it)."""
    if not re.fullmatch(r"[0-9a-f]{24}", tree):
        raise ValueError(f"bad tree name {tree!r}")
    base = sync_dir()
    path = os.path.join(base, tree)
    with _prune_lock():  # leased before it is looked at: no pruner takes it meanwhile
        leases.held().hold(trees=(tree,))
    if not os.path.isdir(path):
        building = tempfile.mkdtemp(prefix=f"{tree}.building-", dir=base)
        try:
            _fill(building, files)
            _write_aside(path + ".manifest.json", json.dumps(files))  # before the tree
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)  # nothing half built stays
            raise
        try:
            os.rename(building, path)
        except OSError:  # another agent sharing this home built it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    os.utime(path)
    prune_trees(base, keep, path)
    return path


def _fill(building: str, files: list[Any]) -> None:
    for rel, sha, executable in files:
        dest = os.path.join(building, rel)
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise ValueError(f"bad path in manifest: {rel!r}")
        os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
        shutil.copyfile(blob(sha), dest)  # a copy: never the cache's own blob
        os.chmod(dest, 0o555 if executable else 0o444)


def _write_aside(path: str, text: str) -> None:
    part = f"{path}.part-{socket.gethostname()}-{os.getpid()}"
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, path)


def sync_dir() -> str:
    base = os.path.join(cache(), "sync")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return base


def _prune_lock() -> Lock:
    return Lock(os.path.join(sync_dir(), ".prune.lock"))


def prune_trees(base: str, keep: int, current: str) -> None:
    """Keep the ``keep`` most recently used trees (and ``current``), every tree and blob a
    live agent leases (its workers' tree, what it is receiving), and, for agents of older
    versions, anything used in the last hour. Blobs that no kept tree uses go too; so do
    half-built trees and partial blobs nobody leases."""
    old = time.time() - PRUNE_AFTER
    with Lock(os.path.join(base, ".prune.lock")):  # one pruner at a time per home
        leased = leases.in_use()
        if leased is not None:
            _prune_locked(base, keep, current, old, *leased)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:  # another agent sharing this home removed it
        return 0.0


def _prune_locked(base: str, keep: int, current: str, old: float, leased_trees: set[str],
                  leased_blobs: set[str]) -> None:
    for name in os.listdir(base):  # half-built trees of agents that died
        if ".building-" in name and name.split(".", 1)[0] not in leased_trees:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    trees = sorted((os.path.join(base, d) for d in os.listdir(base)
                    if re.fullmatch(r"[0-9a-f]{24}", d)), key=_mtime, reverse=True)
    kept = set(trees[:keep]) | {current} | {t for t in trees if _mtime(t) > old} | \
        {os.path.join(base, t) for t in leased_trees}
    for tree in trees:
        if tree not in kept:
            shutil.rmtree(tree, ignore_errors=True)
    for name in os.listdir(base):  # manifests of trees gone (or never built)
        tree = os.path.join(base, name.split(".", 1)[0])
        if ".manifest.json" in name and tree not in kept and \
                (name.endswith(".json") or _mtime(os.path.join(base, name)) < old):
            _unlink(os.path.join(base, name))
    used = set(leased_blobs)
    for tree in kept:
        files = _manifest(tree)
        if files is None:
            if os.path.isdir(tree):
                return  # cannot tell what it uses: keep every blob
            continue
        used.update(sha for _, sha, _ in files)
    blobs = os.path.join(cache(), "blobs")
    for sub in os.listdir(blobs) if os.path.isdir(blobs) else ():
        for name in os.listdir(os.path.join(blobs, sub)):
            path = os.path.join(blobs, sub, name)
            sha = name.split(".", 1)[0]
            if sha in used or _mtime(path) > old:
                continue
            if ".part-" in name or re.fullmatch(r"[0-9a-f]{64}", name):
                _unlink(path)


def _manifest(tree: str) -> list[Any] | None:
    """A tree's files as its manifest lists them (beside it; inside a tree built before)."""
    for path in (tree + ".manifest.json", os.path.join(tree, OLD_MANIFEST)):
        try:
            with open(path) as f:
                return list(json.load(f))
        except (OSError, ValueError, TypeError):
            continue
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
