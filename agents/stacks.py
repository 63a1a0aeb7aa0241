"""Where is each rank? Python stacks of live workers (py-spy where it can attach, else the
faulthandler hook of the sitecustomize shim), and the flight recorder dumps each rank's
sampler writes when asked (see orchestrator/hang.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Any

from agents import containment
from agents.paths import cache, traces
from agents.processes import processes_with_token


def py_spy() -> str | None:
    """py-spy beside this python, else on PATH; ``ORCHESTRATOR_PY_SPY=none`` never uses it
    (a site where ptrace is not wanted), another value names it."""
    chosen = os.environ.get("ORCHESTRATOR_PY_SPY")
    if chosen:
        return None if chosen == "none" else chosen
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def one_stack(pid: int, rank: int, directory: str, attempt: int) -> dict[str, Any]:
    """One process's stack, and how it was taken."""
    tool = py_spy()
    error = "py-spy not found"
    if tool:
        try:
            done = containment.run([tool, "dump", "--pid", str(pid)], timeout=15)
            if done.returncode == 0 and done.stdout.strip():
                return {"method": "py-spy", "text": done.stdout[-65536:]}
            error = (done.stderr or done.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
    stack_dir = os.path.join(directory, f"attempt-{attempt}")
    if os.path.exists(os.path.join(stack_dir, f"hook-{pid}")):  # or SIGUSR2 would kill it
        path = os.path.join(stack_dir, f"stack-{rank}.txt")
        try:
            before = os.path.getsize(path)
            os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and os.path.getsize(path) <= before:
                time.sleep(0.05)
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(before)
                text = f.read(65536)
            if text.strip():
                return {"method": "faulthandler", "text": text,
                        "note": f"py-spy could not attach: {error}"}
        except OSError as exc:
            error += f"; faulthandler: {exc}"
    return {"method": "none", "text": "", "error": error}


def rank_pids(workers: list[Any], token: str) -> list[tuple[int, int]]:
    """(rank, pid) of every live worker; torchrun's workers by their RANK."""
    out = []
    for w in workers:
        if w.proc.poll() is not None:
            continue
        if w.rank is not None:
            out.append((int(w.rank), w.proc.pid))
            continue
        for pid in processes_with_token(token):  # c10d: torchrun's children
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            except (OSError, ValueError):
                continue
            if parent == w.proc.pid and b"RANK" in env:
                out.append((int(env[b"RANK"]), pid))
    return out


#: The most of one flight recorder dump the agent copies aside (and so sends): a bigger one
#: stays where its rank wrote it, named in the reply as refused (not cut: a truncated
#: pickle is of no use). torch's default 2,000 entries with call sites 30 frames deep made
#: 0.4 MiB (gloo, torch 2.13).
TRACE_MAX_BYTES = 64 * 1024 * 1024
KEPT = "on-hang"  # the copies, beside the dumps
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Never blocks (a FIFO), never becomes a controlling terminal; a device is never opened at
# all (see _open_dump).
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def trace_files(traces_dir: str, stack_dir: str, ranks: list[int], since: float,
                deadline: float) -> tuple[dict[str, str], dict[str, str]]:
    """The flight recorder dumps the ranks wrote since ``since`` (waiting until ``deadline``,
    monotonic, for the last of them), copied aside: a dump still being completed must not
    change under the controller's read. (rank -> the copy, rank -> why its dump was not
    taken.) A worker writes where the dumps go: what it leaves there that is not a regular
    file of this user's (a symlink to a file it may not read, a FIFO, a hard link), or lies
    under a directory swapped for a symlink, is refused for that rank alone."""
    if not traces_dir:  # no attempt started here
        return {}, {}
    try:
        where = open_dir(traces_dir)
    except FileNotFoundError:
        return {}, {}
    except OSError as exc:
        return {}, {str(r): str(exc) for r in ranks}
    try:
        return _collect(where, traces_dir, stack_dir, ranks, since, deadline)
    finally:
        os.close(where)


def _collect(where: int, traces_dir: str, stack_dir: str, ranks: list[int], since: float,
             deadline: float) -> tuple[dict[str, str], dict[str, str]]:
    done = os.path.join(stack_dir, "flight-recorder-done-")
    names, complete = dict[str, str](), set[int]()
    while True:
        for r in ranks:
            try:
                name = f"nccl_trace_rank_{r}"
                if os.stat(name, dir_fd=where, follow_symlinks=False).st_mtime >= since - 1:
                    names[str(r)] = name
                if os.stat(f"{done}{r}").st_mtime >= since - 1:
                    complete.add(r)
            except OSError:
                pass
        if len(complete) == len(ranks) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    found, refused = dict[str, str](), dict[str, str]()
    if not names:
        return found, refused
    try:
        try:
            os.mkdir(KEPT, 0o700, dir_fd=where)
        except FileExistsError:
            pass
        kept = _open_below(where, KEPT, traces_dir)
    except OSError as exc:
        return found, {key: str(exc) for key in names}
    try:
        for key, name in names.items():
            try:
                _keep(where, kept, name, traces_dir)
                found[key] = os.path.join(traces_dir, KEPT, name)
            except OSError as exc:
                refused[key] = str(exc)
    finally:
        os.close(kept)
    return found, refused


def _keep(where: int, kept: int, name: str, traces_dir: str) -> None:
    """Copy one dump into ``kept``, holes kept as holes; OSError saying why not."""
    src, st = _open_dump(where, name)
    try:
        if st.st_size > TRACE_MAX_BYTES:
            raise PermissionError(
                f"{name}: {st.st_size} bytes, more than the {TRACE_MAX_BYTES >> 20} MiB the "
                f"agent collects of a dump; left where its rank wrote it: "
                f"{os.path.join(traces_dir, name)}")
        with contextlib.suppress(FileNotFoundError):  # a symlink made first: not written through
            os.unlink(name, dir_fd=kept)
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=kept)
        try:
            copy_sparse(src, dst, st.st_size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def copy_sparse(src: int, dst: int, size: int) -> None:
    """The first ``size`` bytes of ``src`` into ``dst`` (empty), the holes left holes: a
    sparse file costs on disk what its data costs, not its length."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
            end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole to the end
                break
            if exc.errno != errno.EINVAL:  # EINVAL: no SEEK_DATA here, all of it is data
                raise
            start, end = pos, size
        while start < end:
            block = os.pread(src, min(1024 * 1024, end - start), start)
            if not block:  # truncated under us: the rest reads as zeros
                end = size
                break
            written = 0
            while written < len(block):
                written += os.pwrite(dst, block[written:], start + written)
            start += len(block)
        pos = end
    os.ftruncate(dst, size)


def open_trace(path: str) -> int:
    """A dump under this user's traces directory, open for reading (the controller's
    ``read_trace``), under the rules of ``trace_files``: PermissionError otherwise."""
    where = open_dir(os.path.dirname(path))
    try:
        return _open_dump(where, os.path.basename(path))[0]
    finally:
        os.close(where)


def open_dir(path: str) -> int:
    """A directory under this user's traces directory, opened one component at a time from
    the cache without following a symlink (a worker could have swapped any of them for
    one): PermissionError naming the component that is not a directory."""
    base = cache()
    rel = os.path.relpath(os.path.normpath(os.path.abspath(path)), base)
    parts = rel.split(os.sep)
    if os.path.join(base, parts[0]) != traces():
        raise PermissionError(f"not a flight recorder dump: {path!r}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            inner = _open_below(fd, part, path)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_below(fd: int, part: str, path: str) -> int:
    try:
        return os.open(part, _DIR, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionError(f"{path}: {part} is not a directory (a symlink?): "
                                  "refused") from None
        raise


def _open_dump(where: int, name: str) -> tuple[int, os.stat_result]:
    """``name`` in the directory ``where``, opened only if it is a regular file of this
    user's with one link (looked at before it is opened, so that no device is ever opened,
    and again once open); PermissionError saying what it is."""
    _check(name, os.stat(name, dir_fd=where, follow_symlinks=False))
    try:
        fd = os.open(name, _FILE, dir_fd=where)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # made a symlink since
            raise PermissionError(f"{name} is a symlink, not a regular file: refused") from None
        raise
    try:
        st = os.fstat(fd)
        _check(name, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _check(name: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((f"{k}, not" for test, k in _KINDS if test(st.st_mode)), "not")
        raise PermissionError(f"{name} is {kind} a regular file: refused")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{name} belongs to uid {st.st_uid}, not {os.getuid()}: refused")
    if st.st_nlink != 1:
        raise PermissionError(f"{name} has {st.st_nlink} links (a hard link to another "
                              "file?): refused")
