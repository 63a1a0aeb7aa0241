"""The checkpoint format (stdlib only): names, manifests, verification and reading, a state
as data (torch only where a caller hands it in), and the node's blanks (pages kept).

Shared by a worker's ``orchestrator_checkpoint`` (which writes and reads copies) and the
node's agent (agents/checkpoints.py: it seals, persists and reports them, and never imports
torch). The agent puts this file beside the other shims on every worker's PYTHONPATH.

A copy of one rank's state at one step is three parts: its data (the tensors' bytes, each
aligned), its meta (JSON: the step, the rank, the world size, each tensor's dtype, shape and
place, and the state's tree with tensors as indices) and its manifest (a CRC-32 per chunk of
the data and one of the meta's bytes). A copy is good only when the manifest matches both.
"""

import concurrent.futures
import ctypes
import fcntl
import json
import math
import os
import socket
import threading
import time
import zlib

FORMAT = 1
CHUNK = 16 << 20  # bytes a CRC covers: a corrupt byte names a chunk, not the whole copy
MAX_CHUNK = 4 * CHUNK  # a peer's manifest with larger ones is refused (a receiver buffers two)
WAKE_NAME = "wake"  # the agent's datagram socket in the memory root: a save pokes it
SAVE_AT_NAME = "save-at"  # in the memory root: the step the controller asks every rank to save
# In a rank's directory: its copy is being pulled from another node (the content: until when,
# by the node's clock, its load waits), and why the pull failed (JSON: step, error).
PULLING_NAME = "pulling"
BLANK_DIR = "blank"  # in the memory root: the pages of copies let go, for the next copies
# In the memory root: how many copies each of the node's ranks may keep (the agent's share
# of checkpoint.memory between the node's own copies and the replicas it keeps for others).
COPIES_NAME = "copies"
PULL_FAILED_NAME = "pull-failed"
MAKING_WAIT = 10.0  # seconds a save waits at most for the blank its agent makes for it
# In the memory root: other nodes' copies a DCP load into fewer ranks reads (agents/borrows.py).
BORROWED_DIR = "borrowed"
OWN_BELOW = 1 << 16  # bytes: a loaded tensor this small is a copy, not a view of the whole
ALIGN = 64
MEMORY_VAR = "ORCHESTRATOR_CHECKPOINT_MEMORY"
BUDGET_VAR = "ORCHESTRATOR_CHECKPOINT_MEMORY_BYTES"
DIR_VAR = "ORCHESTRATOR_CHECKPOINT_DIR"
STEP_VAR = "ORCHESTRATOR_CHECKPOINT_STEP"
PERSIST_VAR = "ORCHESTRATOR_CHECKPOINT_PERSIST_EVERY"
KEEP_VAR = "ORCHESTRATOR_CHECKPOINT_KEEP"  # steps kept in the directory with no agent (2)
MAX_META = 64 << 20  # bytes of one save's description (its tree of small values)
MAX_STEP = 1 << 62
THREADS = min(8, os.cpu_count() or 1)


class CheckpointError(Exception):
    """A save or a load that cannot be done as asked (the message says why)."""


def int_env(name, default):
    """An integer from the environment (a worker's RANK, a setting the agent gave it): the
    default where it is unset, empty or not a number."""
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def int_file(path):
    """The integer a small file holds (a setting the agent wrote), or None."""
    data = read_bytes(path, 32)
    try:
        return int(data) if data else None
    except ValueError:
        return None


# --- the format (stdlib; the agent uses these) -------------------------------------------

def step_name(step):
    return "step-%d" % step


def persisted_dir(root, step):
    return os.path.join(root, "step-%012d" % step)


def parse_step(name, prefix="step-", suffix=""):
    """The step a file or directory name gives, or None."""
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    digits = name[len(prefix):len(name) - len(suffix)]
    if not digits.isdigit() or len(digits) > 19:
        return None
    step = int(digits)
    return step if step < MAX_STEP else None


