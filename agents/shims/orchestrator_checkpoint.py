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

import ctypes
import fcntl
import json
import mmap
import os
import sys
import time

# On a worker's PYTHONPATH the format is a module beside this one; in the package, a sibling.
if __package__:
    from agents.shims import orchestrator_checkpoint_format as F
else:
    import orchestrator_checkpoint_format as F  # type: ignore[no-redef]

CheckpointError = F.CheckpointError


# --- memory slots (the worker's side) -------------------------------------------------------

class _Slot:
    """One reused file of this rank's memory directory, mapped once per process."""

    def __init__(self, path, fd):
        self.path, self.fd = path, fd
        self.map = None
        self.size = 0
        self.registered = False

    def ensure(self, size):
        if self.size >= size and self.map is not None:
            return
        if self.map is not None:
            self._unregister()
            self.map.close()
            self.map, self.size = None, 0  # not one closed, should the growth fail
        if os.fstat(self.fd).st_size < size:  # its pages now: a full /dev/shm is an OSError
            os.posix_fallocate(self.fd, 0, size)  # here, not a SIGBUS in the copy
        self.size = os.fstat(self.fd).st_size
        # Its page tables filled in one call, not a fault a page at the first copy into it
        # (512 MiB into existing pages: 0.10 s so, 0.16 s page by page).
        self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | _POPULATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def register_cuda(self, torch):
        """Pin the mapping for the GPU's copy engine (DMA straight into shared memory)."""
        if self.registered:
            return
        try:
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            if torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0) == 0:
                self.registered = ptr
        except Exception:  # pageable memory still works, only slower
            self.registered = False

    def _unregister(self):
        if self.registered:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = False


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux, Python 3.10 on
_slots = {}  # type: dict[str, _Slot]  # path -> slot, for this process
_saves = [0]  # saves this process made: every persist_every-th is persisted
_skipped = [0]  # copies this process found not good (named on stderr)
_loaded = set()  # type: set[tuple[int, int]]  # (device, inode) of slot files a load mapped


def _rank():
    return F.int_env("RANK", 0)


def _metas(rank_dir, corrupt=False):
    """``{step: meta}`` of this rank's saves in memory (with those found corrupt: all)."""
    out = {}
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return out
    for name in names:
        step = F.parse_step(name, suffix=".meta")
        if step is not None:
            meta = F.read_json(os.path.join(rank_dir, name))
            if meta is not None and (corrupt or not os.path.exists(
                    os.path.join(rank_dir, F.step_name(step) + ".corrupt"))):
                out[step] = meta
    return out


