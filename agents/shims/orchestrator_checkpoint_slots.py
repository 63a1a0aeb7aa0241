"""The worker's side of a checkpoint in memory: this rank's *slots* (files of its directory
in the agent's memory that it reuses, so that their pages are already there), which one a
save writes (never the newest save's, nor one the agent reads, within the agent's share),
and the copy of the state into it followed by the save's description (``step-<S>.meta``,
renamed into place last). Part of ``orchestrator_checkpoint`` on workers' PYTHONPATH (see
that module for where each copy lives); stdlib only, torch passed in.
"""

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import sys

# On a worker's PYTHONPATH the format is a module beside this one; in the package, a sibling.
if __package__:
    from agents.shims import orchestrator_checkpoint_format as F
else:
    import orchestrator_checkpoint_format as F  # type: ignore[no-redef]

CheckpointError = F.CheckpointError
_NO_STREAM = contextlib.nullcontext()


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
loaded = set()  # type: set[tuple[int, int]]  # (device, inode) of slot files a load mapped


def rank():
    return F.int_env("RANK", 0)


def metas_of(rank_dir, corrupt=False):
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
            F.take_blank(os.path.dirname(rank_dir), path, size, rank())
        slot = _open_slot(path)
        fcntl.flock(slot.fd, fcntl.LOCK_EX)
        return number, slot
    # Memory is full: a retained copy goes first (a node's loss may then cost more steps),
    # and only then does the training wait, for the oldest (saves come faster than the
    # disk or the buddy take them).
    taken = _lock_first(rank_dir, [n for n in candidates if n not in pending])
    if taken:
        say_once("checkpoint.memory is full: older copies are given up before the buddy "
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
    if (st.st_dev, st.st_ino) in loaded:  # a load of this process maps it: written by
        loaded.discard((st.st_dev, st.st_ino))  # nobody again (a blank's next copy would)
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


def say_once(text, key=None):
    if (key or text) not in _said:
        _said.add(key or text)
        say(text)


def release():
    """Unmap this process's slots (orchestrator_checkpoint.release says why)."""
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


def say(text):
    try:
        sys.stderr.write("[orchestrator] checkpoint: %s\n" % text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def side_stream(torch, views):
    """Where a save beside the training copies its GPU tensors: a stream of their device
    that first waits for the work queued so far (the state as of this step); None: no GPU
    tensors; False: they are on several devices (copied at once, on the current stream)."""
    devices = {v.device for v in views if v.is_cuda}
    if not devices:
        return None
    if len(devices) > 1:
        return False
    device = devices.pop()
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    for view in views:
        if view.is_cuda:
            view.record_stream(stream)  # their memory not reused while the stream reads it
    return stream


def to_memory(torch, memory, step, meta, views, entries, size, held, stream=None):
    """The copy into this rank's memory and the save's description; ``held()``: the seconds
    the training was held for it, written in the description (shown in status). Whether
    it was saved (not: no room)."""
    rank_dir = rank_dir_of(memory)
    budget = F.int_env(F.BUDGET_VAR, 1 << 62)
    metas = metas_of(rank_dir)
    number, slot = _take_slot(rank_dir, size, budget, metas)
    try:
        slot = _unshared(slot, size)
        try:
            slot.ensure(max(size, 1))
        except OSError as exc:  # the node's shared memory is full: the training goes on
            say_once("no room in %s for a %d-byte save (%s): step %d and later ones it cannot "
                      "hold skipped" % (memory, size, exc.strerror, step), "room")
            return False
        for s, m in metas_of(rank_dir, corrupt=True).items():
            if m.get("slot") == number or s == step:
                F.drop(rank_dir, s)  # its bytes are about to go: it is no longer a copy
        _copy_in(torch, slot, views, entries, stream)
        meta["slot"] = number
        meta["block_s"] = round(held(), 6)  # shown in status
        F.write_file(os.path.join(rank_dir, F.step_name(step) + ".meta"),
                   json.dumps(meta).encode("utf-8"))
    finally:
        fcntl.flock(slot.fd, fcntl.LOCK_UN)
    if not metas:  # its first save here: the next needs a slot of its own (the newest copy
        # is never written), its pages made ahead by the agent while the rank trains (they
        # were most of that save: 1.6 s of 1.7 s, 512 MiB a rank, docs/benchmarks.md)
        F.ask_blank(memory, rank(), size)
    F.poke(memory)
    return True


def rank_dir_of(memory):
    """This rank's directory in the agent's memory, made if need be; never the memory itself
    (the agent makes it, and removes it when it ends: a directory made again would outlive
    it). Raises CheckpointError when the agent's memory is gone."""
    rank_dir = os.path.join(memory, "rank-%d" % rank())
    try:
        os.mkdir(rank_dir, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise CheckpointError("the agent's checkpoint memory %s is gone" % memory) from None
    return rank_dir


def _copy_in(torch, slot, views, entries, stream=None):
    if any(v.is_cuda for v in views):
        slot.register_cuda(torch)
    whole = torch.frombuffer(slot.map, dtype=torch.uint8, count=slot.size)
    try:
        cuda = False
        with torch.cuda.stream(stream) if stream is not None else _NO_STREAM:
            for view, (_, _, offset, nbytes) in zip(views, entries):
                if nbytes:
                    cuda = cuda or view.is_cuda
                    whole[offset:offset + nbytes].copy_(view,
                                                        non_blocking=bool(slot.registered))
        if stream is not None:
            stream.synchronize()  # its copies only: the training's kernels go on
        elif cuda:
            torch.cuda.synchronize()
    finally:
        del whole  # the mapping can be resized only once no tensor views it


def _unshared(slot, size):
    """``slot``, or a new file in its place (a blank, where the node has one) where a load of
    this process mapped it (the old one lives on, unnamed, while the loaded tensors do;
    locked until the new one is named)."""
    st = os.fstat(slot.fd)
    if (st.st_dev, st.st_ino) not in loaded:
        return slot
    loaded.discard((st.st_dev, st.st_ino))
    new = slot.path + ".new"
    if not F.take_blank(os.path.dirname(os.path.dirname(slot.path)), new, size, rank()):
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
