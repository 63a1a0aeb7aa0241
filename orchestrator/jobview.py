"""What readers show of a job: the ``status`` dict (the documented ``status --json`` shape,
also the dashboard's), the state shown (UNKNOWN for a job whose controller is known to be
dead), the job's controller as this machine sees it (and waiting for it to exit), and stored
times as ISO 8601.

Readers only: nothing here writes the store or starts a controller (``api.py`` does, when a
reader finds the controller dead). May call ``pids``, ``timelost``, ``state`` and the
store's records; called by ``api.py``.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from orchestrator import pids, progress, timeline, timelost
from orchestrator.pids import pid_namespace
from orchestrator.state import AttemptOutcome, JobState
from orchestrator.store import JobRecord


def controller_view(job: JobRecord) -> dict[str, Any]:
    """The job's controller as this machine sees it. ``alive`` is None when it runs on
    another host (or in a PID namespace we cannot see into): then nobody here can tell."""
    here = job.controller_host in (None, socket.gethostname()) and \
        job.controller_pidns in (None, pid_namespace())
    alive: bool | None
    if job.state.is_at_rest():
        alive = _any_controller(job) if here else None
    elif not here:
        alive = None
    else:
        alive = _any_controller(job)
    failing = None
    if job.failing and not job.state.is_at_rest():
        f = job.failing
        failing = {"since": iso(f.get("since")), "error": f.get("error"),
                   "deaths": f.get("deaths"), "traceback": f.get("traceback"),
                   "until": iso(f.get("until"))}
    return {"pid": job.controller_pid, "host": job.controller_host, "alive": alive,
            "since": iso(job.controller_since), "supervisor_pid": job.supervisor_pid,
            "failing": failing}


def shown_state(job: JobRecord, controller: dict[str, Any]) -> str:
    """The recorded state, except that a job whose controller is known to be dead is not
    RUNNING any more: it is UNKNOWN until ``resume`` (nothing is rewritten)."""
    if not job.state.is_at_rest() and controller["alive"] is False \
            and job.state != JobState.PENDING:
        return "UNKNOWN"
    return job.state.value


def _any_controller(job: JobRecord) -> bool:
    return any(is_controller(pid, ident, job.job_id) for pid, ident in (
        (job.controller_pid, job.controller_ident), (job.supervisor_pid, job.supervisor_ident))
        if pid)


def is_controller(pid: int, ident: str | None, job_id: str) -> bool:
    """Is ``pid`` the recorded process (this user's, started when recorded: not a recycled
    pid, not another user's controller of a job with the same id) and this job's controller?"""
    if not pids.is_ours(pid, ident):
        return False
    if ident is not None:  # the very process recorded (its uid and start time): a forked
        return True        # supervisor has the submitting command's argv (spawn.py)
    argv = pids.argv(pid)
    # A record without an identity (an older version's): its command line, as started then.
    return (b"orchestrator.supervisor" in argv or b"orchestrator.controller" in argv) and \
        job_id.encode() in argv


class SupervisorExit:
    """A waiter's sleep, cut short when the job's supervisor exits (it exits right after the
    end is recorded, so a waiter sees the end at once instead of up to a poll later). A
    pidfd (Linux 5.3) pins the recorded process; without one, or for a supervisor on another
    host or in another PID namespace, a plain sleep."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.watching = False  # looked (found one or not) since the last close

    def watch(self, job: JobRecord) -> None:
        self.watching = True
        pid, ident = job.supervisor_pid, job.supervisor_ident
        if not pid or job.controller_host not in (None, socket.gethostname()) or \
                job.controller_pidns not in (None, pid_namespace()):
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        if is_controller(pid, ident, job.job_id):  # checked once pinned: not a reused pid
            self._fd = fd
        else:
            os.close(fd)

    def sleep(self, seconds: float) -> None:
        if self._fd is None:
            time.sleep(seconds)
            return
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(seconds * 1000):  # it exited: the next look finds who is next, if any
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.watching = None, False


def controller_gone(job: JobRecord, reread: Callable[[], JobRecord], limit: float
                    ) -> JobRecord:
    """The job once its controller has exited (up to ``limit`` seconds; ``reread`` reads the
    record again). For a job at rest: its controller writes the end before it lets go of its
    nodes (lingering for unreachable agents, its notifications, its Slurm allocation), and a
    ``resume`` typed as soon as a job shows PREEMPTED must not find it there and do nothing."""
    ended = SupervisorExit()
    deadline = time.monotonic() + limit
    try:
        while controller_view(job)["alive"] and time.monotonic() < deadline:
            if not ended.watching:
                ended.watch(job)
            ended.sleep(0.1)
            job = reread()
    finally:
        ended.close()
    return job


def iso(ts: Any) -> str | None:
    """A stored Unix time as ISO 8601 UTC; one no date can be (a record of an older version,
    a clock gone wrong) as ``invalid time <value>``, never an error of the reader."""
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return f"invalid time {str(ts)[:40]}"


def _is_spare(job: JobRecord, node: Any) -> bool:
    """Healthy, attached and in no worker's place while the job runs, and not told to go: a
    hot spare (a drained one is none either: api.status)."""
    return (not job.state.is_at_rest() and node.node_rank is None
            and node.state.value in ("CONNECTED", "STOPPED") and not node.info.get("notice"))


def _notice(notice: dict[str, Any] | None) -> dict[str, Any] | None:
    """A node's notice (its agent was told to go: orchestrator/drain.py) as status shows it."""
    return None if notice is None else {"source": notice.get("source"),
                                        "deadline": iso(notice.get("deadline"))}


def status_dict(job: JobRecord) -> dict[str, Any]:
    """The job as ``status --json`` shows it (docs/reference/cli.md): its state, controller, nodes,
    the current attempt's ranks, the attempts, the failure and the time lost."""
    hosts = {n.node_index: n.host for n in job.nodes}
    controller = controller_view(job)
    current = next((a for a in job.attempts if a.attempt == job.attempt), None)
    slow = current.stragglers if current is not None else []
    ranks = []
    for r in job.ranks:
        if r.attempt != job.attempt:
            continue
        ranks.append({
            "rank": r.rank, "local_rank": r.local_rank, "node_index": r.node_index,
            "host": hosts.get(r.node_index), "pid": r.pid, "state": r.state,
            "exit_code": r.exit_code, "signal": r.signal, "step": r.step,
            "metrics": r.metrics, "steps_per_s": r.steps_per_s,
            "last_heartbeat": iso(r.heartbeat_at), "last_output": iso(r.output_at),
            "wait_share": None if r.wait_share is None else round(r.wait_share, 3),
            "straggler": r.rank in slow,
        })
    lost = timelost.summary(job.attempts, job.steps, job.ended_at)
    now = time.time()
    done = progress.progress(job, lost, now)
    if done is not None and done["eta_at"] is not None:
        done["eta_at"] = iso(done["eta_at"])
    return {
        "job_id": job.job_id,
        "name": job.name,
        "state": shown_state(job, controller),
        "recorded_state": job.state.value,
        "submitted_at": iso(job.submitted_at),
        "started_at": iso(job.started_at),
        "ended_at": iso(job.ended_at),
        "attempt": job.attempt,
        "restarts": job.restarts,
        "max_restarts": job.max_restarts,
        "free_restarts": job.free_restarts,
        "infra_restarts": job.infra_restarts,
        "controller": controller,
        "timeline": timeline.shown(job.timeline_json, job.submitted_at),
        "paused": None if job.paused is None or job.state.is_at_rest() else {
            "since": iso(job.paused.get("since")), "reason": job.paused.get("reason")},
        "controller_grace": json.loads(job.spec_json).get("health", {}).get("controller_grace"),
        "slurm": None if job.slurm is None else {
            "job_id": job.slurm.get("job_id"), "nodes": job.slurm.get("nodes") or [],
            "owned": job.slurm.get("owned"), "released": job.slurm.get("released", False)},
        "nodes": [
            {"node_index": n.node_index, "host": n.host, "node_rank": n.node_rank,
             "state": n.state.value, "spare": _is_spare(job, n),
             "hostname": n.info.get("hostname"),
             "agent_pid": n.info.get("pid"), "error": n.info.get("error"),
             "sync": n.info.get("sync"), "last_heard": iso(n.heard_at),
             "longest_silence_s": None if n.longest_silence is None else
             round(n.longest_silence, 1),
             "checkpoint": n.info.get("checkpoint"),
             "notice": _notice(n.info.get("notice")),
             "history": [{"at": iso(e.at), "state": e.state.value, "message": e.message}
                         for e in n.history],
             "entered": dict(n.entered)}
            for n in job.nodes
        ],
        "ranks": ranks,
        "stragglers": slow,
        "failure": job.failure,
        "time_lost": lost,
        "progress": done,
        "attempts": [
            {"attempt": a.attempt, "started_at": iso(a.started_at), "ended_at": iso(a.ended_at),
             "outcome": a.outcome or AttemptOutcome.RUNNING.value,
             "master_addr": a.master_addr,
             "master_port": a.master_port, "world_size": a.world_size, "failure": a.failure,
             # Under synchronous collectives the job goes at its slowest rank's pace.
             "steps_per_s": job.rates.get(a.attempt),
             "stragglers": a.stragglers, "warm_starts": a.warm_starts,
             "restored_step": a.restored_step}
            for a in job.attempts
        ],
    }
