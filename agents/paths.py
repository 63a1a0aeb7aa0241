"""Where an agent keeps things on its node, and the small file helpers around them.

- ``/tmp/orchestrator-<uid>/<job>.<node>/``: one agent's private directory (its socket,
  spool, workers' error files), 0700, refused if anybody else could have planted it;
  ``<job>.<node>.outcome`` beside it says why an agent that gave up did so.
- ``~/.cache/orchestrator/``: what outlives jobs (synced trees, blobs, setup markers,
  flight recorder dumps), 0700.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


def private_base() -> str:
    """This user's directory for agents: created 0700, and refused unless it is a real
    directory owned by this user that nobody else can enter (never one another user planted)."""
    # Not $TMPDIR: every controller of the job (a resumed one may have another environment)
    # must find the same agent.
    base = f"/tmp/orchestrator-{os.getuid()}"
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{base} is not a private directory of uid {os.getuid()} "
                           "(must be a directory, owned by the user, mode 0700)")
    return base


def agent_paths(job_id: str, node_index: int) -> tuple[str, str]:
    """(the agent's private directory, the outcome file beside it) for a job's node."""
    if not JOB_ID_RE.match(job_id) or not isinstance(node_index, int) or node_index < 0:
        raise ValueError(f"bad job id or node index: {job_id!r} {node_index!r}")
    base = private_base()
    name = f"{job_id}.{node_index}"
    return os.path.join(base, name), os.path.join(base, name + ".outcome")


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
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def close_socket(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


class Lock:
    """An exclusive flock on ``path``, so that two relays never start two agents."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)
