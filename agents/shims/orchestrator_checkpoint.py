"""``save(step, state)`` and ``load()``: a worker's checkpoint, kept first in memory its node's
agent owns (it outlives the worker), persisted by that agent in the background, and verified
before it is trusted. The one implementation: ``orchestrator.checkpoint`` is this module, and
the agent puts this file on every worker's PYTHONPATH as ``orchestrator_checkpoint`` for nodes
where the orchestrator is not installed.

    import orchestrator_checkpoint as ckpt          # or: from orchestrator import checkpoint
    restored = ckpt.load()                          # (step, state), or None: start fresh
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})

Where a copy lives (docs/guides/checkpoints.md):

- **Memory**: ``$ORCHESTRATOR_CHECKPOINT_MEMORY/rank-<RANK>/``, a directory on the node's
  ``/dev/shm`` that the agent made and removes. A save takes a *slot* (a file this rank
  reuses, so its pages are already there; a new one takes a blank of the node's where there
  is one), copies the tensors' bytes into it and writes the save's description
  (``step-<S>.meta``, renamed into place last): all the training waits for. The newest
  save's slot is never written (one whole copy always exists); slots are bounded by
  ``$ORCHESTRATOR_CHECKPOINT_MEMORY_BYTES``; with no room left, a save is skipped.
- The agent then **seals** each save (``step-<S>.manifest``: a CRC-32 per chunk of the data
  and one of the meta) and **persists** every ``persist_every``-th one to
  ``$ORCHESTRATOR_CHECKPOINT_DIR/step-<S>/rank-<RANK>.{data,meta,manifest}``.
- ``load()`` restores ``$ORCHESTRATOR_CHECKPOINT_STEP``, the step every rank has a good copy
  of, from the nearest that verifies: memory (mapped; one pulled from another node waited
  for), then persisted. A copy that does not verify is named on stderr, marked, skipped.

Without an agent (plain ``torchrun``), ``save`` writes the same files to ``$ORCHESTRATOR_
CHECKPOINT_DIR`` itself (synced before it returns), and ``load`` takes the newest step of which
this rank has a good copy (the newest every rank has, with ``torch.distributed`` initialized).

The state is a tree of dicts (any keys of int, str, float, bool or None, and tuples of them),
lists, tuples, tensors and small values (int, float, str, bool, None). It is stored as data:
no pickle, so loading a copy runs no code. Torch is imported at a save or a load, not before.
"""

import fcntl
import json
import mmap
import os
import time

# On a worker's PYTHONPATH the format is a module beside this one; in the package, a sibling.
if __package__:
    from agents.shims import orchestrator_checkpoint_format as F
    from agents.shims import orchestrator_checkpoint_slots as M
    from agents.shims.orchestrator_checkpoint_inflight import InFlight
else:
    import orchestrator_checkpoint_format as F  # type: ignore[no-redef]
    import orchestrator_checkpoint_slots as M  # type: ignore[no-redef]
    from orchestrator_checkpoint_inflight import InFlight  # type: ignore[no-redef]

CheckpointError = F.CheckpointError
_in_flight = InFlight()  # a save(..., wait=False) still copying
_saves = [0]  # saves this process made: every persist_every-th is persisted
_skipped = [0]  # copies this process found not good (named on stderr)


def due(step, every=None):
    """Whether ``save(step, state, every=every)`` saves: ``step`` is a multiple of ``every``
    (every step when None), or the step the controller asked every rank to save (a planned
    interruption: a drain, a preemption notice)."""
    return every is None or step % every == 0 or \
        F.asked(os.environ.get(F.MEMORY_VAR))[0] == step


def save(step, state, every=None, wait=True):
    """Checkpoint ``state`` as of ``step`` (an int, the same on every rank); with ``every``,
    only where ``due(step, every)``: call it at every step. Returns the seconds the training
    was held (the copy into memory; with no agent, the whole write), 0.0 when not due.

    With ``wait=False`` the copy goes on beside the training (orchestrator_checkpoint_
    inflight.py) and this returns once it is set up: nothing may write to the state's
    tensors until ``wait()`` returns (call it before the optimizer's step); the next save
    and a load wait for it too."""
    if type(step) is not int or not 0 <= step < F.MAX_STEP:
        raise CheckpointError("step must be an integer from 0 to 2**62, not %r" % (step,))
    if every is not None and (type(every) is not int or every < 1):
        raise CheckpointError("every must be a positive integer, not %r" % (every,))
    _in_flight.wait()  # one save at a time, in order
    F.report_step(step)  # where the ranks are: a planned move agrees on a step ahead
    if not due(step, every):
        return 0.0
    started = time.perf_counter()
    tree, tensors = F.flatten(state)
    import torch
    views = [F.byte_view(torch, t) for t in tensors]
    entries, size = F.layout(tensors)
    _saves[0] += 1
    persist = F.int_env(F.PERSIST_VAR, 0)
    meta = {"format": F.FORMAT, "step": step, "rank": M.rank(), "tensors": entries,
            "world_size": F.int_env("WORLD_SIZE", 1), "tree": tree, "size": size,
            "attempt": F.int_env("ORCHESTRATOR_ATTEMPT", 0),
            "saved_at": time.time(), "persist": bool(persist) and _saves[0] % persist == 0}
    memory = os.environ.get(F.MEMORY_VAR)
    stream = None if wait else M.side_stream(torch, views)
    if wait or stream is False:  # asked to, or tensors on several GPUs: copied right here
        if not memory:
            F.save_files(step, meta, views, size)
            return time.perf_counter() - started
        if not M.to_memory(torch, memory, step, meta, views, entries, size,
                          lambda: time.perf_counter() - started):
            return 0.0
        held = time.perf_counter() - started
        F.hold(memory, step)  # where a planned move asked for this step
        return held
    if not memory:
        work = lambda: F.save_files(step, meta, views, size)  # noqa: E731
    else:
        def work():
            M.to_memory(torch, memory, step, meta, views, entries, size, _in_flight.held, stream)
    _in_flight.start(work, time.perf_counter() - started,
                     (lambda: F.hold(memory, step)) if memory else None)
    return time.perf_counter() - started


def wait():
    """Wait for the copy of a ``save(..., wait=False)`` to be done; returns the seconds
    waited (0.0: none in flight, or done already). Raises what that save would have."""
    return _in_flight.wait()


def release():
    """Unmap this process's slots (and unpin them from CUDA), once a save still copying is
    done: a pinned range that outlives its mapping breaks later copies into whatever memory
    takes its place."""
    try:
        _in_flight.wait()
    finally:
        M.release()


# --- load ------------------------------------------------------------------------------------

