"""Starting a job's supervisor, detached (its own session, outliving the terminal that
submitted it), with the controller's own settings: ``ORCHESTRATOR_HOME``, this very package
alone on ``PYTHONPATH`` (never the user's: a ``queue.py`` there would come before the
standard library's), nothing from the current directory (``PYTHONSAFEPATH``), the home as
its directory, its output to the job's ``controller.log``. None of them reaches a worker,
which starts from the world kept with the job (orchestrator/world.py), the user's
``PYTHONPATH`` included.

Two ways, the same process afterwards:

- a fresh interpreter, ``python -m orchestrator.supervisor JOB --supervise``: for API
  callers, whose process may hold threads, connections and state of their own;
- a fork of the calling process (``Forked``: the orchestrator command), the sooner on every
  ``submit``. The command forks it first of all, before it imports the API (``fork_early``,
  orchestrator/entry.py), and before any database is open (SQLite's locks and connections
  must not cross a fork); the fork imports what a controller needs (the spec's models, the
  controller, paramiko) and makes the agent's payload while the command imports, reads the
  spec and checks it, instead of after the job is recorded: about 0.1 s of every submit
  (docs/benchmarks.md). Once the job is recorded it is told to go, and a submit that
  fails tells it nothing: it exits having done nothing. (``submit(fork=True)`` without an
  early fork forks once the spec is valid.) Taken only from a process with one thread that
  has imported nothing from the user's paths (``PYTHONPATH``, the script's or current
  directory): a fork keeps what its parent imported. The fork searches none of them, is
  detached twice, its descriptors closed, its inherited objects frozen (nothing of its
  parent's is finalized in it), and it never returns into its parent's code.

Called by the API (``submit``, ``resume``, and when a waiter finds the controller gone). It
may call the store and the supervisor.
"""

from __future__ import annotations