def _take_slot(rank_dir, size, budget, metas):
    """A slot to write, locked exclusively. Never the newest save's, nor one the agent is
    reading (it holds a shared lock); and, while memory allows, not one holding a save still
    to persist, nor one of the steps the agent retains (``retain``: from the newest step that
    every rank's buddy holds, what the ranks would resume if a node were lost). Free slots
    first, then the oldest save's. No more copies than the agent's share gives each rank
    (``F.COPIES_NAME``): past it, the oldest no reader holds become blanks (for the replicas
    of other nodes' ranks, which the node's own copies once crowded out for good)."""
    if 2 * size > budget:
        raise CheckpointError(
            "checkpoint memory for this rank is %d bytes: fewer than two copies of a %d-byte "
            "state (raise checkpoint.memory)" % (budget, size))
    copies = F.int_file(os.path.join(os.path.dirname(rank_dir), F.COPIES_NAME))
    cap = budget if copies is None else min(budget, copies * size)
    newest = max(metas) if metas else None
    step_of = {m.get("slot"): s for s, m in metas.items()}
    names = sorted(n for n in os.listdir(rank_dir) if n.startswith("slot-")
                   and n[5:].isdigit())
    keep = {metas[newest].get("slot")} if newest is not None else set()
    pending = {m.get("slot") for s, m in metas.items() if m.get("persist") and
               not os.path.exists(os.path.join(rank_dir, F.step_name(s) + ".persisted"))}
    retain = F.int_file(os.path.join(os.path.dirname(rank_dir), "retain"))
    retained = {m.get("slot") for s, m in metas.items() if retain is not None and s >= retain}
    candidates = sorted((int(n[5:]) for n in names if int(n[5:]) not in keep),
                        key=lambda k: step_of.get(k, -1))
    sizes = {int(n[5:]): os.stat(os.path.join(rank_dir, n)).st_size for n in names}
    total = sum(sizes.values())
    reusable = [n for n in candidates if n not in pending]
    while total > cap and len(reusable) > 1:  # one left to write into
        number = reusable.pop(0)
        if _let_go(rank_dir, number, step_of.get(number)):
            total -= sizes[number]
            candidates.remove(number)
    taken = _lock_first(rank_dir, [n for n in candidates if n not in pending | retained])
    if taken:
        return taken
    if not candidates or total + size <= cap:
        number = max([int(n[5:]) for n in names], default=-1) + 1
        path = os.path.join(rank_dir, "slot-%d" % number)
        if path not in _slots:  # pages that exist, if any (a file of its own otherwise)
            F.take_blank(os.path.dirname(rank_dir), path, size, _rank())
        slot = _open_slot(path)
        fcntl.flock(slot.fd, fcntl.LOCK_EX)
        return number, slot
    # Memory is full: a retained copy goes first (a node's loss may then cost more steps),
    # and only then does the training wait, for the oldest (saves come faster than the
    # disk or the buddy take them).
    taken = _lock_first(rank_dir, [n for n in candidates if n not in pending])
    if taken:
        _say_once("checkpoint.memory is full: older copies are given up before the buddy "
                  "or the disk has them")
        return taken
    slot = _open_slot(os.path.join(rank_dir, "slot-%d" % candidates[0]))
    fcntl.flock(slot.fd, fcntl.LOCK_EX)
    return candidates[0], slot


def _let_go(rank_dir, number, step):
    """Slot ``number`` (holding ``step``, if any) into the memory's blanks, unless a reader
    holds it (the agent sending it): whether it went."""
    path = os.path.join(rank_dir, "slot-%d" % number)
    slot = _open_slot(path)
    try:
        fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    if step is not None:
        F.drop(rank_dir, step)  # no copy any more: nothing reads it from here on
    del _slots[path]
    if slot.map is not None:
        slot._unregister()
        slot.map.close()
    st = os.fstat(slot.fd)
    os.close(slot.fd)  # its lock with it: the blank is taken under a lock of its own
    if (st.st_dev, st.st_ino) in _loaded:  # a load of this process maps it: written by
        _loaded.discard((st.st_dev, st.st_ino))  # nobody again (a blank's next copy would)
        os.unlink(path)
    else:
        F.give_blank(os.path.dirname(rank_dir), path)
    return True


def _lock_first(rank_dir, numbers):
    for number in numbers:
        slot = _open_slot(os.path.join(rank_dir, "slot-%d" % number))
        try:
            fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        return number, slot
    return None


_said = set()  # type: set[str]


def _say_once(text, key=None):
    if (key or text) not in _said:
        _said.add(key or text)
        _say(text)


def release():
    """Unmap this process's slots (and unpin them from CUDA): a pinned range that outlives
    its mapping breaks later copies into whatever memory takes its place."""
    for slot in _slots.values():
        if slot.map is not None:
            slot._unregister()
            slot.map.close()
            slot.map = None
        os.close(slot.fd)
    _slots.clear()


def _open_slot(path):
    slot = _slots.get(path)
    if slot is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        slot = _slots[path] = _Slot(path, fd)
    return slot


def due(step, every=None):
    """Whether ``save(step, state, every=every)`` saves: ``step`` is a multiple of ``every``
    (every step when None), or the step the controller asked every rank to save (a planned
    interruption: a drain, a preemption notice)."""
    return every is None or step % every == 0 or \
        F.asked(os.environ.get(F.MEMORY_VAR))[0] == step


