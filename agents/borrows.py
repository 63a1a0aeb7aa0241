"""Other ranks' copies that a DCP load into fewer ranks reads (orchestrator/checkpoint_reshard.py),
borrowed for the load from the nodes that keep them in memory.

A job that goes on with fewer ranks than it saved (``nnodes`` MIN:MAX after a node is lost,
no spare left) reshards: a rank's new shards were saved by other ranks, some of them on other
nodes, some on the lost one (their copies are replicas on its buddy). The controller names
where each rank's copies are (``checkpoint.copies`` of ``start``: orchestrator/checkpoints.py).
As the attempt starts, this node's agent fetches the description of each copy that it keeps
neither in its memory nor as a replica (meta and manifest, no data: a ``get`` that
describes, agents/replicas.py) into ``<memory>/borrowed/attempt-<A>/rank-<r>/``; the ranks'
loads wait for them (``F.PULLING_NAME`` in that directory). A load that needs a copy's data
asks for it (``step-<S>.want``): only the copies a rank's new shards overlap are pulled,
verified as they come, within the node's ``checkpoint.memory``; ``step-<S>.failed`` says why
one was not (the load then reads that rank's persisted copy, or fails naming it).

The data goes once every rank of the node has loaded (``done-<RANK>``; a later load asks
again), all of it at the next attempt, at ``release``, or PULL_WAIT after it began.

May call ``replicas`` and the checkpoint format; the store (agents/checkpoints.py) calls it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agents import commands as C
from agents.paths import entries, remove
from agents.pulls import PULL_WAIT
from agents.replicas import describe, pull
from agents.shims import orchestrator_checkpoint_format as F
from agents.transfers import ReplicaError

BORROWED = F.BORROWED_DIR
DESCRIBE_WAIT = 60.0  # seconds the ranks' loads wait for the descriptions at most
POLL = 0.02  # seconds between looks for a load's asks
AT_ONCE = 8  # descriptions fetched at once

_current: dict[str, int] = {}  # memory root -> the attempt whose borrowing is live
_lock = threading.Lock()


def attempt_dir(root: str, attempt: int) -> str:
    return os.path.join(root, BORROWED, f"attempt-{attempt}")


def begin(root: str, secret: str, copies: tuple[C.Copies, ...], attempt: int,
          local_ranks: int, room: Callable[[], int], problem: Callable[[str], None]) -> None:
    """An attempt starts: what an attempt before borrowed goes; ``copies`` (where the ranks
    not held here are) described here, on a thread, and their data served as asked."""
    with _lock:
        _current[root] = attempt
    for name in entries(os.path.join(root, BORROWED)):
        if name != f"attempt-{attempt}":
            shutil.rmtree(os.path.join(root, BORROWED, name), ignore_errors=True)
    if not copies:
        return
    here = attempt_dir(root, attempt)
    try:
        os.makedirs(here, mode=0o700, exist_ok=True)
        F.write_file(os.path.join(here, F.PULLING_NAME),
                     str(time.time() + DESCRIBE_WAIT).encode())
    except OSError as exc:
        problem(f"checkpoint: cannot borrow other ranks' copies here: {exc}")
        return
    threading.Thread(target=_serve, args=(root, here, secret, copies, attempt, local_ranks,
                                          room, problem), daemon=True, name="borrows").start()


def end(root: str) -> None:
    """Nothing borrowed stays (the node is released)."""
    with _lock:
        _current.pop(root, None)
    shutil.rmtree(os.path.join(root, BORROWED), ignore_errors=True)


def _live(root: str, attempt: int) -> bool:
    with _lock:
        return _current.get(root) == attempt


def _held_here(root: str, rank: int, step: int) -> bool:
    """Whether this node keeps ``rank``'s copy of ``step``: its own save, or a replica."""
    own = os.path.join(root, f"rank-{rank}", F.step_name(step))
    replica = os.path.join(root, "replicas", f"rank-{rank}", F.step_name(step))
    return (os.path.exists(own + ".meta") and not os.path.exists(own + ".corrupt")) or \
        os.path.exists(replica + ".manifest")


Source = tuple[str, int, int]  # (address, port, bytes of data)