import gc
import importlib.machinery
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # only its instances: the command forks before it imports the store
    from orchestrator.store import Store

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def start_supervisor(store: Store, job_id: str, *, resume: bool) -> int:
    """Start the job's supervised controller in a fresh interpreter, detached; record and
    return its pid."""
    fd = os.open(_log(store, job_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.supervisor", *_argv(job_id, resume)],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
            env={**os.environ, **_env(store)}, cwd=str(store.home),
            start_new_session=True)  # outlives the terminal that submitted it
    finally:
        os.close(fd)
    store.claim_supervisor(job_id, proc.pid)
    return proc.pid


def _log(store: Store, job_id: str) -> str:
    return str(store.job_dir(job_id) / "controller.log")


def _argv(job_id: str, resume: bool) -> list[str]:
    return [job_id, "--supervise", *(["--resume"] if resume else [])]


def _env(store: Store) -> dict[str, str]:
    # It must import this very package, installed or not, and nothing from the current
    # directory (a queue.py beside the spec) or the user's PYTHONPATH (the workers get that
    # from the world kept with the job).
    return {"ORCHESTRATOR_HOME": str(store.home), "PYTHONPATH": PACKAGE_ROOT,
            "PYTHONSAFEPATH": "1"}


def _user_paths() -> set[str]:
    """The entries of this process's ``sys.path`` that a controller must not search: the
    user's ``PYTHONPATH`` and the script's or current directory (``sys.path[0]``), as
    written there and made absolute; never this package's own directory."""
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if sys.path and not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
        given.append(sys.path[0])
    real = {os.path.realpath(p) for p in given} - {os.path.realpath(PACKAGE_ROOT)}
    return {form for p in sys.path if os.path.realpath(p) in real
            for form in (p, os.path.abspath(p))}


def _shadowing(paths: set[str]) -> str | None:
    """A file or directory in ``paths`` named like a module this process imported (a fork
    would hold whatever of it ran, even where it put the standard library's module in its
    own place); None where nothing is."""
    imported = {name for name in sys.modules if "." not in name}
    for path in {os.path.realpath(p) for p in paths}:
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    stem = entry.name if entry.is_dir() else next(
                        (entry.name[:-len(s)] for s in _SUFFIXES if entry.name.endswith(s)),
                        None)
                    if stem in imported:
                        return entry.path
        except NotADirectoryError:  # a zip: what it holds may have run
            return path
        except OSError:  # none there, or unreadable: nothing came from it
            continue
    return None


_SUFFIXES = tuple(importlib.machinery.all_suffixes())


class Forked:
    """A supervisor forked from this process, waiting to be told which job is its own."""

    def __init__(self, pid: int, pipe: int):
        self.pid = pid
        self._pipe: int | None = pipe

    @classmethod
    def start(cls) -> Forked | None:
        """Fork it now (None: this process has threads, or holds a module of the user's
        paths, and a fresh interpreter it is)."""
        if not _one_thread():
            return None
        user_paths = _user_paths()
        if _shadowing(user_paths) is not None:
            return None
        go_r, go_w = os.pipe()
        pid_r, pid_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        gc.collect()  # what is garbage now is finalized here, not in the child
        child = os.fork()
        if child == 0:  # pragma: no cover (the child's exit code is all it says)
            _child(go_r, pid_w, user_paths)
        os.close(go_r)
        os.close(pid_w)
        os.waitpid(child, 0)  # the first child exits at once: nothing left to reap
        with os.fdopen(pid_r, "rb") as said:
            pid = said.read(32)
        if not pid:
            os.close(go_w)
            raise OSError("the supervisor's fork did not start")
        return cls(int(pid), go_w)

    def go(self, store: Store, job_id: str, *, resume: bool = False) -> int:
        """Tell it its job (recorded by now); record and return its pid."""
        pipe, self._pipe = self._pipe, None
        assert pipe is not None
        order = json.dumps({"argv": _argv(job_id, resume), "env": _env(store),
                            "home": str(store.home), "log": _log(store, job_id)}).encode()
        try:
            with os.fdopen(pipe, "wb") as f:
                f.write(order)
        except OSError as exc:
            raise OSError(exc.errno, "the supervisor exited before it was told its job") \
                from exc
        store.claim_supervisor(job_id, self.pid)
        return self.pid

    def abandon(self) -> None:
        """No job for it (a check failed): it reads the end of its pipe and exits."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            os.close(pipe)


_early: Forked | None = None


def fork_early() -> None:
    """Fork the supervisor now, for the job this process is about to submit (its first
    thing: orchestrator/entry.py); ``forked`` hands it out. Nothing is lost where it cannot
    be forked: ``forked`` tries again then."""
    global _early
    try:
        _early = Forked.start()
    except OSError:
        _early = None


def forked() -> Forked | None:
    """The supervisor ``fork_early`` forked, else one forked now (None: this process may not
    fork it, and a fresh interpreter it is)."""
    global _early
    early, _early = _early, None
    return early if early is not None else Forked.start()


def _one_thread() -> bool:
    try:
        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _child(go: int, said: int, user_paths: set[str]
           ) -> NoReturn:  # pragma: no cover (a forked child)
    """The forked supervisor: detached, it imports what a controller needs, waits for its
    job, and runs it as ``python -m orchestrator.supervisor`` would."""
    code = 1
    leave: Callable[[int], object] = os._exit
    try:
        gc.freeze()  # never finalize what the parent holds
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.write(said, b"%d" % os.getpid())
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        os.closerange(3, go)
        os.closerange(go + 1, _fd_limit())
        os.chdir("/")
        # As a fresh ``python -m`` with PYTHONSAFEPATH and our PYTHONPATH would have it (_env):
        # this package first, no script or current directory, nothing of the user's
        # PYTHONPATH; set before it imports anything more.
        sys.path[:] = [PACKAGE_ROOT, *(p for p in sys.path[1:]
                                       if p and p != PACKAGE_ROOT and p not in user_paths)]
        from orchestrator import supervisor
        from orchestrator.transport import ssh  # noqa: F401 (paramiko, for the connects)

        supervisor.prepare()  # while the command checks: off the way to the first login

        leave = supervisor.leave
        with os.fdopen(go, "rb") as pipe:
            order = pipe.read()
        if not order:  # no job: the submit failed its checks
            code = 0
            raise SystemExit(0)
        told = json.loads(order)
        log = os.open(told["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                      0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.update(told["env"])
        os.chdir(told["home"])
        sys.argv = ["orchestrator.supervisor", *told["argv"]]
        code = supervisor.main(told["argv"])
    except SystemExit:
        pass
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        leave(code)
    os._exit(code)


def _fd_limit() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 65536
