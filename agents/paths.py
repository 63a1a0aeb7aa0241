"""Where an agent keeps things on its node, and the small file helpers around them.

- The runtime base: ``$XDG_RUNTIME_DIR/orchestrator`` where the user has a runtime directory
  (systemd's ``/run/user/<uid>``), else ``~/.cache/orchestrator/run``; never a fixed name
  under /tmp, which any other user could create first. In it, ``<job>.<node>/`` is one
  agent's private directory (its socket, spool, workers' small files), 0700, and
  ``<job>.<node>.outcome`` beside it says why an agent that gave up did so (read by the
  next controller to reach the node, or swept after a month).
- ``~/.cache/orchestrator/``: what outlives jobs (synced trees, blobs, setup markers,
  flight recorder dumps, the agents' liveness locks), 0700.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterator

from agents.shims import orchestrator_checkpoint_format as F

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


def private_base() -> str:
    """This user's runtime directory for agents (see above), created 0700 and taken only if
    it is a real directory of this user that nobody else can enter. RuntimeError naming the
    paths tried when neither is usable."""
    # Not $TMPDIR: every relay of the job (one started by a resumed controller may have
    # another environment) must find the same agent. $XDG_RUNTIME_DIR is the same in every
    # session of the user on a machine; a login's environment or the submitter's carries it.
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _problem(runtime, create=False) is None:
        candidates.append(os.path.join(runtime, "orchestrator"))
    problems = []
    try:
        candidates.append(os.path.join(cache(), "run"))
    except (OSError, RuntimeError) as exc:
        problems.append(str(exc))
    for path in candidates:
        problem = _problem(path, create=True)
        if problem is None:
            return path
        problems.append(problem)
    raise RuntimeError("no private directory for the agent: " + "; ".join(problems))


def _problem(path: str, create: bool) -> str | None:
    """What keeps ``path`` from being a private directory of this user, or None."""
    try:
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return (f"{path} is not a private directory of uid {os.getuid()} (must be a "
                "directory, owned by the user, mode 0700)")
    return None


def agent_paths(job_id: str, node_index: int) -> tuple[str, str]:
    """(the agent's private directory, the outcome file beside it) for a job's node."""
    if not JOB_ID_RE.match(job_id) or not isinstance(node_index, int) or node_index < 0:
        raise ValueError(f"bad job id or node index: {job_id!r} {node_index!r}")
    base = private_base()
    name = f"{job_id}.{node_index}"
    return os.path.join(base, name), os.path.join(base, name + ".outcome")


def alive_path(job_id: str, node_index: int) -> str:
    """The file a job's agent holds an flock on for as long as it lives, outside the runtime
    base: when that is wiped under it (systemd removes /run/user/<uid> once the user's last
    session ends), a relay still knows the agent lives and waits for it to listen again."""
    if not JOB_ID_RE.match(job_id) or not isinstance(node_index, int) or node_index < 0:
        raise ValueError(f"bad job id or node index: {job_id!r} {node_index!r}")
    base = os.path.join(cache(), "agents")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, f"{job_id}.{node_index}.alive")


def memory_root(job_id: str, node_index: int) -> str:
    """The agent's checkpoint memory (agents/checkpoints.py): on the node's shared memory in
    a directory of this user's that nobody else can enter (``/dev/shm`` is everyone's: a
    name there could have been taken first), else in the private runtime base."""
    if not JOB_ID_RE.match(job_id) or not isinstance(node_index, int) or node_index < 0:
        raise ValueError(f"bad job id or node index: {job_id!r} {node_index!r}")
    base = f"/dev/shm/orchestrator-{os.getuid()}"
    if not os.path.isdir("/dev/shm") or _problem(base, create=True) is not None:
        base = os.path.join(private_base(), "memory")
        os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, f"{job_id}.{node_index}")


OWNER_NAME = ".owner"  # in a memory root: flocked by its agent for as long as it lives
UNOWNED_FOR = 24 * 3600.0  # seconds untouched before a memory root with no owner file goes


def own_memory(root: str) -> int:
    """Mark ``root`` as a live agent's: an flock on its owner file, held through the
    returned descriptor until the agent exits. The file is locked before it is named, so
    a sweep never finds it unlocked while its agent lives."""
    temp = os.path.join(root, f"{OWNER_NAME}.{os.getpid()}")
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(temp, os.path.join(root, OWNER_NAME))
    except OSError:
        os.close(fd)
        raise
    return fd


def sweep_memory(own_root: str) -> list[str]:
    """Remove the checkpoint memory of this user's agents that died together with their
    watchdog (which else removes it): a Slurm step's end kills every process of the step,
    as can an OOM kill of the tree or an operator. A memory root goes when no live agent
    locks its owner file, or, with none (an older agent's), when untouched for a day.
    Measured: a time-limited Slurm job whose holder died left 8 MiB per node on /dev/shm,
    a cut node of the benchmark 2.6 GiB, run after run."""
    base = os.path.dirname(own_root)
    removed = []
    for name in os.listdir(base):
        path = os.path.join(base, name)
        job, _, index = name.rpartition(".")
        if path == own_root or not JOB_ID_RE.match(job) or not index.isdigit() or \
                not stat.S_ISDIR(os.lstat(path).st_mode):
            continue
        owner = os.path.join(path, OWNER_NAME)
        if os.path.lexists(owner):
            if is_locked(owner):
                continue
        elif time.time() - os.lstat(path).st_mtime < UNOWNED_FOR:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


OUTCOME_KEPT = 30 * 86400.0  # seconds an outcome no controller came back to read is kept


def sweep_outcomes(base: str) -> int:
    """Remove the ``<job>.<node>.outcome`` files in ``base`` older than OUTCOME_KEPT: one is
    read (and removed) when a controller reaches the node again, which for a job whose
    controller never comes back is never; a node would keep one per such job forever.
    A month still lets a late ``resume`` learn why its agent gave up. How many went."""
    removed = 0
    for name in entries(base):
        job, _, rest = name.partition(".")
        index, _, suffix = rest.partition(".")
        if suffix != "outcome" or not JOB_ID_RE.match(job) or not index.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > OUTCOME_KEPT:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def is_locked(path: str) -> bool:
    """Does a live process hold an flock on ``path``?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def holder_path(job_id: str) -> str:
    """A Slurm holder's socket on this node (namespaced test nodes share one filesystem: the
    Slurm node name tells them apart)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if not JOB_ID_RE.match(job_id) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", node):
        raise ValueError(f"bad job id or node name: {job_id!r} {node!r}")
    return os.path.join(private_base(), f"{job_id}.holder.{node}.sock")


def cache() -> str:
    """The agent user's cache (synced trees, blobs, setup markers): 0700, refused unless it
    is a real directory of this user, since synced code may hold secrets."""
    path = os.path.expanduser("~/.cache/orchestrator")
    if not os.path.isdir(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory of uid {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def traces() -> str:
    """Where flight recorder dumps are kept, per job and attempt, after the agent is gone
    (a week: see cache.prune_traces)."""
    path = os.path.join(cache(), "traces")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def connect_unix(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as short:
            s.connect(short)
    except OSError:
        s.close()
        return None
    return s


def bind_unix(s: socket.socket, path: str) -> None:
    with _short(path) as short:
        s.bind(short)


@contextlib.contextmanager
def _short(path: str) -> Iterator[str]:
    """``path``, or where it is longer than a socket address may be (108 bytes: a long home
    or job id), the same file through an open descriptor of its directory."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def close_socket(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


class Lock:
    """An exclusive flock on ``path``, so that two relays never start two agents. Its holder
    may remove the file (``remove``, as the last user of it leaves): one that locked it
    meanwhile finds it gone from ``path`` and locks the file there now, so that the name
    keeps meaning one lock and no empty file is left behind per job."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1

    def __enter__(self) -> Lock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                here = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                here = False
            if here:
                self.fd = fd
                return self
            os.close(fd)  # removed while we waited for it

    def remove(self) -> None:
        """Unlink the file; only while this lock holds it."""
        assert self.fd >= 0
        remove(self.path)

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)
        self.fd = -1


def clear_agent_directory(directory: str, memory: str | None = None) -> None:
    """Remove an agent's directory (and its checkpoint memory, unless an agent owns it:
    ``own_memory``) and the lock beside it, under that lock (relays launch agents under it),
    unless an agent serves there: a relay may have started a new one for the same job and
    node meanwhile. Removed without the lock, a relay holding it would share the name with
    the next one to lock a new file."""
    try:
        with Lock(directory + ".lock") as lock:
            probe = connect_unix(os.path.join(directory, "agent.sock"))
            if probe is not None:  # a new agent's: its directory, its lock
                probe.close()
                return
            shutil.rmtree(directory, ignore_errors=True)
            if memory and not is_locked(os.path.join(memory, OWNER_NAME)):  # else a new agent's
                shutil.rmtree(memory, ignore_errors=True)
            lock.remove()
    except OSError:
        pass


def entries(path: str) -> list[str]:
    """The names in a directory; none when it is gone (or unreadable)."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def steps_in(directory: str, suffix: str) -> list[int]:
    """The steps of the files in ``directory`` named ``step-<n><suffix>`` (a rank's saves:
    ".meta", its sealed ones and replicas: ".manifest"); none when it is gone."""
    return [s for s in (F.parse_step(n, suffix=suffix) for n in entries(directory))
            if s is not None]


def remove(path: str) -> None:
    """Unlink ``path``; one already gone (or not ours to remove) is no matter."""
    try:
        os.unlink(path)
    except OSError:
        pass
