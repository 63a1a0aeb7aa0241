"""Which process a pid names. A pid alone is recycled, and on a shared machine the recycled
pid may be another user's process running the same command line (the same job id, from
their own store). So every recorded pid comes with its process's identity: the owner's uid
and the start time (clock ticks after boot, from ``/proc/<pid>/stat``), which no later
process on that pid shares."""

from __future__ import annotations

import os
import signal


def pid_namespace() -> str | None:
    """This process's PID namespace (pids are only comparable within one)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity(pid: int) -> str | None:
    """``"<uid>:<start ticks>"`` of a live process, or None (gone, a zombie, unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = next(line.split()[1] for line in f if line.startswith(b"Uid:"))
    except (OSError, IndexError, StopIteration):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return f"{int(uid)}:{int(fields[19])}"


def is_ours(pid: int, recorded: str | None) -> bool:
    """Is ``pid`` alive, this user's, and the very process recorded (when its identity was
    recorded: older records only have the owner to go by)?"""
    now = identity(pid)
    if now is None or now.split(":")[0] != str(os.getuid()):
        return False
    return recorded is None or now == recorded


def argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def send(pid: int, recorded: str | None, sig: int) -> bool:
    """Signal the recorded process, never whoever has its pid now: the pid is pinned with a
    pidfd before its identity is checked. True if the signal was sent."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if not is_ours(pid, recorded):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:  # no pidfds here: the narrow window between check and kill remains
            os.kill(pid, sig)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