def _describe_all(root: str, here: str, secret: str, copies: tuple[C.Copies, ...],
                  problem: Callable[[str], None]) -> dict[tuple[int, int], Source]:
    """(rank, step) -> where its data is, for each copy described here."""
    wanted = {(c.rank, step): c for c in copies for step in c.steps
              if not _held_here(root, c.rank, step)}

    def one(key: tuple[int, int]) -> Source:
        rank, step = key
        copy = wanted[key]
        meta, manifest, size = describe(copy.address, copy.port, secret, rank, step)
        base = os.path.join(here, f"rank-{rank}", F.step_name(step))
        try:  # not makedirs: a memory removed meanwhile (the store closed) is not made again
            os.mkdir(os.path.dirname(base), 0o700)
        except FileExistsError:
            pass
        F.write_file(base + ".manifest", manifest)
        F.write_file(base + ".meta", meta)  # last: a load takes a copy by its meta
        return copy.address, copy.port, size

    sources = {}
    with ThreadPoolExecutor(AT_ONCE, thread_name_prefix="describe") as pool:
        for key, future in [(key, pool.submit(one, key)) for key in sorted(wanted)]:
            try:
                sources[key] = future.result()
            except (OSError, ReplicaError, ValueError) as exc:
                c = wanted[key]
                problem(f"checkpoint: no description of rank {key[0]}'s copy of step "
                        f"{key[1]} from {c.address}:{c.port}: {exc}")
    return sources


def _serve(root: str, here: str, secret: str, copies: tuple[C.Copies, ...], attempt: int,
           local_ranks: int, room: Callable[[], int], problem: Callable[[str], None]) -> None:
    deadline = time.monotonic() + PULL_WAIT
    try:
        sources = _describe_all(root, here, secret, copies, problem)
    finally:  # the loads go on, with what was described
        remove(os.path.join(here, F.PULLING_NAME))
    asked: dict[tuple[int, int], int] = {}  # (rank, step) -> bytes, pulled or pulling
    try:
        while time.monotonic() < deadline and _live(root, attempt):
            names = entries(here)
            done = [n for n in names if n.startswith("done-")]
            if len(done) >= local_ranks and asked:  # every rank loaded: the data goes
                for rank, step in asked:
                    remove(os.path.join(here, f"rank-{rank}", F.step_name(step) + ".data"))
                for name in done:  # a later load asks again, and says again once it is done
                    remove(os.path.join(here, name))
                asked.clear()
            for name in names:
                rank = F.parse_step(name, prefix="rank-")
                for entry in entries(os.path.join(here, name)) if rank is not None else ():
                    step = F.parse_step(entry, suffix=".want")
                    if step is not None and (rank, step) not in asked:
                        _ask(here, secret, root, rank, step, sources.get((rank, step)),
                             room, sum(asked.values()), problem)
                        asked[(rank, step)] = sources.get((rank, step), ("", 0, 0))[2]
            time.sleep(POLL)
    finally:
        if _live(root, attempt):  # else the next attempt's begin removed it
            shutil.rmtree(here, ignore_errors=True)


def _ask(here: str, secret: str, root: str, rank: int, step: int, source: Source | None,
         room: Callable[[], int], borrowed: int, problem: Callable[[str], None]) -> None:
    """A load asked for ``rank``'s data of ``step``: pulled on a thread of its own."""
    base = os.path.join(here, f"rank-{rank}", F.step_name(step))
    remove(base + ".want")
    if source is None:
        _failed(base, f"rank {rank}'s copy of step {step} was not described here", problem)
        return
    if source[2] > room() - borrowed:
        _failed(base, f"no room in checkpoint.memory for rank {rank}'s copy of step {step} "
                      f"({source[2]} bytes)", problem)
        return

    def fetch() -> None:
        try:
            meta, _ = pull(source[0], source[1], secret, rank, step, base + ".part", root)
            if meta != F.read_bytes(base + ".meta"):
                raise ReplicaError("it changed after it was described")
            os.rename(base + ".part", base + ".data")
        except Exception as exc:  # noqa: BLE001 (whatever it was, the load is told)
            remove(base + ".part")
            _failed(base, f"rank {rank}'s copy of step {step} from {source[0]}:{source[1]}: "
                          f"{exc}", problem)

    threading.Thread(target=fetch, daemon=True, name=f"borrow-{rank}").start()


def _failed(base: str, text: str, problem: Callable[[str], None]) -> None:
    problem(f"checkpoint: {text}")
    try:
        F.write_file(base + ".failed", text.encode())
    except OSError:
        pass