def save(step, state, every=None):
    """Checkpoint ``state`` as of ``step`` (an int, the same on every rank); with ``every``,
    only where ``due(step, every)``: call it at every step. Returns the seconds the training
    was held (the copy into memory; with no agent, the whole write), 0.0 when not due."""
    if type(step) is not int or not 0 <= step < F.MAX_STEP:
        raise CheckpointError("step must be an integer from 0 to 2**62, not %r" % (step,))
    if every is not None and (type(every) is not int or every < 1):
        raise CheckpointError("every must be a positive integer, not %r" % (every,))
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
    meta = {"format": F.FORMAT, "step": step, "rank": _rank(), "tensors": entries,
            "world_size": F.int_env("WORLD_SIZE", 1), "tree": tree, "size": size,
            "attempt": F.int_env("ORCHESTRATOR_ATTEMPT", 0),
            "saved_at": time.time(), "persist": bool(persist) and _saves[0] % persist == 0}
    memory = os.environ.get(F.MEMORY_VAR)
    if not memory:
        F.save_files(step, meta, views, size)
        return time.perf_counter() - started
    rank_dir = _rank_dir(memory)
    budget = F.int_env(F.BUDGET_VAR, 1 << 62)
    metas = _metas(rank_dir)
    number, slot = _take_slot(rank_dir, size, budget, metas)
    try:
        slot = _unshared(slot, size)
        try:
            slot.ensure(max(size, 1))
        except OSError as exc:  # the node's shared memory is full: the training goes on
            _say_once("no room in %s for a %d-byte save (%s): step %d and later ones it cannot "
                      "hold skipped" % (memory, size, exc.strerror, step), "room")
            return 0.0
        for s, m in _metas(rank_dir, corrupt=True).items():
            if m.get("slot") == number or s == step:
                F.drop(rank_dir, s)  # its bytes are about to go: it is no longer a copy
        _copy_in(torch, slot, views, entries)
        meta["slot"] = number
        meta["block_s"] = round(time.perf_counter() - started, 6)  # shown in status
        F.write_file(os.path.join(rank_dir, F.step_name(step) + ".meta"),
                   json.dumps(meta).encode("utf-8"))
    finally:
        fcntl.flock(slot.fd, fcntl.LOCK_UN)
    if not metas:  # its first save here: the next needs a slot of its own (the newest copy
        # is never written), its pages made ahead by the agent while the rank trains (they
        # were most of that save: 1.6 s of 1.7 s, 512 MiB a rank, docs/benchmarks.md)
        F.ask_blank(memory, _rank(), size)
    F.poke(memory)
    held = time.perf_counter() - started
    F.hold(memory, step)  # where a planned move asked for this step
    return held