def save_at_text(step, until):
    """The ``save-at`` file: the step every rank saves, and until when it holds there."""
    return ("%d %.3f" % (step, until)).encode()


def asked(memory):
    """``(step, hold until)``: what the controller asked every rank to save, or (None, 0)."""
    data = read_bytes(os.path.join(memory, SAVE_AT_NAME), 64) if memory else None
    try:
        step, until = data.split()
        return int(step), float(until)
    except (AttributeError, ValueError):
        return None, 0.0


def hold(memory, step):
    """Where ``step`` is the one a planned move asked for (and it is saved): wait there until
    the move stops this worker (no step is then done twice), the request is over, or the
    hold's end."""
    asked_step, until = asked(memory)
    while asked_step == step and time.time() < until:
        time.sleep(0.02)
        asked_step, until = asked(memory)


_reported = [0.0]  # when this process last reported its step (report_step)
REPORT_EVERY = 0.2  # seconds


def await_pull(rank_dir):
    """Wait while the agent pulls this rank's copy from another node (this one took a
    drained or lost one's place), up to the time the agent wrote (agents/pulls.py)."""
    path = os.path.join(rank_dir, PULLING_NAME)
    while True:
        text = read_bytes(path, 64)
        try:
            if text is None or time.time() >= float(text):
                return
        except ValueError:
            return
        time.sleep(0.02)


def pull_failed(rank_dir, step):
    """Raises CheckpointError where the agent could not pull this rank's copy of ``step``."""
    failed = read_json(os.path.join(rank_dir, PULL_FAILED_NAME), 8192)
    if failed is not None and failed.get("step") == step:
        raise CheckpointError("%s has no copy of step %d, the step every rank was to resume: %s"
                              % (os.path.basename(rank_dir).replace("-", " "), step,
                                 str(failed.get("error"))[:2000]))


def report_step(step):
    """Tell the node's agent the step this rank is at, as ``heartbeat(step=)`` does (into the
    same file, keeping what the script's own heartbeat put there), at most five times a
    second: ``save(step, state, every=N)`` is called at every step. Never an older step than
    the file says (the heartbeat file is the attempt's): a ``dcp.async_save``'s thread
    reports a step the training has passed, which the script's heartbeat may have said."""
    path = os.environ.get("ORCHESTRATOR_HEARTBEAT_FILE")
    now = time.monotonic()
    if not path or now - _reported[0] < REPORT_EVERY:
        return
    _reported[0] = now
    record = read_json(path, 1 << 16) or {"metrics": {}}
    if type(record.get("step")) is int and record["step"] >= step:
        return
    record["step"] = step
    try:  # the orchestrator's bookkeeping never stops a training
        write_file(path, json.dumps(record).encode())
    except OSError:
        pass


def checksums(view, size, chunk=CHUNK):
    """The CRC-32 of each ``chunk`` bytes of ``view[:size]``, on a few threads (zlib lets go
    of the GIL: a node's idle cores share the work)."""
    starts = range(0, size, chunk)
    one = lambda at: zlib.crc32(view[at:min(at + chunk, size)])  # noqa: E731
    threads = min(THREADS, len(starts))
    if threads < 2:
        return [one(at) for at in starts]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, starts))


def manifest(meta_bytes, crcs, size):
    return {"format": FORMAT, "size": size, "chunk": CHUNK, "crc": crcs,
            "meta": zlib.crc32(meta_bytes)}


