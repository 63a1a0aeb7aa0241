"""The Python API: what the CLI calls, and what scripts call instead of the CLI.

The job's operations (submit, resume, cancel, wait, stacks), its logs, and the home's
hosts and policies. What a reader shows of a job (the status dict, the controller as seen
from here) is ``jobview.py``'s."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator import (
    drain,
    logfiles,
    logread,
    pids,
    preflight,
    reputation,
    retention,
    slurm,
    spawn,
    sync,
)
from orchestrator.errors import JobEndedError, LaunchError, OrchestratorError, StoreUnwritable
from orchestrator.jobview import (
    SupervisorExit,
    controller_gone,
    controller_view,
    is_controller,
    iso,
    shown_state,
    status_dict,
)
from orchestrator.plan import LaunchPlan, plan_attempt
from orchestrator.spec import JobSpec, load_jobspec
from orchestrator.state import FailureCause, JobState
from orchestrator.store import JobRecord, Store, check_job_id
from orchestrator.world import UserWorld


def _load(spec: str | os.PathLike[str] | JobSpec, spec_dir: str | None,
          env: dict[str, str] | None = None,
          overrides: list[str] | None = None) -> tuple[JobSpec, str]:
    if isinstance(spec, JobSpec):
        if env or overrides:
            raise ValueError("env and overrides apply to a spec file, not to a JobSpec")
        return spec, os.path.abspath(spec_dir or ".")
    path = Path(spec)
    return load_jobspec(path, env=env, overrides=overrides), str(path.resolve().parent)


def dry_run(spec: str | os.PathLike[str] | JobSpec, *, spec_dir: str | None = None,
            env: dict[str, str] | None = None, overrides: list[str] | None = None) -> LaunchPlan:
    """The plan of a job's first attempt, without connecting to anything."""
    job_spec, directory = _load(spec, spec_dir, env, overrides)
    if job_spec.slurm is not None:  # the nodes are Slurm's choice: placeholders for them
        job_spec = slurm.spec_with_nodes(job_spec, None)
    return plan_attempt(job_spec, f"{job_spec.name}-dryrun", spec_dir=directory)


def check(spec: str | os.PathLike[str] | JobSpec) -> dict[str, Any]:
    """Preflight: reach every node, report versions, GPUs, the interface toward the master,
    and whether each node can open a TCP connection to master_addr:master_port."""
    job_spec, directory = _load(spec, None)
    if job_spec.slurm is not None:
        slurm.quick_check(job_spec)
        allocation = slurm.existing_allocation(job_spec)
        if allocation is None:
            raise LaunchError("slurm: check reaches a Slurm job's nodes only from inside an "
                              "allocation (salloc, sbatch); outside one, submit checks the "
                              "partition and Slurm's commands")
        from orchestrator.transport.slurm import SlurmConnector

        return preflight.check(slurm.spec_with_nodes(job_spec, allocation),
                               connect=SlurmConnector(allocation.job_id),
                               spec_dir=directory).to_dict()
    return preflight.check(job_spec, spec_dir=directory).to_dict()


def submit(spec: str | os.PathLike[str] | JobSpec, *, spec_dir: str | None = None,
           home: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
           overrides: list[str] | None = None, fork: bool = False) -> str:
    """Validate a spec, record the job, start its detached controller; return the job id.

    ``spec`` is a path to a YAML spec or a loaded :class:`JobSpec` (then relative workdirs
    resolve against ``spec_dir``, default the current directory). An SSH node that does not
    answer on its port, or whose host key is unknown, fails here (LaunchError, naming it)
    before anything is recorded or started. ``env`` adds variables and ``overrides``
    (``field.path=value``) change fields of a spec file for this job only; both are
    validated like the file. ``fork``: the supervisor is a fork of this process (a third of
    a second sooner: orchestrator/spawn.py), for a caller that holds nothing a fork must not
    inherit (the orchestrator command).
    """
    world = UserWorld.capture()  # first: what torchrun run from here would pass on
    job_spec, directory = _load(spec, spec_dir, env, overrides)
    # The supervisor starts now (no database is open yet) and imports what it lacks while
    # the checks run; it is told its job once it is recorded (orchestrator/spawn.py).
    early = _fork_supervisor() if fork else None
    try:
        return _submit(job_spec, directory, world, home, early)
    finally:
        if early is not None:
            early.abandon()  # told nothing (a check failed): it exits, having done nothing


def _fork_supervisor() -> spawn.Forked | None:
    try:
        return spawn.forked()
    except OSError:
        return None  # a fresh interpreter then


def _submit(job_spec: JobSpec, directory: str, world: UserWorld,
            home: str | os.PathLike[str] | None, early: spawn.Forked | None) -> str:
    preflight.quick_check(job_spec)
    allocation, hosts = None, [n.host for n in job_spec.nodes]
    if job_spec.slurm is not None:  # no salloc, no such partition: said now, not later
        slurm.quick_check(job_spec)
        allocation = slurm.existing_allocation(job_spec)  # submitted inside an allocation
        hosts = [n.host for n in slurm.spec_with_nodes(job_spec, allocation).nodes]
    manifest = None
    if job_spec.sync is not None:  # a bad symlink, an unreadable file, too much: said now
        manifest = sync.build_manifest(
            os.path.join(directory, os.path.expanduser(job_spec.sync.path)),
            job_spec.sync.exclude, job_spec.sync.max_bytes)
    store = Store(home)
    try:
        _check_free_space(store, job_spec.logs.min_free_bytes)
        try:
            retention.prune(store)  # what ended longer ago than this home keeps
        except OrchestratorError as exc:  # never a reason not to submit
            print(f"warning: pruning old jobs failed: {exc}", file=sys.stderr)
        job_id = f"{job_spec.name}-{secrets.token_hex(3)}"
        # The agents' secret: a controller proves it to attach to them (also after a restart).
        store.create_job(job_id, job_spec.name, job_spec.model_dump_json(), directory,
                         job_spec.max_restarts, hosts, secret=secrets.token_hex(32),
                         slurm=allocation.to_dict() if allocation is not None else None,
                         world=world.to_dict())
        if manifest is not None:  # hashed once: the controller ships this very tree
            manifest.save(store.job_dir(job_id) / sync.MANIFEST_FILE)
        try:
            if early is not None:
                early.go(store, job_id)
            else:
                spawn.start_supervisor(store, job_id, resume=False)
        except OSError as exc:
            store.set_state(job_id, JobState.FAILED,
                            failure={"cause": FailureCause.LAUNCH_FAILED.value,
                                     "message": f"cannot start controller: {exc}"})
            raise LaunchError(f"cannot start the controller: {exc}") from exc
        return job_id
    finally:
        store.close()


def _check_free_space(store: Store, min_free: int) -> None:
    st = os.statvfs(store.home)
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        raise LaunchError(f"only {free} bytes free on the filesystem of {store.home} "
                          f"($ORCHESTRATOR_HOME), less than logs.min_free_bytes ({min_free}): "
                          "free some space, or lower logs.min_free_bytes")


RESUME_WAIT = 60.0  # seconds resume waits for a PREEMPTED job's controller to finish ending