def _rank_dir(memory):
    """This rank's directory in the agent's memory, made if need be; never the memory itself
    (the agent makes it, and removes it when it ends: a directory made again would outlive
    it). Raises CheckpointError when the agent's memory is gone."""
    rank_dir = os.path.join(memory, "rank-%d" % _rank())
    try:
        os.mkdir(rank_dir, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise CheckpointError("the agent's checkpoint memory %s is gone" % memory) from None
    return rank_dir


def _copy_in(torch, slot, views, entries):
    if any(v.is_cuda for v in views):
        slot.register_cuda(torch)
    whole = torch.frombuffer(slot.map, dtype=torch.uint8, count=slot.size)
    try:
        cuda = False
        for view, (_, _, offset, nbytes) in zip(views, entries):
            if nbytes:
                cuda = cuda or view.is_cuda
                whole[offset:offset + nbytes].copy_(view, non_blocking=bool(slot.registered))
        if cuda:
            torch.cuda.synchronize()
    finally:
        del whole  # the mapping can be resized only once no tensor views it


# --- load ------------------------------------------------------------------------------------

def _say(text):
    try:
        sys.stderr.write("[orchestrator] checkpoint: %s\n" % text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


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
    _loaded.add((st.st_dev, st.st_ino))
    crcs = F.checksums(memoryview(view), size, chunk) if checked else []
    return torch.frombuffer(view, dtype=torch.uint8), crcs


def _unshared(slot, size):
    """``slot``, or a new file in its place (a blank, where the node has one) where a load of
    this process mapped it (the old one lives on, unnamed, while the loaded tensors do;
    locked until the new one is named)."""
    st = os.fstat(slot.fd)
    if (st.st_dev, st.st_ino) not in _loaded:
        return slot
    _loaded.discard((st.st_dev, st.st_ino))
    new = slot.path + ".new"
    if not F.take_blank(os.path.dirname(os.path.dirname(slot.path)), new, size, _rank()):
        os.close(os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
    fd = os.open(new, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(slot.path + ".new", slot.path)
    if slot.map is not None:
        slot._unregister()
        slot.map.close()
    os.close(slot.fd)
    slot = _slots[slot.path] = _Slot(slot.path, fd)
    return slot


def _memory_copy(torch, step):
    memory = os.environ.get(F.MEMORY_VAR)
    if not memory:
        return None
    rank_dir = os.path.join(memory, "rank-%d" % _rank())
    F.await_pull(rank_dir)  # a copy the agent pulls from another node as the ranks start
    if os.path.exists(os.path.join(rank_dir, F.PULLING_NAME)):  # waited for it long enough
        raise CheckpointError("rank %d: its copy of step %d, pulled from another node, did "
                              "not come in time" % (_rank(), step))
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
        F.ask_blank(memory, _rank(), found[0]["size"])  # for the save that writes it again
        return found
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        _say("the memory copy of step %d (rank %d) is not good: %s; skipped"
             % (step, _rank(), exc))
        _mark_corrupt(base)
        return None


def persisted_copy(torch, root, step, rank=None):
    """``(meta, state)`` of this rank's persisted copy of ``step`` (or ``rank``'s: a DCP load
    into another world size, orchestrator/checkpoint_dcp.py), None when it is not good."""
    rank = _rank() if rank is None else rank
    base = os.path.join(F.persisted_dir(root, step), "rank-%d" % rank)
    meta_bytes = F.read_bytes(base + ".meta")
    man = F.read_json(base + ".manifest")
    if meta_bytes is None or man is None:
        return None
    try:
        return _restore(torch, meta_bytes, man, base + ".data")
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        _say("the persisted copy of step %d (rank %d, %s) is not good: %s; skipped"
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
                                  "was to resume" % (_rank(), step))
        candidates = [s for s in _held_steps(root) if s < step]
    else:
        if not root:
            return None
        candidates = F.persisted_steps(root, _rank())
    while True:
        step = F.agree(torch, candidates)
        if step is None and told is not None:
            # Every rank starting from scratch, said nowhere, lost a job's whole training:
            # the attempt fails instead, and the next one resumes what the nodes hold.
            raise CheckpointError("no good copy of step %d on every rank, and no older step "
                                  "that every rank holds here (rank %d)" % (told, _rank()))
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
            rank_dir = _rank_dir(memory)
            F.write_file(os.path.join(rank_dir, "restored.json"), json.dumps(record).encode())
            F.poke(memory)  # reported now, not at the next look
        except (OSError, CheckpointError):
            pass  # the agent's report is not worth a training


def _held_steps(root):
    """Steps of which this rank has a copy here (memory or persisted), newest first."""
    steps = set(F.persisted_steps(root, _rank())) if root else set()
    memory = os.environ.get(F.MEMORY_VAR)
    if memory:
        steps.update(_metas(os.path.join(memory, "rank-%d" % _rank())))
    return sorted(steps, reverse=True)


__all__ = ["CheckpointError", "due", "load", "save"]
