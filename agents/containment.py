"""Every descendant of a worker stays the agent's to stop, whatever it does: the kernel's
containment, not a name or a variable a process can drop.

Two mechanisms, the second where the node offers it:

- The agent is a **child subreaper** (``PR_SET_CHILD_SUBREAPER``): a worker's descendant
  whose parent dies (a double fork, a daemon) becomes the agent's child instead of init's.
  A stop kills those children, and the agent reaps them (``reap_adopted``), so none lingers
  as a zombie over a week of training. Our own children (workers, standbys, setup, py-spy)
  are never touched: their owners wait for them (``own``).
- Each attempt's workers run in a **cgroup** of their own, joined between fork and exec, so
  that every process they ever start is in it, ``setsid`` and ``env -i`` included. A stop
  kills the whole cgroup: ``cgroup.kill`` on cgroup v2 (a writable part of the unified
  hierarchy: a delegated subtree, a systemd user scope, a Slurm step's cgroup), or on a v1
  hierarchy the freezer, a SIGKILL to every member while none can fork, and a thaw, as
  Slurm's proctrack/cgroup does. The cgroups live under one directory per agent
  (``orchestrator.<job>.<node>.<instance>``): its watchdog kills that one when the agent
  dies (never a successor's, which may already run), and the next agent for the node kills
  its predecessors' (``kill_predecessors``) when an agent and its watchdog were both
  SIGKILLed.

Where neither cgroup version is writable, the subreaper and the token sweep
(agents/processes.py) remain; ``check`` says which a node has (``Cgroups.describe``).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import threading
import time
import weakref
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
KILL_WAIT = 5.0  # seconds for a killed cgroup to empty before it is left for the next pass

_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the token sweep alone
    _prctl = None

# Our own direct children, which their owners wait for (a reap here would steal their exit
# status: subprocess then reports 0). Everything else that is our child was adopted.
_own: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
_own_pids: set[int] = set()  # forked without Popen (the watchdog): never waited for
# Held while a child of our own is made and registered, and while adopted children are
# looked for: a child that exited before it was registered was reaped as adopted, and its
# owner's wait then said 0 (measured: 76 of 300 `exit 3`s with a reaper looping; a failing
# preemption_check read as a notice, a worker that failed at once as one that succeeded).
_spawning = threading.RLock()


def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(*args, **kwargs)``, registered as one of the agent's own children
    before the reaper can see it (see ``reap_adopted``)."""
    with _spawning:
        proc = subprocess.Popen(*args, **kwargs)
        _own.add(proc)
    return proc


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` (text, captured, stdin closed) for a child of our own."""
    with spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants."""
    return _prctl is not None and _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _children() -> list[int]:
    """This process's children, from every thread's list (the kernel files an adopted
    orphan under one thread of the reaper)."""
    out: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _adopted() -> list[int]:
    """Our children that are not our own (call with ``_spawning`` held)."""
    busy = {p.pid for p in list(_own) if p.returncode is None}
    return [pid for pid in _children() if pid not in busy]


def _reap() -> tuple[int, list[int]]:
    """Reap every adopted child that has exited: how many, and the adopted ones left."""
    reaped, left = 0, []
    with _spawning:
        for pid in _adopted():
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
                    continue
            except ChildProcessError:
                continue
            left.append(pid)
    return reaped, left


def reap_adopted() -> int:
    """Reap every adopted child that has exited; how many."""
    return _reap()[0]


def kill_adopted() -> None:
    """SIGKILL every adopted child (the orphans of stopped workers), then reap them. An
    unreaped child's pid is still its own: the kill cannot hit anybody else."""
    with _spawning:
        for pid in _adopted():
            if pid in _own_pids:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + 1.0
    while any(p not in _own_pids for p in _reap()[1]) and time.monotonic() < deadline:
        time.sleep(0.01)


def forked(pid: int) -> None:
    """A child we forked ourselves and keep (the watchdog): never killed as an orphan."""
    _own_pids.add(pid)


# --- cgroups ------------------------------------------------------------------------------------
class Cgroups:
    """The cgroups of one agent's workers: ``<hierarchy>/<the agent's cgroup>/
    orchestrator.<job>.<node>.<instance>/attempt-<N>``, on cgroup v2 where it is writable,
    else on the v1 freezer hierarchy, else none (``kind`` None). ``parent`` and ``kind``
    given: that hierarchy, unprobed."""

    def __init__(self, job_id: str, node_index: int, instance: str,
                 parent: str | None = None, kind: str | None = None):
        # Job ids are [a-z0-9-] and the node index digits: the dot ends the prefix.
        self.prefix = f"orchestrator.{job_id}.{node_index}."
        if parent is None:
            kind, parent = _writable_hierarchy()
        self.kind = kind if parent else None
        self.parent = parent if kind else None
        self.base = os.path.join(self.parent, self.prefix + instance) if self.parent else None

    def describe(self) -> str:
        if self.kind == "v2":
            return f"cgroup v2 (cgroup.kill) under {self.parent}"
        if self.kind == "v1":
            return f"cgroup v1 freezer under {self.parent}"
        return "no writable cgroup: child subreaper and the token sweep only"

    def attempt(self, number: int) -> str | None:
        """The directory of attempt ``number``'s cgroup, made if need be (None: none)."""
        if self.base is None:
            return None
        path = os.path.join(self.base, f"attempt-{number}")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            return None
        return path

    def move(self, path: str | None, pid: int) -> None:
        """Move a running process (a standby becoming a worker) into the cgroup at ``path``."""
        if path is not None:
            try:
                _write(os.path.join(path, "cgroup.procs"), str(pid))
            except OSError:
                pass

    def kill_all(self) -> list[str]:
        """Kill every process in every attempt's cgroup of this agent and remove them; the
        cgroups that would not empty (left for the next pass)."""
        return _kill_tree(self.base, self.kind or "") if self.base else []

    def kill_predecessors(self) -> list[str]:
        """Kill what earlier agents of this job on this node left in their cgroups (call it
        once no other agent of the job lives here: the agent's alive lock)."""
        if self.parent is None:
            return []
        try:
            names = os.listdir(self.parent)
        except OSError:
            return []
        left = []
        for name in names:
            path = os.path.join(self.parent, name)
            if name.startswith(self.prefix) and path != self.base:
                left += _kill_tree(path, self.kind or "")
        return left


def _kill_tree(base: str, kind: str) -> list[str]:
    """Kill every attempt's cgroup under ``base`` and remove them all; those that would not
    empty."""
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    left = []
    for entry in entries:
        path = os.path.join(base, entry)
        if entry.startswith("attempt-") and os.path.isdir(path) and not kill(path, kind):
            left.append(path)
    if not left:
        try:
            os.rmdir(base)
        except OSError:
            pass
    return left


def join(path: str | None) -> None:
    """Runs in a child between fork and exec: enter the cgroup at ``path``. Never raises (a
    worker outside its cgroup is still the subreaper's and the sweep's)."""
    if path is None:
        return
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    except OSError:
        pass


def kill(path: str, kind: str) -> bool:
    """Kill every process in the cgroup at ``path`` and remove it; whether it emptied."""
    try:
        if kind == "v2":
            _write(os.path.join(path, "cgroup.kill"), "1")
        else:
            _freeze_and_kill(path)
    except OSError:
        pass
    deadline = time.monotonic() + KILL_WAIT
    while _members(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _freeze_and_kill(path: str) -> None:
    """cgroup v1: freeze (no member can fork or exit meanwhile, so every pid read names its
    process), SIGKILL every member, thaw (the kills take effect)."""
    state = os.path.join(path, "freezer.state")
    _write(state, "FROZEN")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and _read(state).strip() != "FROZEN":
        time.sleep(0.005)
    for pid in _members(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _write(state, "THAWED")


def _members(path: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _writable_hierarchy() -> tuple[str | None, str | None]:
    """("v2" or "v1", the agent's own cgroup directory) on the first hierarchy where the agent
    can make a child cgroup and move processes into it; (None, None) where none."""
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    candidates = []
    if "v2" in mounts and "" in own:
        candidates.append(("v2", os.path.join(mounts["v2"], own[""].lstrip("/"))))
    if "freezer" in mounts and "freezer" in own:
        candidates.append(("v1", os.path.join(mounts["freezer"], own["freezer"].lstrip("/"))))
    for kind, directory in candidates:
        if _can_use(kind, directory):
            return kind, directory
    return None, None


def _can_use(kind: str, directory: str) -> bool:
    """Can a child cgroup be made here, joined, and killed (cgroup.kill needs Linux 5.14)?"""
    probe = os.path.join(directory, f"orchestrator-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        needed = "cgroup.kill" if kind == "v2" else "freezer.state"
        return os.path.exists(os.path.join(probe, needed)) and \
            os.access(os.path.join(probe, "cgroup.procs"), os.W_OK)
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def _cgroup_mounts() -> dict[str, str]:
    """{"v2": the unified mount, "freezer": the v1 freezer mount}, as this process sees them."""
    found: dict[str, str] = {}
    for line in _proc_lines("/proc/self/mountinfo"):
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if tail[0] == "cgroup2":
            found.setdefault("v2", point)
        elif tail[0] == "cgroup" and "freezer" in tail[2].split(","):
            found.setdefault("freezer", point)
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy: "" for v2, "freezer" for the v1 freezer."""
    found: dict[str, str] = {}
    for line in _proc_lines("/proc/self/cgroup"):
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                found.setdefault(controller, parts[2])
    return found


def _proc_lines(path: str) -> list[str]:
    """The lines of a /proc file; none where it cannot be read (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []
