"""The controller's process: the supervisor that keeps it alive, and its Slurm allocation.

``submit`` starts ``python -m orchestrator.controller JOB_ID --supervise``: a small parent
(``_supervise``) that forks the controller and starts it again, resuming, whenever it dies
before the job has ended (a crash, the OOM killer, a stray kill; at most MAX_RESPAWNS in
RESPAWN_WINDOW seconds). One controller per job, whoever started it (a lock on the job's
directory). A job on Slurm gets its allocation here first (``salloc``, or the one the job was
submitted in) and gives it back when it ends, also when the supervisor gives up.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

from orchestrator import reputation, slurm
from orchestrator.controller import Controller, raise_open_files_limit
from orchestrator.errors import LaunchError, OrchestratorError, SpecError
from orchestrator.pids import pid_namespace
from orchestrator.spec import JobSpec
from orchestrator.state import FailureCause, JobState
from orchestrator.store import Store
from orchestrator.transport import Connector
from orchestrator.transport.base import ConnectionFactory
from orchestrator.transport.slurm import SlurmConnector
from orchestrator.world import UserWorld

log = logging.getLogger("orchestrator.controller")

ANOTHER_CONTROLLER = 75  # exit code: the job has a live controller already


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
    if job.state.is_terminal():
        log.info("job %s already ended (%s)", job_id, job.state.value)
        return 0
    store.claim_controller(job_id, os.getpid(), socket.gethostname(), pid_namespace())
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
        allocation = _slurm_allocation(store, job_id, spec)
        if allocation is None:
            return 1  # the job ended (or waits for a resume): recorded already
        spec = slurm.spec_with_nodes(spec, allocation)
        connect = SlurmConnector(allocation.job_id, world)
        on_end = lambda: _release(store, job_id, allocation)  # noqa: E731
    controller = Controller(store, job_id, spec, job.spec_dir, connect, secret=secret,
                            resume=resume or job.state != JobState.PENDING, on_end=on_end)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.request_exit())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    state = controller.run()
    return 0 if state == JobState.SUCCEEDED else 1


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
    except slurm.Interrupted:
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


MAX_RESPAWNS = 5  # within RESPAWN_WINDOW seconds: a controller that keeps dying is a bug
RESPAWN_WINDOW = 600.0


def _supervise(job_id: str, resume: bool) -> int:
    """Run the controller as a child and start it again, resuming, whenever it dies before
    the job has ended (a crash, the OOM killer, a stray kill)."""
    store = Store()
    store.claim_supervisor(job_id, os.getpid())
    child: _Forked | None = None
    told_to_exit = False

    def forward(signum: int, _frame: Any) -> None:  # the controller decides: cancel, or exit
        nonlocal told_to_exit
        told_to_exit = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    deaths: deque[float] = deque()
    store.close()
    while True:
        child = _Forked(job_id, resume)
        code = child.wait()
        store = Store()
        state, _ = store.job_state(job_id)
        if state.is_terminal() or told_to_exit or code == ANOTHER_CONTROLLER:
            return 0
        now = time.monotonic()
        deaths.append(now)
        while deaths and now - deaths[0] > RESPAWN_WINDOW:
            deaths.popleft()
        how = f"code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        if len(deaths) > MAX_RESPAWNS:
            log.error("controller died %d times in %gs (last: %s); giving up: run "
                      "`orchestrator resume %s`", len(deaths), RESPAWN_WINDOW, how, job_id)
            saved = store.get_job(job_id).slurm
            if saved and not saved.get("released"):  # nobody will use it: give it back
                _release(store, job_id, slurm.Allocation.from_dict(saved))
            return 1
        log.warning("controller exited with %s while the job was %s: resuming", how,
                    state.value)
        store.close()
        time.sleep(1.0)
        resume = True


class _Forked:
    """The controller as a forked child of the supervisor, which has imported everything it
    needs already: a fresh ``python -m`` would spend ~0.3 s importing it again, on the path
    of every submit. The supervisor has no threads and no open database when it forks."""

    def __init__(self, job_id: str, resume: bool):
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)  # the controller sets its own
                for handler in logging.getLogger().handlers:
                    handler.setFormatter(logging.Formatter(
                        f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
                code = _run_controller(job_id, resume)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("controller failed")
            finally:
                logging.shutdown()
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(code)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except InterruptedError:
                continue
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m orchestrator.controller JOB_ID [--resume] [--supervise]``."""
    parser = argparse.ArgumentParser(prog="orchestrator.controller")
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
    except OrchestratorError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
