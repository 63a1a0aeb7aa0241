"""The controller's process: the supervisor that keeps it alive, and its Slurm allocation.

``submit`` starts ``python -m orchestrator.supervisor JOB_ID --supervise``: a small parent
(``_supervise``) that forks the controller and starts it again, resuming, whenever it dies
before the job has ended. The controller is **crash-only** (orchestrator/controller.py): an
exception of ours, like a SIGKILL or the OOM killer, leaves the workers running on their
agents, and a new controller takes over after a backoff (1, 2, 4 ... 30 s). One that keeps
dying (the same error three times in a row, or six deaths in ten minutes) is *failing*: the
workers go on for the agents' ``controller_grace`` while ``status`` names the error;
``resume`` tries again, ``cancel`` ends the job at once, and otherwise the job ends FAILED
with cause CONTROLLER_FAILED once the grace is over, no restart charged. A controller paused
on a home it cannot write (orchestrator/pause.py) hands over to a fresh one at once when it
can; one that could not even start waits for room here.

One controller per job, whoever started it (a lock on the job's directory). A job on Slurm
gets its allocation here first (``salloc``, or the one the job was submitted in) and gives
it back when it ends, also when the supervisor gives up.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator import failpoints, reputation, slurm
from orchestrator.attempt import Failure
from orchestrator.controller import Controller, raise_open_files_limit
from orchestrator.errors import (
    JobNotFoundError,
    LaunchError,
    OrchestratorError,
    SpecError,
    StoreUnwritable,
)
from orchestrator.pids import pid_namespace
from orchestrator.spec import JobSpec
from orchestrator.state import FailureCause, JobState
from orchestrator.store import Store, default_home
from orchestrator.transport import Connector
from orchestrator.transport.base import ConnectionFactory, agent_payload
from orchestrator.transport.slurm import SlurmConnector
from orchestrator.world import UserWorld

log = logging.getLogger("orchestrator.controller")


def _controller_main(job_id: str, resume: bool) -> int:
    store = Store(durable=True)
    # One controller per job, whoever started it (the supervisor, resume, a reader): two would
    # take the agents from each other.
    lock = open(store.job_dir(job_id) / "controller.lock", "a")  # noqa: SIM115 (held until exit)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("job %s already has a live controller", job_id)
        return ANOTHER_CONTROLLER
    job = store.get_job(job_id)
    if job.state.is_at_rest():
        log.info("job %s already ended (%s)", job_id, job.state.value)
        return 0
    store.claim_controller(job_id, os.getpid(), socket.gethostname(), pid_namespace())
    store.keep_reserve()
    log.info("state store %s: %s journal (%s)", store.home / "state.db", store.journal,
             store.journal_why)
    failpoints.arm(store.job_dir(job_id))
    try:
        controller = _controller(store, job_id, resume or job.state != JobState.PENDING)
    except StoreUnwritable:
        raise  # a pause, not a usage error: the supervisor waits for room
    except OrchestratorError as exc:  # a spec or a world it cannot use: said, not retried
        log.error("%s", exc)
        return 2
    if controller is None:
        return 1  # the job ended (or waits for a resume): recorded already
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.request_exit())
    # `cancel` when not even its request can be written (a full home): stop the workers.
    signal.signal(signal.SIGUSR1, lambda *_: controller.request_cancel())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    state = controller.run()
    if controller.hand_over:
        return HAND_OVER
    return 0 if state == JobState.SUCCEEDED else 1


def _controller(store: Store, job_id: str, resume: bool,
                acquire: bool = True) -> Controller | None:
    """The job's controller, with its connector (and its Slurm allocation, got first); None
    when the allocation cannot be had (the job's end is recorded then), or, without
    ``acquire`` (ending a job), when it has none granted and kept."""
    job = store.get_job(job_id)
    secret = job.secret
    if not secret:  # a job recorded before secrets existed
        secret = secrets.token_hex(16)
        store.update_job(job_id, secret=secret)
    spec = JobSpec.model_validate_json(job.spec_json)
    saved = store.world(job_id)
    # Local relays and Slurm steps start in the submitter's world, never in ours (a job of
    # an older version kept none: then this process's, as before).
    world = UserWorld.from_dict(saved) if saved is not None else UserWorld.capture()
    connect: ConnectionFactory = Connector(world)
    on_end = None
    if spec.slurm is not None:
        if acquire:
            allocation = _slurm_allocation(store, job_id, spec)
        else:  # only the one it has: never a new salloc just to end a job
            saved = job.slurm or {}
            granted = saved.get("nodes") and not saved.get("released")
            allocation = slurm.Allocation.from_dict(saved) if granted else None
        if allocation is None:
            return None
        spec = slurm.spec_with_nodes(spec, allocation)
        connect = SlurmConnector(allocation.job_id, world)
        on_end = lambda: _release(store, job_id, allocation)  # noqa: E731
    return Controller(store, job_id, spec, job.spec_dir, connect, secret=secret,
                      resume=resume, on_end=on_end)


def _slurm_allocation(store: Store, job_id: str, spec: JobSpec) -> slurm.Allocation | None:
    """The job's Slurm allocation (recorded, or requested now). A cancel or a SIGTERM while
    it is pending cancels the request; an allocation that cannot be had fails the job with
    one line naming why. None when the job does not go on."""
    told: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # the controller's own handlers come later
        signal.signal(sig, lambda signum, _: told.append(signum))

    def record(allocation: slurm.Allocation) -> None:
        hosts = [n.host for n in slurm.spec_with_nodes(spec, allocation).nodes]
        store.set_slurm(job_id, allocation.to_dict(), hosts if allocation.nodes else None)
        log.info("slurm allocation %s %s", allocation.job_id,
                 f"granted: {','.join(allocation.nodes)}" if allocation.nodes else "requested")

    held = sorted(reputation.quarantined(store))
    try:
        return slurm.acquire(spec, f"orchestrator-{job_id}", store.get_job(job_id).slurm,
                             record=record,
                             stop=lambda: bool(told) or store.job_state(job_id)[1],
                             exclude=held)
    except slurm.AllocationWaitStopped:
        if store.job_state(job_id)[1]:
            store.set_state(job_id, JobState.CANCELLED)
        return None
    except (LaunchError, SpecError) as exc:
        log.error("%s", exc)
        store.set_state(job_id, JobState.FAILED, failure={
            "cause": FailureCause.LAUNCH_FAILED.value, "message": str(exc)})
        return None


def _release(store: Store, job_id: str, allocation: slurm.Allocation) -> None:
    """Give the allocation back to Slurm if the orchestrator requested it."""
    if allocation.owned and slurm.release(allocation):
        allocation.released = True
        store.set_slurm(job_id, allocation.to_dict())
        log.info("slurm allocation %s released", allocation.job_id)


# Exit codes of a controller, beside 0 (succeeded), 1 (failed or cancelled) and 2 (usage).
ANOTHER_CONTROLLER = 75  # the job has a live controller already
HAND_OVER = 76  # paused, and the home can be written again: start a fresh one at once
CRASHED = 70  # an exception of ours: the workers go on (orchestrator/controller.py)
UNWRITABLE = 77  # the home cannot be written: start one again once it can

BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # seconds before each new start after deaths
SAME_ERROR_LIMIT = 3  # the same error this many times in a row: the controller is failing
MAX_DEATHS, DEATHS_WINDOW = 6, 600.0  # or this many deaths of any kind within the window
GRACE_MARGIN = 5.0  # seconds after the agents' controller_grace before the job is ended
ROOM_LOOK = 2.0  # seconds between two looks at a home that cannot be written


class Deaths:
    """A job's controller deaths: how long to wait before the next start, or that it keeps
    failing (None). Pure: the supervisor says when, what (the error's signature), and how
    long the controller had lived (one that ran longer than DEATHS_WINDOW starts the count
    of the same error again: three OOM kills a week apart are not a failing controller)."""

    def __init__(self) -> None:
        self.seen: deque[tuple[float, str]] = deque()
        self.same = 0

    def add(self, at: float, signature: str, lived: float = 0.0) -> float | None:
        repeated = self.seen and self.seen[-1][1] == signature and lived <= DEATHS_WINDOW
        self.same = self.same + 1 if repeated else 1
        self.seen.append((at, signature))
        while self.seen and at - self.seen[0][0] > DEATHS_WINDOW:
            self.seen.popleft()
        if self.same >= SAME_ERROR_LIMIT or len(self.seen) >= MAX_DEATHS:
            return None
        return BACKOFF[min(len(self.seen), len(BACKOFF)) - 1]


class _Told:
    """Whether the supervisor was told to exit (SIGTERM, SIGINT: ``set`` from the signal
    handler, a plain flag), and sleeps it cuts short: a supervisor told to exit starts no
    controller and ends no job any more."""

    def __init__(self) -> None:
        self.told = False

    def set(self) -> None:
        self.told = True

    def __bool__(self) -> bool:
        return self.told

    def sleep(self, seconds: float) -> bool:
        """Sleep; False when told to exit meanwhile (looked at every 0.2 s)."""
        deadline = time.monotonic() + seconds
        while not self.told and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.2, left))
        return not self.told


def _supervise(job_id: str, resume: bool) -> int:
    """Run the controller as a child and start it again, resuming, whenever it dies before
    the job has ended: at once after a pause (HAND_OVER), once the home can be written
    (UNWRITABLE), after a backoff after a death (a crash, the OOM killer, a stray kill).
    A controller that keeps failing ends the job (``_failing``)."""
    prepare()
    store = Store()
    store.claim_supervisor(job_id, os.getpid())
    child: _Forked | None = None
    told = _Told()

    def forward(signum: int, _frame: Any) -> None:  # the controller decides: cancel, or exit
        told.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    deaths = Deaths()
    store.close()
    while not told:
        child = _Forked(functools.partial(_run_controller, job_id, resume))
        code = child.wait()
        resume = True
        if told or code == ANOTHER_CONTROLLER:
            return 0
        if code == HAND_OVER:
            continue
        report = child.report or {}
        if code == UNWRITABLE and _wait_for_room(job_id, str(report.get("reason")), told):
            continue  # a home that was full: not a death (one that had room was: below)
        state = _job_state(job_id, told)
        if state is None or state.is_at_rest():
            return 0
        how = report.get("error") or (f"code {code}" if code >= 0 else
                                      f"killed by {signal.Signals(-code).name}")
        signature = report.get("signature") or how
        delay = deaths.add(time.monotonic(), signature, child.lived)
        if delay is None:
            if not _failing(job_id, how, signature, len(deaths.seen), told):
                return 0
            deaths = Deaths()  # `resume` asked to try again
            continue
        log.warning("controller died (%s) while the job was %s: a new one in %gs", how,
                    state.value, delay)
        told.sleep(delay)
    return 0


def prepare() -> None:
    """What every controller it forks would otherwise make on its way to its first node:
    the agent's payload, every agent module's bytecode compressed (0.02-0.03 s here from
    Python's bytecode cache, 0.1 s without one). Made once, here, each controller inherits
    it."""
    agent_payload()


def _job_state(job_id: str, told: _Told) -> JobState | None:
    """The job's state; while the home cannot be read (an NFS server away), looked at again.
    None when told to exit meanwhile, or when the home no longer has the job (removed, or
    another home mounted there): nothing is left to supervise."""
    while True:
        try:
            store = Store()
            try:
                return store.job_state(job_id)[0]
            finally:
                store.close()
        except JobNotFoundError:
            log.error("the job is no longer in %s: nothing to supervise", default_home())
            return None
        except OrchestratorError as exc:
            log.error("cannot read the job's state (%s): looking again", exc)
        if not told.sleep(ROOM_LOOK):
            return None


def _wait_for_room(job_id: str, reason: str, told: _Told) -> bool:
    """After a controller that could not write at its start: until the home can be written
    again (True), or the supervisor is told to exit (False). False at once when the home
    had room at the first look: then that was a death like any other."""
    log.error("the controller cannot write (%s): a new one starts once it can", reason)
    floor, waited = None, False
    while told.sleep(ROOM_LOOK):
        try:
            store = Store()
            try:
                if floor is None:
                    floor = JobSpec.model_validate_json(
                        store.get_job(job_id).spec_json).logs.min_free_bytes
                if store.room_again(job_id, floor):
                    return waited
            except StoreUnwritable:
                store.note_pause(job_id, {"since": time.time(), "reason": reason})
            finally:
                store.close()
        except OrchestratorError:
            pass
        waited = True
    return False


def _failing(job_id: str, error: str, signature: str, deaths: int, told: _Told) -> bool:
    """The controller keeps failing: the workers go on (their agents keep them for
    ``controller_grace``); ``status`` says why. Returns True when ``resume`` asks to try
    again; else ends the job: cancelled when a cancel comes, else FAILED with cause
    CONTROLLER_FAILED once the agents' grace is over (they stopped the workers). Told to
    exit, it leaves the job as it is (False)."""
    store = Store()
    try:
        job = store.get_job(job_id)
        grace = JobSpec.model_validate_json(job.spec_json).health.controller_grace
        since = time.time()
        until = None if grace is None else since + grace + GRACE_MARGIN
        where = str(store.job_dir(job_id) / "controller.log")
        store.update_job(job_id, failing_json=json.dumps({
            "since": since, "error": error, "signature": signature, "deaths": deaths,
            "traceback": where, "until": until}))
        log.error("the controller keeps failing (%d deaths; the last: %s; traceback in %s): "
                  "the workers go on for controller_grace; `orchestrator resume %s` tries "
                  "again, `orchestrator cancel %s` stops them", deaths, error, where, job_id,
                  job_id)
        while told.sleep(1.0):
            try:
                job = store.get_job(job_id)
            except OrchestratorError:
                continue  # the home away for a moment: look again
            if job.state.is_at_rest():
                return False
            if job.cancel_requested:
                _abandon(store, job_id, JobState.CANCELLED, {})
                return False
            if (job.resume_requested_at or 0) > since:
                log.warning("`orchestrator resume` asked to try again")
                return True
            if until is not None and time.time() >= until:
                failure = Failure(
                    FailureCause.CONTROLLER_FAILED,
                    f"the controller failed {deaths} times ({error}; traceback in {where}); "
                    f"its agents stopped the workers after controller_grace ({grace:g}s)",
                    failure_class="infrastructure", evidence=signature,
                    decision="not restarted: an error of the orchestrator's own "
                             "(no restart charged)")
                _abandon(store, job_id, JobState.FAILED, {"failure": failure.to_dict()})
                return False
        return False
    finally:
        store.close()


def _abandon(store: Store, job_id: str, final: JobState, fields: dict[str, Any]) -> None:
    """End the job without running it (Controller.abandon, in a child of its own); if even
    that fails, record the end here: the agents stop the workers after their grace."""
    child = _Forked(functools.partial(_run_abandon, job_id, final, fields))
    if child.wait() == 0:
        return
    if not store.job_state(job_id)[0].is_at_rest():
        store.end_open_attempt(job_id, final, fields.get("failure"))
        store.set_state(job_id, final, **fields)
    saved = store.get_job(job_id).slurm
    if saved and not saved.get("released"):  # nobody will use it: give it back
        _release(store, job_id, slurm.Allocation.from_dict(saved))


def _run_abandon(job_id: str, final: JobState, fields: dict[str, Any]) -> int:
    store = Store(durable=True)
    lock = open(store.job_dir(job_id) / "controller.lock", "a")  # noqa: SIM115 (held until exit)
    fcntl.flock(lock, fcntl.LOCK_EX)
    if store.job_state(job_id)[0].is_at_rest():
        return 0
    controller = _controller(store, job_id, resume=True, acquire=False)
    if controller is None:
        return 1  # no way to its nodes (an allocation never granted): recorded by the caller
    controller.abandon(final, fields)
    return 0


class _Forked:
    """A child of the supervisor running ``run`` (the controller, or its abandon), which has
    imported everything it needs already: a fresh ``python -m`` would spend ~0.3 s importing
    it again, on the path of every submit. The supervisor has no threads and no open
    database when it forks. An exception in the child is logged with its traceback and
    reported to the parent on a pipe (``report``: error, signature) before it exits."""

    def __init__(self, run: Callable[[], int]):
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(read_end)
            code, report = 1, None
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)  # the controller sets its own
                for handler in logging.getLogger().handlers:
                    handler.setFormatter(logging.Formatter(
                        f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
                code = run()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except StoreUnwritable as exc:
                log.error("%s", exc)
                code, report = UNWRITABLE, {"reason": str(exc)}
            except BaseException as exc:
                log.exception("controller failed")
                code, report = CRASHED, {"error": _one_line(exc), "signature": _signature(exc)}
            finally:
                try:
                    if report is not None:
                        os.write(write_end, json.dumps(report).encode()[:60000])
                finally:
                    leave(code)
        os.close(write_end)
        self._report_fd = read_end
        self._started = time.monotonic()
        self.lived = 0.0  # seconds it ran
        self.returncode: int | None = None
        self.report: dict[str, Any] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._ended(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except InterruptedError:
                continue
            except ChildProcessError:  # reaped by poll() in a signal handler meanwhile
                continue
            self._ended(status)
        return self.returncode

    def _ended(self, status: int) -> None:
        if self.returncode is not None:
            return
        self.lived = time.monotonic() - self._started
        self.returncode = os.waitstatus_to_exitcode(status)
        with os.fdopen(self._report_fd, "rb") as f:
            data = f.read()
        try:
            self.report = json.loads(data) if data else None
        except ValueError:
            self.report = None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


def _one_line(exc: BaseException) -> str:
    from orchestrator.controller import _describe

    return _describe(exc)[:500]


def _signature(exc: BaseException) -> str:
    """The error as two deaths of the same bug share it: its type and the innermost frame
    of ours (``OSError at orchestrator/logfiles.py:212``)."""
    import traceback

    package = Path(__file__).resolve().parent
    ours = (str(package) + os.sep, str(package.parent / "agents") + os.sep)
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(ours):
            where = (f" at {os.path.relpath(frame.filename, package.parent)}:"
                     f"{frame.lineno}")
    number = f"[{exc.errno}]" if isinstance(exc, OSError) and exc.errno else ""
    return f"{type(exc).__name__}{number}{where}"


def main(argv: list[str] | None = None) -> int:
    """``python -m orchestrator.supervisor JOB_ID [--resume] [--supervise]``."""
    parser = argparse.ArgumentParser(prog="orchestrator.supervisor")
    parser.add_argument("job_id")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--supervise", action="store_true")
    args = parser.parse_args(argv)
    os.umask(0o077)  # logs hold whatever the workers print: the user's alone
    raise_open_files_limit()  # a rank's log, a node's channel: descriptors add up
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {'supervisor' if args.supervise else os.getpid()} "
                               "%(levelname)s %(message)s")
    if args.supervise:
        return _supervise(args.job_id, args.resume)
    return _run_controller(args.job_id, args.resume)


def _run_controller(job_id: str, resume: bool) -> int:
    try:
        return _controller_main(job_id, resume)
    except StoreUnwritable:
        raise  # a pause, not a usage error: the supervisor waits for room
    except JobNotFoundError as exc:  # before it could start: nothing to retry
        log.error("%s", exc)
        return 2


def leave(code: int) -> None:
    """Exit now, without the interpreter's teardown (tens of milliseconds with everything
    imported; a waiter is woken by this exit: api.wait), the log flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "--supervise" in sys.argv[1:]:
        leave(code)  # the supervisor: no thread of it must finish
    sys.exit(code)