def _restore(torch, meta_bytes, man, path, memory=False):
    """The state a copy holds, verified against its manifest (None: an unsealed memory copy,
    taken as it is); raises CheckpointError naming why it is not good. A memory copy is
    mapped, not read (see _map)."""
    meta = json.loads(meta_bytes.decode("utf-8"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError("its data is missing (%s)" % (exc.strerror,)) from None
    try:
        if memory:
            fcntl.flock(fd, fcntl.LOCK_SH)  # no save of this process is writing it now
        length = os.fstat(fd).st_size
        size = meta.get("size") if man is None else man.get("size")
        if type(size) is not int or size > length:
            raise CheckpointError("it is %s bytes, its manifest says %s" % (length, size))
        if man is not None:
            why = F.check_manifest(meta_bytes, man)
            if why is not None:
                raise CheckpointError(why)
        chunk = man["chunk"] if man else F.CHUNK
        whole, crcs = (_map if memory else F.read)(torch, fd, size, chunk, man is not None)
        why = None if man is None else F.verify(meta_bytes, man, range(size), crcs)
        if why is not None:
            raise CheckpointError(why)
    finally:
        os.close(fd)
    tensors = []
    for dtype, shape, offset, nbytes in meta["tensors"]:
        kind = getattr(torch, dtype)
        if nbytes:
            t = whole[offset:offset + nbytes].view(kind).reshape(shape)
            if nbytes <= F.OWN_BELOW:
                # Small tensors get storage of their own: torch.set_rng_state crashes on a
                # view into a larger buffer, and a small one would keep the whole copy alive.
                t = t.clone()
        else:
            t = torch.empty(shape, dtype=kind)
        tensors.append(t)
    return meta, F.unflatten(meta["tree"], tensors)


def _map(torch, fd, size, chunk, checked):
    """The file's first ``size`` bytes as a uint8 tensor over a private mapping of it (with
    ``checked``, and the CRC-32 of each chunk): no copy, no fresh pages to clear (0.9 s of a
    1.2 s read of 512 MB, two ranks on two cores). A later save of this process into that
    slot writes a new file (_unshared): nothing changes under the loaded tensors."""
    if not size:
        return torch.empty(0, dtype=torch.uint8), []
    # Mapped through a new open file: the mapping keeps what it maps open, and the shared
    # lock of ``fd`` must end with the load (a save would wait for it for ever).
    own = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY | os.O_CLOEXEC)
    try:
        view = mmap.mmap(own, size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(own)
    st = os.fstat(fd)
    M.loaded.add((st.st_dev, st.st_ino))
    crcs = F.checksums(memoryview(view), size, chunk) if checked else []
    return torch.frombuffer(view, dtype=torch.uint8), crcs


def _memory_copy(torch, step):
    memory = os.environ.get(F.MEMORY_VAR)
    if not memory:
        return None
    rank_dir = os.path.join(memory, "rank-%d" % M.rank())
    F.await_pull(rank_dir)  # a copy the agent pulls from another node as the ranks start
    if os.path.exists(os.path.join(rank_dir, F.PULLING_NAME)):  # waited for it long enough
        raise CheckpointError("rank %d: its copy of step %d, pulled from another node, did "
                              "not come in time" % (M.rank(), step))
    base = os.path.join(rank_dir, F.step_name(step))
    meta_bytes = F.read_bytes(base + ".meta")
    if meta_bytes is None or os.path.exists(base + ".corrupt"):
        F.pull_failed(rank_dir, step)  # raises: the next attempt agrees on what is left
        return None
    # Not sealed yet (the agent has not read it): nothing is known wrong with it.
    man = F.read_json(base + ".manifest")
    try:
        slot = json.loads(meta_bytes.decode("utf-8"))["slot"]
        found = _restore(torch, meta_bytes, man, os.path.join(rank_dir, "slot-%d" % slot),
                         memory=True)
        F.ask_blank(memory, M.rank(), found[0]["size"])  # for the save that writes it again
        return found
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        M.say("the memory copy of step %d (rank %d) is not good: %s; skipped"
             % (step, M.rank(), exc))
        _mark_corrupt(base)
        return None


def persisted_copy(torch, root, step, rank=None):
    """``(meta, state)`` of this rank's persisted copy of ``step`` (or ``rank``'s: a DCP load
    into another world size, orchestrator/checkpoint_dcp.py), None when it is not good."""
    rank = M.rank() if rank is None else rank
    base = os.path.join(F.persisted_dir(root, step), "rank-%d" % rank)
    meta_bytes = F.read_bytes(base + ".meta")
    man = F.read_json(base + ".manifest")
    if meta_bytes is None or man is None:
        return None
    try:
        return _restore(torch, meta_bytes, man, base + ".data")
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        M.say("the persisted copy of step %d (rank %d, %s) is not good: %s; skipped"
             % (step, rank, base, exc))
        _mark_corrupt(base)
        return None


def copy_at(torch, base, data_path, sealed):
    """Another rank's copy in memory as load() maps and verifies its own (checkpoint_reshard)."""
    meta_bytes, man = F.read_bytes(base + ".meta"), F.read_json(base + ".manifest")
    if meta_bytes is None or os.path.exists(base + ".corrupt") or (sealed and man is None):
        raise CheckpointError("it is gone")
    return _restore(torch, meta_bytes, man, data_path, memory=True)


def _mark_corrupt(base):
    _skipped[0] += 1
    try:
        os.replace(base + ".manifest", base + ".corrupt")
    except OSError:
        pass


def load():
    """``(step, state)`` of the checkpoint to resume, or None to start fresh. Tensors come
    back on the CPU.

    Under the orchestrator: the step the controller found every rank holding
    (``$ORCHESTRATOR_CHECKPOINT_STEP``), from this node's memory, else its persisted copy.
    Where it found none (a job's first attempt: its nodes hold nothing yet) and without it
    (plain torchrun), the newest step persisted in ``$ORCHESTRATOR_CHECKPOINT_DIR``. Either way, a
    copy that fails its checksums is named on stderr and skipped; when ``torch.distributed``
    is initialized, the ranks then agree on the newest older step they all have (where
    there is none, every rank raises CheckpointError rather than all starting from
    scratch). Without it, a rank that has no good copy of the agreed step raises
    CheckpointError (the attempt fails, and the next one is agreed on the copies that are
    left); as does a copy pulled from another node that did not come in time."""
    _in_flight.wait()  # a save of this process still copying: its files first
    import torch
    started = time.perf_counter()
    root = os.environ.get(F.DIR_VAR)
    text = os.environ.get(F.STEP_VAR)
    told = None
    if os.environ.get(F.MEMORY_VAR) and text:
        step = told = int(text)
        found = _copy(torch, root, step)
        if F.everyone(torch, found is not None):
            return _restored(step, found, started)
        if not F.distributed(torch):
            raise CheckpointError("rank %d has no good copy of step %d, the step every rank "
                                  "was to resume" % (M.rank(), step))
        candidates = [s for s in _held_steps(root) if s < step]
    else:
        if not root:
            return None
        candidates = F.persisted_steps(root, M.rank())
    while True:
        step = F.agree(torch, candidates)
        if step is None and told is not None:
            # Every rank starting from scratch, said nowhere, lost a job's whole training:
            # the attempt fails instead, and the next one resumes what the nodes hold.
            raise CheckpointError("no good copy of step %d on every rank, and no older step "
                                  "that every rank holds here (rank %d)" % (told, M.rank()))
        if step is None:
            return None
        found = _copy(torch, root, step)
        if F.everyone(torch, found is not None):
            return _restored(step, found, started)
        candidates = [s for s in candidates if s < step]


def _copy(torch, root, step):
    """``(meta, state, where)`` of the nearest good copy of ``step``: this node's memory (a
    copy pulled from a buddy says so), else the persisted one; None when neither is good."""
    found = _memory_copy(torch, step)
    if found is not None:
        return found + ("buddy" if found[0].get("pulled") else "memory",)
    found = persisted_copy(torch, root, step) if root else None
    return found + ("persisted",) if found is not None else None


def _restored(step, found, started):
    """``(step, state)``, once the rank's agent is told which copy it was (note_restored)."""
    note_restored(step, found[2], started)
    return step, found[1]


def note_restored(step, source, started):
    """Tell the rank's agent which copy of ``step`` this rank loaded and how long it took
    (``restored.json`` in the rank's memory directory: status shows it)."""
    memory = os.environ.get(F.MEMORY_VAR)
    if memory:
        record = {"attempt": F.int_env("ORCHESTRATOR_ATTEMPT", 0), "step": step,
                  "source": source, "seconds": round(time.perf_counter() - started, 3),
                  "skipped": _skipped[0]}
        try:
            rank_dir = M.rank_dir_of(memory)
            F.write_file(os.path.join(rank_dir, "restored.json"), json.dumps(record).encode())
            F.poke(memory)  # reported now, not at the next look
        except (OSError, CheckpointError):
            pass  # the agent's report is not worth a training


def _held_steps(root):
    """Steps of which this rank has a copy here (memory or persisted), newest first."""
    steps = set(F.persisted_steps(root, M.rank())) if root else set()
    memory = os.environ.get(F.MEMORY_VAR)
    if memory:
        steps.update(M.metas_of(os.path.join(memory, "rank-%d" % M.rank())))
    return sorted(steps, reverse=True)


__all__ = ["CheckpointError", "due", "load", "save", "wait"]
