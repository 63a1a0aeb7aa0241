"""The job's ``setup:`` on a node: run once per key and machine, within its time limit.

The script arrives over the channel and runs from a 0600 file in the agent's private
directory (``/bin/sh <file>``), never as an argument: what it holds (a token in a ``pip``
index URL, a password) is in no process's command line. Its stdin is /dev/null, as a
script's commands may read it. Past ``timeout`` its process group is stopped (SIGTERM, then
SIGKILL) and the result says so.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from agents.containment import spawn
from agents.netinfo import machine_id
from agents.paths import Lock, cache
from agents.processes import TOKEN_VAR, as_launched
from agents.text import text

TAIL = 20  # lines of a setup's output kept for the failure message
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for a setup past its time


@dataclass
class SetupResult:
    exit_code: int
    cached: bool = False  # done before on this machine: not run
    tail: tuple[str, ...] = ()
    timed_out: bool = False


def run_setup(key: str, script: str, workdir: str, env: dict[str, str], token: str,
              emit: Callable[[list[str]], None], max_line: int, private_dir: str,
              timeout: float | None) -> SetupResult:
    """Run the job's setup script once per key and machine: it is skipped where that key
    succeeded before. ``emit`` gets its output in batches while it runs."""
    if len(key) != 32 or not all(c in "0123456789abcdef" for c in key):
        raise ValueError(f"bad setup key {key!r}")
    marks = os.path.join(cache(), "setup")
    os.makedirs(marks, mode=0o700, exist_ok=True)
    # The key names the node as the controller does; the machine is added here: nodes that
    # share a home (NFS, every Slurm site) each run their own setup.
    marker = f"{key}.{machine_id()}"
    done = os.path.join(marks, f"{marker}.ok")
    with Lock(os.path.join(marks, f"{marker}.lock")):  # one run per key and machine
        if os.path.exists(done):
            return SetupResult(0, cached=True)
        path = os.path.join(private_dir, f"setup-{key}.sh")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(script)
        try:
            result = run_command(["/bin/sh", path], workdir,
                                 {**os.environ, **env, TOKEN_VAR: token}, emit, max_line, timeout)
        finally:
            os.unlink(path)
        if result.exit_code == 0 and not result.timed_out:
            open(done, "w").close()
        return result


def run_check(argv: list[str], workdir: str, env: dict[str, str], token: str, max_line: int,
              timeout: float, min_free_bytes: int | None) -> tuple[list[str], tuple[str, ...]]:
    """A node's health check before an attempt: free space in the workdir and the cache, then
    the job's own ``health.node_check`` command (nonzero, or past ``timeout``, is unhealthy).
    Returns the problems found (none: healthy) and the command's last output lines."""
    problems: list[str] = []
    if min_free_bytes is not None:
        # The workdir (checkpoints, outputs) and the cache (synced trees), once each where
        # they share a filesystem.
        seen: set[int] = set()
        for where in (os.path.expanduser(workdir or "."), cache()):
            try:
                st = os.statvfs(where)
                fs = os.stat(where).st_dev
            except OSError as exc:
                problems.append(f"cannot read the free space of {where}: {exc.strerror or exc}")
                continue
            free = st.f_bavail * st.f_frsize
            if fs not in seen and free < min_free_bytes:
                problems.append(f"{free / 2**30:.2f} GiB free in {where}, fewer than "
                                f"health.min_free_bytes ({min_free_bytes / 2**30:.2f} GiB)")
            seen.add(fs)
    if not argv:
        return problems, ()
    result = run_command(argv, workdir, {**os.environ, **env, TOKEN_VAR: token},
                         lambda _: None, max_line, timeout)
    if result.timed_out:
        problems.append(f"health.node_check did not finish within {timeout:g}s: stopped")
    elif result.exit_code != 0:
        how = f"exit code {result.exit_code}" if result.exit_code > 0 else \
            f"signal {-result.exit_code}"
        problems.append(f"health.node_check failed ({how})")
    return problems, result.tail


def run_command(argv: list[str], workdir: str, env: dict[str, str],
                emit: Callable[[list[str]], None], max_line: int, timeout: float | None
                ) -> SetupResult:
    """``argv`` in a process group of its own (contained, stdin /dev/null, output and
    stderr together, its last lines kept); past ``timeout`` the group is stopped."""
    try:
        proc = spawn(argv, cwd=os.path.expanduser(workdir or "."),
                     env=env,  # the token: a cancel's sweep finds it
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, start_new_session=True,
                     preexec_fn=as_launched)
    except OSError as exc:
        return SetupResult(127, tail=(str(exc),))
    assert proc.stdout is not None
    reader = _Lines(proc.stdout.fileno(), max_line, emit)
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    while not reader.ended and left() != 0.0:
        reader.read(min(left() or 1.0, 1.0))
    timed_out = not reader.ended
    if not timed_out:
        try:
            proc.wait(left())  # its output may end before it does (exec >/dev/null)
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _stop_group(proc)
        while reader.read(0):  # what it printed last (a child it left may hold the pipe)
            pass
    reader.flush()
    proc.stdout.close()
    return SetupResult(proc.wait(), tail=tuple(reader.tail), timed_out=timed_out)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the setup's process group, SIGKILL after STOP_GRACE. Its leader is not
    reaped before the SIGKILL, so the group id is still its own, never another's."""
    _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while time.monotonic() < deadline and os.waitid(
            os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        time.sleep(0.05)
    _killpg(proc.pid, signal.SIGKILL)


def _killpg(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except OSError:
        pass


class _Lines:
    """A pipe read as lines (cut at ``max_line`` bytes), in batches to ``emit``."""

    def __init__(self, fd: int, max_line: int, emit: Callable[[list[str]], None]):
        self.fd, self.max_line, self.emit = fd, max_line, emit
        self.poll = select.poll()
        self.poll.register(fd, select.POLLIN | select.POLLHUP)
        self.carry = b""
        self.batch: list[str] = []
        self.sent = time.monotonic()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self.ended = False

    def read(self, wait: float) -> bool:
        """Read what is there within ``wait`` seconds; False when there was nothing."""
        if self.ended or not self.poll.poll(max(0, int(wait * 1000))):
            return False
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.ended = True
            return False
        data = self.carry + chunk
        *lines, self.carry = data.split(b"\n")
        while len(self.carry) >= self.max_line:  # a line too long to wait for: cut it
            lines.append(self.carry[:self.max_line])
            self.carry = self.carry[self.max_line:]
        for raw in lines:
            line = text(raw)
            self.tail.append(line)
            self.batch.append(line)
        if len(self.batch) >= 200 or time.monotonic() - self.sent > 0.1:
            self.flush(keep_carry=True)
        return True

    def flush(self, keep_carry: bool = False) -> None:
        if not keep_carry and self.carry:
            line = text(self.carry)
            self.carry = b""
            self.tail.append(line)
            self.batch.append(line)
        if self.batch:
            self.emit(self.batch)  # waits if far behind
            self.batch, self.sent = [], time.monotonic()
