"""No orphans: every process an agent starts carries its token, and is found by it.

Every worker runs in its own process group with ``PR_SET_PDEATHSIG(SIGKILL)`` (and in its
attempt's cgroup, under the agent as subreaper: agents/containment.py); a watchdog process
kills the workers when the agent dies, SIGKILL included; and processes that left their group
(``setsid``, torchrun's workers) are found by the per-agent token in their environment, never
by name, where no cgroup holds them. Kills go through pidfds where the kernel has them, so a
recycled pid is never hit.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time
from typing import Any

from agents.containment import Cgroups, forked
from agents.paths import clear_agent_directory

TOKEN_VAR = "ORCHESTRATOR_AGENT_TOKEN"
PR_SET_PDEATHSIG = 1

_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the watchdog alone guards against orphans
    _prctl = None


def set_pdeathsig() -> None:
    """Runs in the child between fork and exec (so prctl was looked up beforehand, in the
    parent): if the agent dies, the kernel kills the worker."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_node_open_files: tuple[int, int] | None = None  # the node's, before the agent raised its own


def raise_open_files() -> None:
    """The agent's own hardening: each worker holds pipes and a pidfd here, and a node of
    1,024 local ranks needs more descriptors than the common soft limit of 1,024. What it
    starts gets the node's own limit back (``as_launched``)."""
    global _node_open_files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):
        return
    _node_open_files = (soft, hard)


# torchrun handles these (TORCHELASTIC_SIGNALS_TO_HANDLE), so its workers start with them at
# their defaults even where the shell ignored them (a background shell ignores INT and QUIT).
TORCHRUN_HANDLES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def as_launched() -> None:
    """Runs in a child between fork and exec (a worker, a standby, a setup command): it dies
    with the agent, and has torchrun's workers' signal dispositions and the node's
    open-files limit."""
    set_pdeathsig()
    for sig in TORCHRUN_HANDLES:
        signal.signal(sig, signal.SIG_DFL)
    if _node_open_files is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, _node_open_files)
        except (ValueError, OSError):
            pass


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name
        return f"SIG{number}"


PF_KTHREAD = 0x00200000
EXEC_WAIT = 0.2  # seconds an environment that is not there yet is read again at most


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return None


def _in_exec(pid: int) -> bool:
    """Is ``pid`` a process whose environment is not there yet? Between an exec's switch to
    the new image and the kernel laying out its stack, ``/proc/<pid>/environ`` reads empty
    (measured: for 217 of 300 processes right after Popen returned, under load), and a scan
    then would miss a worker's child in the middle of an exec. Told apart by the image's
    ``env_start`` (field 50 of ``stat``), 0 until it is laid out: a process started with an
    empty environment has one, as do kernel threads (no environment, flagged) and zombies."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(b")") + 2:].split() if stat else []
    try:
        return fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_KTHREAD \
            and int(fields[47]) == 0
    except (IndexError, ValueError):
        return False


def has_token(pid: int, token: str) -> bool:
    """Does process ``pid`` carry this agent's token in its environment? One in the middle
    of an exec is read again until its new environment is there (EXEC_WAIT at most)."""
    path = f"/proc/{pid}/environ"
    environ = _read(path)  # a scan reads every process's: its stat only where this is empty
    deadline = time.monotonic() + EXEC_WAIT
    while environ == b"" and time.monotonic() <= deadline:
        before = _in_exec(pid)
        environ = _read(path)
        # Still empty: no environment only if no exec was under way before the read, nor
        # after it (the image laid out in between, or an exec begun).
        if environ == b"" and not (before or _in_exec(pid)):
            return False
        if environ == b"":
            time.sleep(0.002)
    return environ is not None and f"{TOKEN_VAR}={token}".encode() in environ.split(b"\0")


def processes_with_token(token: str) -> list[int]:
    """Pids of every process whose environment carries this agent's token."""
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != me and has_token(int(e), token)]


def pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+): it names that very process, never a recycled pid."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_token_processes(token: str, spare: frozenset[int] | set[int] = frozenset()) -> None:
    """SIGKILL every process that carries the token (but those in ``spare``). Each one is
    pinned with a pidfd and its token checked again through that pin, so a pid recycled
    since the scan is spared."""
    for pid in processes_with_token(token):
        if pid in spare:
            continue
        fd = pidfd(pid)
        try:
            if not has_token(pid, token):  # the scan's process is gone; this is another
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:  # no pidfds here: the narrow window between check and kill remains
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)


def standby_token(token: str) -> str:
    """What the agent's warm standbys carry instead of its token (agents/standby.py): the
    sweep after each attempt must spare them."""
    return token + "-standby"


def start_watchdog(token: str, directory: str | None = None, memory: str | None = None,
                   cgroups: Cgroups | None = None) -> None:
    """Fork a process that kills this agent's workers and standbys once the agent is gone,
    however it died (every process in their cgroups first), and removes the agent's
    directory and its checkpoint memory if no new agent took them meanwhile."""
    agent_pid = os.getpid()
    pid = os.fork()
    if pid != 0:
        forked(pid)
        return
    # The watchdog must hold nothing of the agent's: no socket, no pipe.
    os.closerange(3, 65536)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.getppid() == agent_pid:
        time.sleep(0.2)
    if cgroups is not None:
        cgroups.kill_all()
    kill_token_processes(token)
    kill_token_processes(standby_token(token))
    # The dead agent's leftovers; its memory also where its end cleared the directory: a
    # copy from a buddy may have written there after its store removed it.
    if directory and (os.path.isdir(directory) or memory and os.path.isdir(memory)):
        clear_agent_directory(directory, memory)
    os._exit(0)