def resume(job_id: str, *, home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Start a new controller for a job whose controller is gone (or, when its controller
    keeps failing, have its supervisor try again now): it reattaches to the same agents and
    the same attempt, and the job goes on (no restart is charged). Returns
    ``{"job_id", "resumed": bool, "controller": {...}}``; ``resumed`` is False when the job
    already has a live controller. A job that stopped PREEMPTED goes on from the step its
    ranks saved, on fresh agents. A job that ended raises JobEndedError."""
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        if job.state == JobState.PREEMPTED:  # (a waiter wakes at the state, not the exit)
            job = controller_gone(job, lambda: store.get_job(job_id), RESUME_WAIT)
        if job.state == JobState.PREEMPTED and controller_view(job)["alive"] is False:
            _resume_preempted(store, job)
            job = store.get_job(job_id)
        if job.state.is_terminal():
            raise JobEndedError(job_id, job.state.value)
        view = controller_view(job)
        if job.failing and view["alive"] is not False:  # its supervisor waits: try again
            store.update_job(job_id, resume_requested_at=time.time())
            return {"job_id": job_id, "resumed": True, "controller": view}
        if view["alive"] is not False:
            return {"job_id": job_id, "resumed": False, "controller": view}
        spawn.start_supervisor(store, job_id, resume=True)
        return {"job_id": job_id, "resumed": True,
                "controller": controller_view(store.get_job(job_id))}
    finally:
        store.close()


def _resume_preempted(store: Store, job: JobRecord) -> None:
    """A PREEMPTED job goes on (RESTARTING) on fresh agents. Its Slurm allocation is gone:
    one it requested is asked for anew by the supervisor; one it ran inside (the user's) is
    replaced by the one this resume runs inside (a requeued batch script's)."""
    if job.slurm:
        spec = JobSpec.model_validate_json(job.spec_json)
        allocation = None if job.slurm.get("owned") else slurm.existing_allocation(spec)
        if allocation is None and not job.slurm.get("owned"):
            raise LaunchError(f"slurm: {job.job_id} ran inside allocation "
                              f"{job.slurm.get('job_id')}, which has ended: resume it from "
                              "inside a new one (a batch script run again by --requeue)")
        record = allocation.to_dict() if allocation else {**job.slurm, "nodes": [],
                                                          "released": True}
        hosts = [n.host for n in slurm.spec_with_nodes(spec, allocation).nodes] \
            if allocation else None
        store.set_slurm(job.job_id, record, hosts)
    store.end_notices(job.job_id)  # fresh agents, where the user says the job goes on
    store.set_state(job.job_id, JobState.RESTARTING, ended_at=None, failure=None)


def status(job_id: str, *, home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The job's state as a JSON-ready dict (the documented ``status --json`` shape)."""
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        shown = status_dict(job)
        held = drain.drained(store.drains(), job.job_id, {n.node_index: n.host for n in job.nodes})
        for node in shown["nodes"]:
            d = held.get(node["node_index"])
            node["drained"] = None if d is None else {"since": iso(d["since"]),
                                                      "reason": d["reason"]}
            node["spare"] = node["spare"] and d is None  # a drained node takes no place
        return shown
    finally:
        store.close()


def stacks(job_id: str, *, rank: int | None = None, timeout: float = 60.0,
           home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Every running rank's Python stack, taken now by the job's controller through the
    agents (py-spy where it can attach, else a faulthandler hook): ``{"at", "stacks": {rank:
    {host, method, text, error?}}, "diagnosis"}``. ``rank`` keeps only that one."""
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        if job.state.is_at_rest():
            raise JobEndedError(job_id, job.state.value)
        if controller_view(job)["alive"] is False:
            raise LaunchError(f"the controller of {job_id} is not running: "
                              f"`orchestrator resume {job_id}` first")
        asked = store.request_stacks(job_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, answered, answer = store.stacks(job_id)
            if answered is not None and answered >= asked and answer is not None:
                found = answer.get("stacks") or {}
                if rank is not None:
                    found = {k: v for k, v in found.items() if k == str(rank)}
                return {"at": iso(answered), "stacks": found,
                        "diagnosis": answer.get("diagnosis")}
            time.sleep(0.1)
        raise LaunchError(f"no stacks from the controller of {job_id} within {timeout:g}s")
    finally:
        store.close()


def list_jobs(*, home: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every job, oldest first: job_id, name, state, submitted_at, attempt, restarts."""
    store = Store(home)
    try:
        return [
            {"job_id": j.job_id, "name": j.name, "state": shown_state(j, controller_view(j)),
             "submitted_at": iso(j.submitted_at), "ended_at": iso(j.ended_at),
             "attempt": j.attempt, "restarts": j.restarts}
            for j in store.list_jobs()
        ]
    finally:
        store.close()


def nodes(*, home: str | os.PathLike[str] | None = None,
          days: float = 7.0) -> list[dict[str, Any]]:
    """Hosts with infrastructure failures in the last ``days``, or a quarantine on record:
    host, quarantined (now), until, level, reason, events_24h, events (the last 10: at,
    job_id, kind, detail). Quarantined first, then by most recent event."""
    store = Store(home)
    try:
        now = time.time()
        events = store.host_events(now - days * 86400)
        held = store.quarantines()
    finally:
        store.close()
    hosts: dict[str, list[dict[str, Any]]] = {h: [] for h in held}
    for e in events:
        hosts.setdefault(e["host"], []).append(e)
    out = []
    last = {host: its[-1]["at"] if its else 0.0 for host, its in hosts.items()}
    for host, its in hosts.items():
        q = held.get(host)
        out.append({
            "host": host, "quarantined": q is not None and q["until"] > now,
            "until": iso(q["until"]) if q else None, "level": q["level"] if q else 0,
            "reason": q["reason"] if q else None,
            "released_at": iso(q["released_at"]) if q and q["released_at"] else None,
            "events_24h": sum(e["at"] >= now - 86400 for e in its),
            "events": [{**e, "at": iso(e["at"])} for e in its[-10:]]})
    out.sort(key=lambda h: (not h["quarantined"], -last[h["host"]]))
    return out


def release_node(host: str, *, home: str | os.PathLike[str] | None = None) -> bool:
    """End ``host``'s quarantine now (the hostname, as ``nodes`` lists it); False if it had
    none in force."""
    store = Store(home)
    try:
        return store.release_quarantine(host)
    finally:
        store.close()


def drain_node(target: str, *, job: str | None = None, reason: str = "",
               within: float = drain.DEFAULT_WITHIN,
               home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Drain ``target`` (a host, as a spec names it or as ``nodes`` lists it; with ``job``,
    also a node index of that job; ``*``: every node): a running job moves off it at a step
    every rank saves (within ``within`` seconds), and no job starts work there until
    ``undrain_node``. A job all of whose nodes are drained stops PREEMPTED at that step
    (persisted where it has a checkpoint.dir), until ``resume``."""
    if not target or len(target) > 255 or any(c.isspace() for c in target):
        raise OrchestratorError(f"drain: not a host: {target!r}")
    if not 0 < within <= 86400:
        raise OrchestratorError(f"drain --within: must be 0 to 86400 seconds (got {within!r})")
    key = _drain_key(target, job)
    store = Store(home)
    try:
        if job is not None:
            store.get_job(check_job_id(job))  # JobNotFoundError, named
        store.set_drain(key, job or "", reason[:500], within)
        return {"target": key, "job_id": job, "reason": reason[:500], "within": within}
    finally:
        store.close()


def undrain_node(target: str, *, job: str | None = None,
                 home: str | os.PathLike[str] | None = None) -> bool:
    """End a drain (``drain_node``'s target and job); False if there was none."""
    key = _drain_key(target, job)
    store = Store(home)
    try:
        return store.remove_drain(key, job or "")
    finally:
        store.close()


def _drain_key(target: str, job: str | None) -> str:
    """How the store keeps a drain's target: a node index of a job, or the host's name."""
    return target if target == "*" or (job is not None and target.isdigit()) else \
        (reputation.host_key(target) or target)


def drains(*, home: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every drain in force: target, job_id (None: every job), since, reason, within."""
    store = Store(home)
    try:
        return [{**d, "job_id": d["job_id"] or None, "since": iso(d["since"])}
                for d in store.drains()]
    finally:
        store.close()


def quarantine_policy(*, home: str | os.PathLike[str] | None = None,
                      **changes: Any) -> dict[str, Any]:
    """This home's quarantine thresholds (after, window, cooldown, max_cooldown; seconds),
    after applying ``changes`` (checked: OrchestratorError naming the setting)."""
    store = Store(home)
    try:
        rules = reputation.set_policy(store, **changes) if changes else \
            reputation.policy(store)
    finally:
        store.close()
    return dataclasses.asdict(rules)


def retention_policy(*, home: str | os.PathLike[str] | None = None,
                     keep: float | None | Any = ...) -> float | None:
    """Seconds this home keeps ended jobs (None: for ever; default 30 days), after setting
    it to ``keep`` when given. ``submit`` prunes with it."""
    store = Store(home)
    try:
        return retention.policy(store) if keep is ... else retention.set_policy(store, keep)
    finally:
        store.close()


def prune(*, older_than: float | None = None, dry_run: bool = False,
          home: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Remove the records, samples and logs of jobs that ended more than ``older_than``
    seconds ago (default: this home's retention); ``dry_run`` removes nothing. The jobs:
    ``[{job_id, name, state, ended_at}]``, oldest first. Running jobs are never removed."""
    store = Store(home)
    try:
        found = {j.job_id: j for j in store.list_jobs()}
        gone = retention.prune(store, older_than, dry_run=dry_run)
    finally:
        store.close()
    return [{"job_id": j, "name": found[j].name, "state": found[j].state.value,
             "ended_at": iso(found[j].ended_at)} for j in gone]


def wait(job_id: str, *, timeout: float | None = None, poll: float = 0.2,
         home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Block until the job is in a terminal state (or ``timeout``); return its status.

    A job whose controller (and its supervisor) died is resumed: whoever waits for a job
    wants it to go on.
    """
    store = Store(home)
    deadline = None if timeout is None else time.monotonic() + timeout
    next_liveness_check = time.monotonic() + 2.0
    ended = SupervisorExit()  # it exits right after the end is recorded: wake then
    try:
        while True:
            state, _ = store.job_state(check_job_id(job_id))  # the cheap read, every poll
            if state.is_at_rest():
                return status_dict(store.get_job(job_id))
            if deadline is not None and time.monotonic() > deadline:
                return status_dict(store.get_job(job_id))
            if time.monotonic() >= next_liveness_check:
                _ensure_controller(store, job_id)
                next_liveness_check = time.monotonic() + 2.0
                ended.close()  # a new supervisor, perhaps: watched from the next look on
            if not ended.watching:
                ended.watch(store.get_job(job_id))
            ended.sleep(poll)
    finally:
        ended.close()
        store.close()


def cancel(job_id: str, *, wait_seconds: float = 60.0,
           home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Ask the job's controller to stop every worker; wait for CANCELLED (or the end).

    Cancelling a finished job changes nothing; cancelling twice is harmless.
    """
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        if job.state == JobState.PREEMPTED:  # nothing runs it: cancelled where it stands
            store.set_state(job_id, JobState.CANCELLED)
            return status_dict(store.get_job(job_id))
        if job.state.is_terminal():
            return status_dict(job)
        pid = job.controller_pid
        live = bool(pid and is_controller(pid, job.controller_ident, job_id))
        try:
            store.request_cancel(job_id)
            sig = signal.SIGTERM  # it reads the request: cancel (without it: detach)
        except StoreUnwritable:
            if not live:
                raise
            sig = signal.SIGUSR1  # the home is full: "cancel" said without the store
        if not (live and pid and pids.send(pid, job.controller_ident, sig)):
            # Only a controller stops workers: start one, it sees the request at once.
            _ensure_controller(store, job_id)
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline:
            job = store.get_job(job_id)
            if job.state.is_at_rest():
                break
            time.sleep(0.1)
        return status_dict(job)
    finally:
        store.close()


def logs(job_id: str, *, rank: int | None = None, node: int | None = None,
         attempt: int | None = None, tail: int | None = None, follow: bool = False,
         home: str | os.PathLike[str] | None = None, poll: float = 0.2) -> Iterator[str]:
    """Yield log lines ``[host:rank] text`` of a job: the setup (``[host:setup]``) and
    every attempt, or one attempt. ``rank`` reads that rank's own file; ``node`` the lines of
    that node's ranks. Where lines were cut (``logs.max_bytes_per_rank``), a line
    ``[orchestrator] N lines ...`` says so, in place.

    ``follow`` keeps yielding new lines, moving on to new attempts, until the job ends.
    """
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        first = attempt if attempt is not None else (0 if rank is None else 1)
        last = attempt if attempt is not None else max(job.attempt, first)
        streams = {n: _Stream(store, job, n, rank, node) for n in range(first, last + 1)}
        lines: Iterator[str] = (line for n in range(first, last + 1)
                                for line in streams[n].read())
        if tail is not None:
            lines = iter(deque(lines, maxlen=max(0, tail)))
        yield from lines
        if not follow:
            return
        current, stream = last, streams[last]
        next_liveness_check = time.monotonic() + 2.0
        while True:
            state, latest = store.job_attempt(job_id)  # the cheap read, every poll
            if not state.is_at_rest() and time.monotonic() >= next_liveness_check:
                _ensure_controller(store, job_id)
                next_liveness_check = time.monotonic() + 2.0
            new = stream.read()
            yield from new
            if attempt is None and latest > current:
                current += 1
                stream = _Stream(store, store.get_job(job_id), current, rank, node)
                continue
            if state.is_at_rest() and not new:
                return
            time.sleep(poll)
    finally:
        store.close()


def log_tail(job_id: str, *, rank: int | None = None, attempt: int | None = None,
             lines: int = 200, max_bytes: int = 4 * 1024 * 1024,
             home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The last ``lines`` lines of one attempt (default: the current one), read from the end
    of its log (the rank's own with ``rank``), at most ``max_bytes`` of it, so a poll costs
    the same whatever the log's size; cut markers included:
    ``{"attempt", "lines", "partial"}``; ``partial`` when the read stopped at ``max_bytes``
    before finding enough lines."""
    store = Store(home)
    try:
        job = store.get_job(check_job_id(job_id))
        number = job.attempt if attempt is None else attempt
        stream = _Stream(store, job, number, rank, None)
    finally:
        store.close()
    found, partial = logread.tail_lines(stream.path, lines, max_bytes, stream.keep)
    found = [stream.shown(line) for line in found]
    return {"attempt": number, "lines": found[-lines:] if lines > 0 else [],
            "partial": partial}


# --- helpers ---------------------------------------------------------------------------------

def _ensure_controller(store: Store, job_id: str) -> None:
    """Resume the job if its controller and supervisor are known to be dead."""
    job = store.get_job(job_id)
    if not job.state.is_at_rest() and controller_view(job)["alive"] is False:
        spawn.start_supervisor(store, job_id, resume=True)



class _Stream:
    """One attempt's lines as ``logs`` shows them: the rank's own file (``rank``), or the
    combined one, filtered to a node's ranks (``node``); attempt 0 is the setup."""

    def __init__(self, store: Store, job: JobRecord, attempt: int, rank: int | None,
                 node: int | None):
        if attempt == 0:
            self.directory = store.job_dir(job.job_id) / "logs" / "setup"
        else:
            self.directory = store.log_dir(job.job_id, attempt)
        self.rank, self.attempt = rank, attempt
        self.path = self.directory / (f"rank-{rank}.log" if rank is not None and attempt
                                      else "combined.log")
        self.follower = logread.Follower(self.path)
        self.labels = _node_labels(store, job, node) if node is not None else None
        self._host: str | None = None

    def keep(self, line: str) -> bool:
        if self.rank is not None:
            return self.attempt > 0  # the setup's lines belong to no rank
        if self.labels is None or line.startswith("[orchestrator] "):
            return True  # a marker says what happened to every rank's lines
        return line.split("] ", 1)[0].rsplit(":", 1)[-1] in self.labels

    def shown(self, line: str) -> str:
        """A line of a rank's own file, as in the combined log: with its host and rank."""
        if self.rank is None:
            return line
        if self._host is None:  # known once the controller has written the rank's lines
            self._host = logfiles.labels(self.directory).get(str(self.rank))
        return f"[{self._host or '?'}:{self.rank}] {line}"

    def read(self) -> list[str]:
        return [self.shown(line) for line in self.follower.read() if self.keep(line)]


def _node_labels(store: Store, job: JobRecord, node: int) -> set[str]:
    """The labels of the lines of the node with node rank ``node``: its ranks, and its own
    (torchrun's, or a per-node launcher's)."""
    index = {n.node_rank: n.node_index for n in job.nodes if n.node_rank is not None}
    node_index = index.get(node, -1)
    labels = {str(rank) for rank in store.ranks_of_node(job.job_id, node_index)}
    labels.add(f"node{node}")
    return labels
