"""Copies of ranks that now run on this node (it took a lost or drained node's place), into
its memory as if saved here, as its attempt starts.

The controller names them (``checkpoint.pulls`` of ``start``: orchestrator/checkpoints.py).
One this node keeps as a replica is taken at once (a rename). One from another node (a
buddy's replica, or a drained node's own save) is pulled on a thread of its own while the
workers start; the rank's ``load()`` waits for it (``F.PULLING_NAME`` in the rank's
directory; measured: a drain's replacement waited 1.4 s for its copies before its workers
could start, which then took 1.8 s to start, join and allocate). A pull that fails is said
in the agent's log, and its rank's load says so (``F.PULL_FAILED_NAME``) instead of every
rank agreeing on nothing and starting from scratch.

May call ``replicas`` and the checkpoint format; the store (agents/checkpoints.py) calls it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Callable

from agents import commands as C
from agents.paths import entries, remove
from agents.replicas import Server
from agents.replicas import pull as pull_replica
from agents.shims import orchestrator_checkpoint_format as F

PULL_WAIT = 600.0  # seconds a rank's load waits for its copy pulled from another node at most

# A rank's directory -> the pull of the attempt now starting there, and the slots pulls into
# it write (one of an attempt before may still be under way: a buddy cut mid-copy holds it
# up to the transfer's timeout).
_current: dict[str, object] = {}
_writing: dict[str, set[int]] = {}
_lock = threading.Lock()


def install(root: str, secret: str, replicas: Server | None, pulls: tuple[C.Pull, ...],
            problem: Callable[[str], None], done: Callable[[], None]) -> None:
    """Installs ``pulls`` into the memory at ``root``: what is held here at once, the rest
    on threads (``done`` is called after each: what the node holds is news)."""
    with _lock:  # a pull of an attempt before, still under way, is nobody's any more
        for rank_dir in [d for d in _current if os.path.dirname(d) == root]:
            del _current[rank_dir]
    for name in entries(root):  # an attempt before's: its load waits for this one's only
        if F.parse_step(name, prefix="rank-") is not None:
            remove(os.path.join(root, name, F.PULL_FAILED_NAME))
            remove(os.path.join(root, name, F.PULLING_NAME))
    for pull in pulls:
        token = object()
        with _lock:
            _current[os.path.join(root, f"rank-{pull.rank}")] = token
        try:
            if _install(root, secret, replicas, pull, fetch=False, token=token):
                continue
            F.write_file(os.path.join(root, f"rank-{pull.rank}", F.PULLING_NAME),
                         str(time.time() + PULL_WAIT).encode())
        except (OSError, ValueError) as exc:
            _failed(root, pull, exc, problem)
            continue
        threading.Thread(target=_fetch, args=(root, secret, replicas, pull, problem, done,
                                              token), daemon=True,
                         name=f"pull-{pull.rank}").start()


def _fetch(root: str, secret: str, replicas: Server | None, pull: C.Pull,
           problem: Callable[[str], None], done: Callable[[], None],
           token: object | None = None) -> None:
    """A pull on its thread. One an attempt after it took over (its rank's directory now
    another pull's) says nothing to the rank's load: its failure, and the end of its wait,
    broke the next attempt's load while that one's own pull was still coming."""
    rank_dir = os.path.join(root, f"rank-{pull.rank}")
    try:
        _install(root, secret, replicas, pull, fetch=True, token=token)
    except Exception as exc:  # noqa: BLE001 (whatever it was, the rank's load is told)
        if _current.get(rank_dir) is token:
            _failed(root, pull, exc, problem)
    finally:  # after the failure is written: the load reads it once this is gone
        if _current.get(rank_dir) is token:
            remove(os.path.join(rank_dir, F.PULLING_NAME))
        done()


def _failed(root: str, pull: C.Pull, exc: Exception, problem: Callable[[str], None]) -> None:
    text = (f"checkpoint: no copy of step {pull.step} of rank {pull.rank} from "
            f"{pull.address}:{pull.port}: {exc}")
    problem(text)
    try:
        F.write_file(os.path.join(root, f"rank-{pull.rank}", F.PULL_FAILED_NAME),
                     json.dumps({"step": pull.step, "error": text}).encode())
    except OSError:
        pass


def _install(root: str, secret: str, replicas: Server | None, pull: C.Pull,
             fetch: bool, token: object | None = None) -> bool:
    """One rank's copy into a new slot of its directory: from this node's own replicas (a
    rename) or, with ``fetch``, pulled from the node that holds it, marked as pulled (its
    load says "buddy"); not where a later attempt's pull (``token`` no longer the rank's)
    took over meanwhile. False: not held here, and not ``fetch``."""
    rank_dir = os.path.join(root, f"rank-{pull.rank}")
    os.makedirs(rank_dir, mode=0o700, exist_ok=True)
    with _lock:  # not a slot another pull into this directory is still writing
        numbers = [F.parse_step(n, prefix="slot-") for n in entries(rank_dir)]
        taken = _writing.setdefault(rank_dir, set())
        slot = max([n for n in numbers if n is not None] + list(taken), default=-1) + 1
        taken.add(slot)
    path = os.path.join(rank_dir, f"slot-{slot}")
    try:
        own = replicas.take(pull.rank, pull.step, path) if replicas else None
        if own is None and not fetch:
            return False
        meta_bytes, manifest = own or pull_replica(
            pull.address, pull.port, secret, pull.rank, pull.step, path, root)
        with _lock:
            if _current.get(rank_dir) is not token:  # an attempt after it began meanwhile
                remove(path)
                return True
            return _installed(rank_dir, pull, slot, meta_bytes, manifest)
    finally:
        with _lock:
            taken.discard(slot)
            if not taken:
                _writing.pop(rank_dir, None)


def _installed(rank_dir: str, pull: C.Pull, slot: int, meta_bytes: bytes,
               manifest: bytes) -> bool:
    """The copy now in ``slot``, described as a save of this node's (True)."""
    meta = json.loads(meta_bytes)
    meta.update(slot=slot, persist=False, pulled=True)
    meta_bytes = json.dumps(meta).encode()
    man = json.loads(manifest)
    man["meta"] = zlib.crc32(meta_bytes)  # the data's checksums stay the sender's
    base = os.path.join(rank_dir, F.step_name(pull.step))
    F.write_file(base + ".meta", meta_bytes)
    F.write_file(base + ".manifest", json.dumps(man).encode())
    return True