def read_json(path, limit=MAX_META):
    """A small JSON file's object, or None (missing, too large, not an object)."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    if len(data) > limit:
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def read_bytes(path, limit=MAX_META):
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def write_file(path, data, sync=False):
    """``data`` at ``path``, whole or not at all (written aside, then renamed). Aside under a
    name of this thread's own: two writers of one file (a script's heartbeat() and a save on
    another thread) each truncated what the other was writing, and renamed it in half done."""
    tmp = "%s.%d-%d.tmp" % (path, os.getpid(), threading.get_ident())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def verify(meta_bytes, man, view, crcs=None):
    """Why the copy (its meta's bytes, its manifest, its data) is not good; None: it is.
    ``crcs``: the data's checksums, where the caller took them already (as it read it)."""
    why = check_manifest(meta_bytes, man)
    if why is not None:
        return why
    size, chunk = man["size"], man["chunk"]
    if len(view) < size:
        return "it is %d bytes short" % (size - len(view))
    got = checksums(view, size, chunk) if crcs is None else crcs
    for i, (have, want) in enumerate(zip(got, man["crc"])):
        if have != want:
            at = i * chunk
            return "chunk %d (bytes %d..%d) fails its checksum" % (i, at, min(at + chunk, size))
    return None


def read(torch, fd, size, chunk, checked):
    """The file's first ``size`` bytes in a new uint8 tensor (one copy, no zero-filling), and
    with ``checked`` the CRC-32 of each chunk, each taken on a thread while the next is read."""
    whole = torch.empty(size, dtype=torch.uint8)
    if not size:
        return whole, []
    view = memoryview((ctypes.c_char * size).from_address(whole.data_ptr())).cast("B")
    futures = []
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for at in range(0, size, chunk):
            piece = view[at:min(at + chunk, size)]
            done = 0
            while done < len(piece):
                n = os.preadv(fd, [piece[done:]], at + done)
                if n <= 0:
                    raise CheckpointError("it ended at byte %d of %d" % (at + done, size))
                done += n
            if checked:
                futures.append(pool.submit(zlib.crc32, piece))
        return whole, [f.result() for f in futures]


def check_manifest(meta_bytes, man):
    """Why a manifest cannot vouch for a copy with this meta; None: it can."""
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        return "no manifest"
    if zlib.crc32(meta_bytes) != man.get("meta"):
        return "its description does not match its manifest"
    size, chunk, crcs = man.get("size"), man.get("chunk"), man.get("crc")
    if type(size) is not int or type(chunk) is not int or not 0 < chunk <= MAX_CHUNK or \
            size < 0 or not isinstance(crcs, list) or len(crcs) != (size + chunk - 1) // chunk:
        return "its manifest is malformed"
    return None


# --- the state as data --------------------------------------------------------------------

def _is_tensor(value):
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def flatten(state):
    """``(tree, tensors)``: the state as JSON-able data, its tensors replaced by indices."""
    tensors = []

    def enc(value, path):
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value if abs(value) < (1 << 63) else {"__i": str(value)}
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__f": repr(value)}
        if _is_tensor(value):
            tensors.append(value)
            return {"__T": len(tensors) - 1}
        if isinstance(value, dict):
            return {"__d": [[enc(k, path + "[key]"), enc(v, "%s[%r]" % (path, k))]
                            for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__t": [enc(v, "%s[%d]" % (path, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, "%s[%d]" % (path, i)) for i, v in enumerate(value)]
        raise CheckpointError("state%s is a %s: a checkpoint holds tensors, dicts, lists, "
                              "tuples, numbers, strings, booleans and None"
                              % (path, type(value).__name__))
    return enc(state, ""), tensors


def unflatten(tree, tensors):
    def dec(value):
        if isinstance(value, list):
            return [dec(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__T" in value:
            return tensors[value["__T"]]
        if "__d" in value:
            return {_key(dec(k)): dec(v) for k, v in value["__d"]}
        if "__t" in value:
            return tuple(dec(v) for v in value["__t"])
        if "__i" in value:
            return int(value["__i"])
        if "__f" in value:
            return float(value["__f"])
        raise CheckpointError("a checkpoint's description holds an unknown entry")
    return dec(tree)


def _key(value):
    return tuple(value) if isinstance(value, list) else value


def layout(tensors):
    """``[(dtype name, shape, offset, nbytes)]`` and the total size, each tensor aligned."""
    entries, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append([str(t.dtype).replace("torch.", ""), list(t.shape), at, nbytes])
        at += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, at


def byte_view(torch, tensor):
    """A tensor's bytes as a flat uint8 view (a contiguous copy first where it is not)."""
    t = tensor.detach()
    if t.is_sparse or t.is_quantized:
        raise CheckpointError("sparse and quantized tensors are not supported: save "
                              "their dense form")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def drop(rank_dir, step):
    """Forget a save in memory: its description, manifest and marks (its slot is reused)."""
    for suffix in (".meta", ".manifest", ".persisted", ".corrupt"):
        try:
            os.unlink(os.path.join(rank_dir, step_name(step) + suffix))
        except OSError:
            pass


def persisted_steps(root, rank):
    """Steps of which ``root`` holds a sealed copy of ``rank``, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = [parse_step(n) for n in names]
    return sorted((s for s in steps if s is not None and os.path.exists(
        os.path.join(persisted_dir(root, s), "rank-%d.manifest" % rank))), reverse=True)


def trim(root, rank, keep):
    """Only the ``keep`` newest persisted steps of ``rank`` (its files; a step's directory
    goes with its last rank)."""
    for step in persisted_steps(root, rank)[keep:]:
        directory = persisted_dir(root, step)
        for suffix in (".manifest", ".corrupt", ".meta", ".data"):
            try:
                os.unlink(os.path.join(directory, "rank-%d%s" % (rank, suffix)))
            except OSError:
                pass
        try:
            os.rmdir(directory)
        except OSError:
            pass  # other ranks' files are still there


_poker = []  # type: list  # this process's datagram socket, made at its first save


def poke(memory):
    """Wake the agent's store now (it seals and replicates this save at once) rather than
    at its next look; a datagram that cannot go (the agent busy or gone) is no matter."""
    try:
        if not _poker:
            _poker.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                                        | socket.SOCK_NONBLOCK))
        _poker[0].sendto(b"s", os.path.join(memory, WAKE_NAME))
    except OSError:
        pass


# --- blanks: pages kept for the next copy --------------------------------------------------
# What a copy into memory costs most is new pages: four ranks copying 512 MiB each into new
# files of /dev/shm took 2.5-2.8 s each here, into files whose pages existed 0.26-0.38 s
# (docs/benchmarks.md). So a replica the store lets go keeps its pages, as a *blank* in
# the memory root, and the next file the node writes whole (a buddy's replica arriving, a
# copy pulled in, a rank's new slot) takes one by a rename. Blanks count as memory held;
# the agent's store lets them go where checkpoint.memory is short.

def ask_blank(memory, rank, size):
    """Ask the node's store for a blank of ``size`` bytes made ahead for ``rank``
    (agents/pages.py), unless the memory has one that holds them or one is being made."""
    if blank_dir(memory) and not any(n >= size for n, _ in blanks(memory)) and not _making(
            memory, rank):
        write_file(blank_asked(memory, rank), str(size).encode())


def blank_dir(memory):
    """Whether ``memory`` has its blanks' directory (made here if need be; never the memory
    itself: made again, it would outlive its agent)."""
    try:
        os.mkdir(os.path.join(memory, BLANK_DIR), 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    return True


def blank_asked(memory, rank):
    """Where ``rank`` asks for a blank: among the blanks, under a name none of them has."""
    return os.path.join(memory, BLANK_DIR, ".asked-%d" % rank)


def making_prefix(rank):  # of a blank being made for ``rank`` (hidden from takers)
    return ".making-%d-" % rank


def _making(memory, rank):
    try:
        return any(n.startswith(making_prefix(rank)) for n in os.listdir(
            os.path.join(memory, BLANK_DIR)))
    except OSError:
        return False


def _await_making(memory, rank):
    deadline = time.monotonic() + MAKING_WAIT
    while _making(memory, rank) and time.monotonic() < deadline:
        time.sleep(0.005)


def give_blank(memory, path):
    """The file at ``path`` (a copy let go) into ``memory``'s blanks, unless a reader holds
    it (a shared lock: a copy being sent) or that fails: then it is removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        blank_dir(memory)
        os.rename(path, os.path.join(memory, BLANK_DIR, os.urandom(8).hex()))
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
    finally:
        os.close(fd)


def blanks(memory):
    """``[(bytes, path)]`` of ``memory``'s blanks."""
    directory = os.path.join(memory, BLANK_DIR)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith("."):
            continue  # being made, or asked for (agents/pages.py)
        path = os.path.join(directory, name)
        try:
            out.append((os.stat(path).st_size, path))
        except OSError:
            pass  # taken meanwhile
    return out


def blank_bytes(memory):
    return sum(length for length, _ in blanks(memory))


def take_blank(memory, path, size, rank=None):
    """A blank of ``memory`` moved to ``path`` (a name nothing else has) and cut to ``size``
    bytes: the smallest that holds them, else the largest. False: none. For ``rank``, one
    its agent is making for it is waited for (up to MAKING_WAIT s): both writing new pages
    at once took longer than either (a second save held 3.6 s, against 2.5 s alone)."""
    if rank is not None:
        _await_making(memory, rank)
        try:  # this is the save it asked for: made or not, a blank now would lie idle
            os.unlink(blank_asked(memory, rank))
        except OSError:
            pass
    found = blanks(memory)
    fits = sorted(b for b in found if b[0] >= size)
    for length, blank in fits + sorted((b for b in found if b[0] < size), reverse=True):
        try:
            os.rename(blank, path)  # of two takers of one blank, the second takes the next
        except FileNotFoundError:
            continue
        except OSError:
            return False
        if length > size:
            try:
                os.truncate(path, size)
            except OSError:
                pass
        return True
    return False


def save_files(step, meta, views, size):
    """No agent: this rank's copy straight to ``$ORCHESTRATOR_CHECKPOINT_DIR``, synced; the
    ``$ORCHESTRATOR_CHECKPOINT_KEEP`` (2) newest steps of this rank kept."""
    root = os.environ.get(DIR_VAR)
    if not root:
        raise CheckpointError("no checkpoint store: run under the orchestrator, or set "
                              "%s to a directory" % DIR_VAR)
    import torch
    directory = persisted_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, "rank-%d" % meta["rank"])
    buf = bytearray(size)
    whole = torch.frombuffer(buf, dtype=torch.uint8) if size else None
    for view, (_, _, offset, nbytes) in zip(views, meta["tensors"]):
        if nbytes:
            whole[offset:offset + nbytes].copy_(view)
    del whole
    meta_bytes = json.dumps(meta).encode("utf-8")
    write_file(base + ".data", buf, sync=True)
    write_file(base + ".meta", meta_bytes, sync=True)
    crcs = checksums(memoryview(buf), size)
    write_file(base + ".manifest", json.dumps(manifest(meta_bytes, crcs, size)).encode(),
               sync=True)
    trim(root, meta["rank"], max(1, int_env(KEEP_VAR, 2)))  # a bounded directory


def distributed(torch):
    """Whether this process is one rank of a torch.distributed group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agree(torch, candidates):
    """The newest of ``candidates`` that every rank has (all ranks when torch.distributed is
    initialized; else this rank's own newest)."""
    dist = torch.distributed
    if distributed(torch):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(candidates))
        common = set(everyone[0]).intersection(*everyone[1:]) if everyone else set()
        return max(common) if common else None
    return candidates[0] if candidates else None


def everyone(torch, good):
    """Whether every rank's copy verified (only this rank's without torch.distributed)."""
    if distributed(torch):
        said = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(said, bool(good))
        return all(said)
    return bool(good)
