"""Starting a job's supervisor, detached (its own session, outliving the terminal that
submitted it), with the controller's own settings: ``ORCHESTRATOR_HOME``, this very package
first on ``PYTHONPATH``, nothing from the current directory (``PYTHONSAFEPATH``), the home
as its directory, its output to the job's ``controller.log``. None of them reaches a worker,
which starts from the world kept with the job (orchestrator/world.py).

Two ways, the same process afterwards:

- a fresh interpreter, ``python -m orchestrator.supervisor JOB --supervise``: for API
  callers, whose process may hold threads, connections and state of their own;
- a fork of the calling process (``fork=True``: the orchestrator command), which has
  imported most of what a controller needs already (pydantic's spec models, the store):
  a third of a second sooner on every ``submit``. Taken only from a process with one
  thread, with the store's connection closed across it (SQLite's locks and connections
  must not cross a fork); the fork is detached twice, its descriptors closed but its log,
  its inherited objects frozen (nothing of its parent's is finalized in it), and it never
  returns into its parent's code.

Called by the API (``submit``, ``resume``, and when a waiter finds the controller gone). It
may call the store and the supervisor.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.store import Store

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def start_supervisor(store: Store, job_id: str, *, resume: bool, fork: bool = False) -> int:
    """Start the job's supervised controller, detached; record and return its pid."""
    log_path = store.job_dir(job_id) / "controller.log"
    env = {"ORCHESTRATOR_HOME": str(store.home),
           # It must import this very package, installed or not, and nothing from the
           # current directory (a queue.py beside the spec).
           "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                         if p),
           "PYTHONSAFEPATH": "1"}
    argv = [job_id, "--supervise", *(["--resume"] if resume else [])]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        if fork and _one_thread():
            store.close()  # no SQLite connection may cross the fork
            try:
                pid = _fork(fd, env, argv, str(store.home))
            finally:
                store.reopen()
        else:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.supervisor", *argv],
                stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                env={**os.environ, **env}, cwd=str(store.home),
                start_new_session=True)  # outlives the terminal that submitted it
            pid = proc.pid
    finally:
        os.close(fd)
    store.claim_supervisor(job_id, pid)
    return pid


def _one_thread() -> bool:
    try:
        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _fork(log: int, env: dict[str, str], argv: list[str], home: str) -> int:
    """The supervisor as a detached fork of this process; its pid."""
    pid_r, pid_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    gc.collect()  # what is garbage now is finalized here, not in the child
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's exit code is all it says)
        code = 1
        leave: Callable[[int], object] = os._exit
        try:
            gc.freeze()  # never finalize what the parent holds (its store, its files)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.write(pid_w, b"%d" % os.getpid())
            null = os.open(os.devnull, os.O_RDWR)
            for fd, target in ((null, 0), (log, 1), (log, 2)):
                os.dup2(fd, target)
            os.closerange(3, _fd_limit())
            os.environ.update(env)
            os.chdir(home)
            # As a fresh ``python -m`` with PYTHONSAFEPATH would have it: this package first,
            # the user's PYTHONPATH after it, no script or current directory.
            sys.path[:] = [PACKAGE_ROOT, *(p for p in sys.path[1:] if p and p != PACKAGE_ROOT)]
            sys.argv = ["orchestrator.supervisor", *argv]
            from orchestrator import supervisor

            leave = supervisor.leave
            code = supervisor.main(argv)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            leave(code)
    os.close(pid_w)
    os.waitpid(child, 0)  # the first child exits at once: nothing left to reap
    with os.fdopen(pid_r, "rb") as said:
        pid = said.read(32)
    if not pid:
        raise OSError("the supervisor's fork did not start")
    return int(pid)


def _fd_limit() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 65536
