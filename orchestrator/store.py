"""The job store: one SQLite database (WAL) under ``$ORCHESTRATOR_HOME`` and the log tree.

Only a job's controller writes its rows (``submit`` creates the row, ``cancel`` sets a
request flag); every other command reads, and a reader that finds the controller dead says
so without rewriting anything. Layout::

    $ORCHESTRATOR_HOME/            (default ~/.orchestrator, mode 0700)
      state.db
      jobs/<job_id>/controller.log
      jobs/<job_id>/logs/attempt-<n>/rank-<r>.log     raw lines of one rank
      jobs/<job_id>/logs/attempt-<n>/combined.log     "[host:rank] line", arrival order

The controller writes logs in batches and, in one transaction with each checkpoint, records
how far every log file and every agent's message sequence has been kept (``checkpoint``).
Agents forget only what a checkpoint holds, so a replaced controller truncates the logs to
the checkpoint and has the agents replay the rest: every line exactly once.

This module owns the home (its privacy, the job ids that become its paths, its free space
and reserve), the one connection, which writes go together in one transaction, and the
clock of every row (the modules below are given ``now``: one clock, which a simulation
replaces here, benchmarks/bench_endurance.py). ``Store`` is the one API the rest of the
orchestrator uses. The rows themselves are the concern modules': ``storejobs`` (jobs),
``storenodes`` (nodes and their history), ``storeattempts`` (attempts, ranks,
checkpoints), ``storesamples`` (samples and their thinning), ``storehosts`` (host events,
quarantine, settings), over ``storedb`` (the schema, the connection's pragmas,
transactions, ``unwritable``). May call those, ``pids``, ``records``, ``state`` and
``errors``; none of them calls it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from orchestrator import (
    pids,
    storeattempts,
    storedb,
    storehosts,
    storejobs,
    storenodes,
    storesamples,
)
from orchestrator.errors import JobNotFoundError, StoreError, StoreUnwritable
from orchestrator.records import JobRecord
from orchestrator.state import JobState, NodeState
from orchestrator.storedb import unwritable
from orchestrator.storejobs import REDACTED, REDACTED_URL
from orchestrator.storenodes import HISTORY
from orchestrator.storesamples import MAX_SAMPLES, SAMPLE_BANDS

__all__ = ["HISTORY", "JOB_ID_RE", "MAX_SAMPLES", "REDACTED", "REDACTED_URL", "SAMPLE_BANDS",
           "JobRecord", "Store", "check_job_id", "default_home", "unwritable"]

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")

# Whether many rows go in one statement (storedb.update_rows). Read here at each write, as
# is MAX_SAMPLES at each compaction: the values in force are this module's (the tests turn
# batching off here to cover the per-row path, and lower the cap).
_BATCH = storedb.CAN_BATCH


def default_home() -> Path:
    return Path(os.environ.get("ORCHESTRATOR_HOME") or Path.home() / ".orchestrator")


def _make_private(home: Path) -> None:
    """$ORCHESTRATOR_HOME holds every job's env and agent secrets: 0700, or refused."""
    st = os.lstat(home)
    if not os.path.isdir(home) or (os.path.islink(home) and st.st_uid != os.getuid()):
        raise StoreError(f"{home} ($ORCHESTRATOR_HOME) is not a directory")
    st = os.stat(home)
    if st.st_uid != os.getuid():
        raise StoreError(f"{home} ($ORCHESTRATOR_HOME) belongs to uid {st.st_uid}, not to you "
                         f"(uid {os.getuid()}): use a directory of your own")
    if st.st_mode & 0o077:
        os.chmod(home, 0o700)  # ours, but readable by others: an older version, or by hand


def check_job_id(job_id: str) -> str:
    """Job ids become paths: refuse anything but the shape we generate."""
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise JobNotFoundError(job_id)
    return job_id


class Store:
    """Access to the state database and the log tree of one ``$ORCHESTRATOR_HOME``."""

    def __init__(self, home: str | os.PathLike[str] | None = None, *, durable: bool = False):
        self.home = Path(home) if home is not None else default_home()
        self.jobs_dir = self.home / "jobs"
        # The database holds each job's secret and env: nobody else may read it (nor its WAL
        # and SHM files, which SQLite creates later with the process umask).
        old_umask = os.umask(0o077)
        try:
            self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
            _make_private(self.home)
            self.jobs_dir.mkdir(mode=0o700, exist_ok=True)
            self._db, self.journal, self.journal_why = storedb.connect(self.home,
                                                                       durable=durable)
        except (OSError, sqlite3.Error) as exc:
            reason = unwritable(exc)
            if reason is not None:
                raise StoreUnwritable(str(self.home / "state.db"), reason) from exc
            raise StoreError(f"cannot use the state directory {self.home} "
                             f"($ORCHESTRATOR_HOME): {exc}") from exc
        finally:
            os.umask(old_umask)

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction. A database that cannot be written now (a full disk, a
        read-only or vanished home) raises StoreUnwritable, and nothing of it is kept."""
        return storedb.transaction(self._db, str(self.home / "state.db"))

    # --- paths ---------------------------------------------------------------------------
    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / check_job_id(job_id)

    def log_dir(self, job_id: str, attempt: int) -> Path:
        return self.job_dir(job_id) / "logs" / f"attempt-{int(attempt)}"

    # --- writes (submit) -----------------------------------------------------------------
    def create_job(self, job_id: str, name: str, spec_json: str, spec_dir: str,
                   max_restarts: int, hosts: list[str], secret: str | None = None,
                   slurm: dict[str, Any] | None = None,
                   world: dict[str, Any] | None = None) -> None:
        """A new PENDING job. ``world`` is the submitter's environment and umask
        (orchestrator.world), kept for the workers: it may hold secrets, like ``env:``."""
        check_job_id(job_id)
        with self._transaction() as db:
            storejobs.insert(db, job_id, name, spec_json, spec_dir, max_restarts, time.time(),
                             secret, slurm, world)
            storenodes.insert(db, job_id, hosts)
        self.job_dir(job_id).mkdir(mode=0o700, parents=True, exist_ok=True)

    def request_cancel(self, job_id: str) -> None:
        with self._transaction() as db:
            storejobs.request_cancel(db, job_id)

    # --- writes (the job's controller) ---------------------------------------------------
    def set_state(self, job_id: str, new: JobState, **fields: Any) -> None:
        """Change a job's state after checking the transition table; extra columns too. A
        job that ends keeps no secret: its agent secret, the submitter's environment, its
        env values and webhook URLs are wiped in the same transaction (not one PREEMPTED:
        ``resume`` needs them)."""
        with self._transaction() as db:
            storejobs.set_state(db, job_id, new, fields, time.time())
        if new.is_terminal():  # the old page versions, with the secrets, leave the WAL too
            storedb.truncate_wal(self._db)

    # --- retention ------------------------------------------------------------------------
    def prune(self, ended_before: float, *, dry_run: bool = False) -> list[str]:
        """Jobs that ended before ``ended_before`` (unix time): their records, samples and
        logs removed (unless ``dry_run``), and host events as old. Their ids, oldest first."""
        ended = storejobs.ended_before(self._db, ended_before)
        if dry_run:
            return ended
        for job_id in ended:  # a transaction each: running controllers never wait long
            with self._transaction() as db:
                storedb.delete_job(db, job_id)
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        with self._transaction() as db:
            storehosts.forget_events(db, ended_before)
            storejobs.wipe_ended_secrets(db)
        return ended

    def update_job(self, job_id: str, **fields: Any) -> None:
        if "state" in fields:
            raise ValueError("use set_state to change a job's state")
        with self._transaction() as db:
            storedb.update(db, "jobs", fields, job_id=job_id)

    def set_nodes(self, job_id: str,
                  changes: list[tuple[int, NodeState, str | None, dict[str, Any]]]) -> None:
        """Changes of nodes' states (each checked against the node transition table, and kept
        in the node's history with its message when the state changes) and fields, in order,
        in one transaction (one fsync, not one per
        node: a launch on thousands of nodes)."""
        if not changes:
            return
        with self._transaction() as db:
            storenodes.set_nodes(db, job_id, changes, time.time(), _BATCH)

    def end_notices(self, job_id: str) -> None:
        """The notices the nodes' last agents had are over (a PREEMPTED job resumed: it goes
        on on fresh agents). Each would pass to the node's next agent until its deadline
        (nodebook.py attach), and the resumed job find every node told to go and stop
        PREEMPTED again."""
        self.set_nodes(job_id, [(n.node_index, n.state, None, {"info": {**n.info,
                                                                        "notice": None}})
                                for n in self.get_job(job_id).nodes if n.info.get("notice")])

    def set_slurm(self, job_id: str, allocation: dict[str, Any],
                  hosts: list[str] | None = None) -> None:
        """Record the job's Slurm allocation and, once granted, its nodes' host names."""
        with self._transaction() as db:
            storedb.update(db, "jobs", {"slurm_json": json.dumps(allocation)}, job_id=job_id)
            storenodes.set_hosts(db, job_id, hosts or [])

    def claim_controller(self, job_id: str, pid: int, host: str, pidns: str | None) -> None:
        """Record the process that controls the job from now on, and where its pid means
        something (host and PID namespace), and which process it is (pids.identity). It
        runs: the job is neither paused nor failing any more."""
        self.update_job(job_id, controller_pid=pid, controller_host=host,
                        controller_pidns=pidns, controller_since=time.time(),
                        controller_ident=pids.identity(pid), paused_json=None,
                        failing_json=None)

    def claim_supervisor(self, job_id: str, pid: int) -> None:
        self.update_job(job_id, supervisor_pid=pid, supervisor_ident=pids.identity(pid))

    # --- a home that cannot be written (orchestrator/pause.py) ----------------------------
    RESERVE = ".reserve"
    RESERVE_BYTES = 4 << 20

    def check_room(self, floor: int) -> None:
        """StoreUnwritable unless the home's filesystem has ``floor`` bytes free and the
        home can be written."""
        try:
            st = os.statvfs(self.home)
        except OSError as exc:
            raise StoreUnwritable(str(self.home), exc.strerror or str(exc)) from exc
        free = st.f_bavail * st.f_frsize
        if free < floor:
            raise StoreUnwritable(str(self.home), f"{free} bytes free, less than {floor} "
                                                  "(logs.min_free_bytes)")
        if not os.access(self.home, os.W_OK):
            raise StoreUnwritable(str(self.home), "it is read-only")

    def keep_reserve(self) -> bool:
        """A few MiB the home keeps so that, its disk full, a paused controller can still
        record why (freed by note_pause). Whether it is in place: made where there is room
        for it, else not (and a paused controller waits until it can be)."""
        path = self.home / self.RESERVE
        try:
            if path.stat().st_size >= self.RESERVE_BYTES:
                return True
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.RESERVE_BYTES)
            finally:
                os.close(fd)
            return True
        except OSError:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            return False

    def room_again(self, job_id: str, floor: int) -> bool:
        """Whether a paused job's home has room again: ``floor`` bytes free, its reserve
        back (for the note of the next pause), and its pause note cleared (a real write).
        False, or StoreUnwritable, while not."""
        self.check_room(floor)
        if not self.keep_reserve():
            return False
        self.note_pause(job_id, None, strict=True)
        return True

    def note_pause(self, job_id: str, note: dict[str, Any] | None, *,
                   strict: bool = False) -> None:
        """Record (or clear, None) why the job's controller is paused. Its disk full, the
        reserve is given up for it; ``strict``: StoreUnwritable if it cannot be written,
        else it is only logged by the caller's other means."""
        value = json.dumps(note) if note is not None else None
        try:
            self.update_job(job_id, paused_json=value)
        except StoreUnwritable:
            if strict:
                raise
            try:
                (self.home / self.RESERVE).unlink(missing_ok=True)
                self.update_job(job_id, paused_json=value)
            except (OSError, StoreUnwritable):
                pass

    # --- writes (the job's controller): attempts, ranks, samples ----------------------------
    def liveness(self, job_id: str, attempt: int, nodes: dict[int, float],
                 ranks: dict[int, float], silences: dict[int, float] | None = None) -> None:
        """When each node was last heard (and the longest it went unheard) and each rank
        last printed (wall clock)."""
        with self._transaction() as db:
            storenodes.heard(db, job_id, nodes, silences or {}, _BATCH)
            storeattempts.output_at(db, job_id, attempt, ranks, _BATCH)

    def checkpoint(self, job_id: str, attempt: int, state: dict[str, Any],
                   acked: dict[int, int], warm_starts: int = 0) -> None:
        """Record, at one moment, an attempt's bookkeeping (log sizes, exits) and how far
        each node's messages are kept; and its warm starts so far, for readers."""
        with self._transaction() as db:
            storeattempts.checkpoint(db, job_id, attempt, state, warm_starts)
            storenodes.acked(db, job_id, acked, _BATCH)

    def start_attempt(self, job_id: str, attempt: int, master_addr: str, master_port: int,
                      world_size: int, ranks: list[tuple[int, int, int]],
                      restored_step: int | None = None) -> None:
        """Record a new attempt (and the checkpoint step it resumes) and its ranks as (rank,
        node_index, local_rank)."""
        with self._transaction() as db:
            storeattempts.start(db, job_id, attempt, master_addr, master_port, world_size,
                                ranks, time.time(), restored_step)
            storedb.update(db, "jobs", {"attempt": attempt}, job_id=job_id)

    def set_restored_step(self, job_id: str, attempt: int, step: int) -> None:
        """The step an attempt's ranks did resume, where it is not the one they were told
        (an older one every rank has, or a DCP load resharded from the persisted copies)."""
        with self._transaction() as db:
            storeattempts.set_restored_step(db, job_id, attempt, step)

    def update_ranks(self, job_id: str, attempt: int,
                     fields_by_rank: dict[int, dict[str, Any]]) -> None:
        """Several ranks of one attempt in one transaction (``metrics`` as a dict)."""
        with self._transaction() as db:
            storeattempts.update_ranks(db, job_id, attempt, fields_by_rank, _BATCH)

    def record_progress(self, job_id: str, attempt: int,
                        fields_by_rank: dict[int, dict[str, Any]],
                        samples: list[tuple[int, int | None, float, dict[str, float]]],
                        stragglers: list[int] | None = None) -> None:
        """Ranks' latest steps and metrics, new samples for the history as (rank, step, at,
        metrics), and the attempt's stragglers when they changed: one transaction."""
        with self._transaction() as db:
            storeattempts.update_ranks(db, job_id, attempt, fields_by_rank, _BATCH)
            storesamples.add(db, job_id, attempt, samples)
            if stragglers is not None:
                storeattempts.set_stragglers(db, job_id, attempt, stragglers)

    def samples(self, job_id: str, *, rank: int | None = None, limit: int = 20000,
                ) -> list[tuple[int, int, int | None, float, dict[str, float]]]:
        """The metric history as (attempt, rank, step, at, metrics), oldest first; the
        newest ``limit`` of them."""
        return storesamples.read(self._db, job_id, rank, limit)

    def compact_samples(self, job_id: str, now: float, since: float | None = None) -> int:
        """Thin a job's samples as they age (SAMPLE_BANDS: every one for an hour, then one
        per rank per bucket whose width doubles with the age) and keep at most MAX_SAMPLES
        (the oldest go). ``since``: when this was last done, so that only the samples that
        aged into a band since are looked at (None: every band whole, once). Rows removed."""
        with self._transaction() as db:
            removed = storesamples.compact(db, job_id, now, since, MAX_SAMPLES)
        if removed:
            self._db.execute("PRAGMA incremental_vacuum")
        return removed

    def end_attempt(self, job_id: str, attempt: int, outcome: str,
                    failure: dict[str, Any] | None, warm_starts: int = 0,
                    after: dict[str, Any] | None = None,
                    counts: dict[str, int] | None = None) -> None:
        """An attempt's end; what its ranks' steps say of it is summed up now, once, so
        that readers never go through an ended attempt's ranks again. ``after``: what its
        controller decided comes next (AttemptRecord.next), and ``counts``, the job's restart
        counts that decision charged, in the same transaction."""
        with self._transaction() as db:
            storeattempts.end(db, job_id, attempt, outcome, failure, warm_starts, time.time(),
                              after)
            if counts:
                storedb.update(db, "jobs", dict(counts), job_id=job_id)

    def end_open_attempt(self, job_id: str, final: JobState,
                         failure: dict[str, Any] | None) -> None:
        """End the job's last attempt, if it is still open, as the job ends ``final``
        without its controller (a controller that kept failing)."""
        job = self.get_job(job_id)
        if job.attempts and job.attempts[-1].ended_at is None:
            outcome = "CANCELLED" if final == JobState.CANCELLED else "FAILED"
            self.end_attempt(job_id, job.attempts[-1].attempt, outcome, failure,
                             job.attempts[-1].warm_starts)

    # --- hosts across jobs (orchestrator/reputation.py) -----------------------------------------
    def add_host_event(self, host: str, job_id: str, kind: str, detail: str,
                       at: float | None = None) -> None:
        with self._transaction() as db:
            storehosts.add_event(db, host, job_id, kind, detail, at or time.time())

    def host_events(self, since: float, host: str | None = None) -> list[dict[str, Any]]:
        """Events since ``since``, oldest first (of one host, or all)."""
        return storehosts.events(self._db, since, host)

    def quarantines(self) -> dict[str, dict[str, Any]]:
        """Every host ever quarantined: host -> {since, until, level, reason, released_at}."""
        return storehosts.quarantines(self._db)

    def set_quarantine(self, host: str, since: float, until: float, level: int,
                       reason: str) -> None:
        with self._transaction() as db:
            storehosts.set_quarantine(db, host, since, until, level, reason)

    def settings(self, prefix: str) -> dict[str, str]:
        """Stored settings whose names start with ``prefix``: name -> value (JSON text)."""
        return storehosts.settings(self._db, prefix)

    def set_settings(self, values: dict[str, str]) -> None:
        with self._transaction() as db:
            storehosts.set_settings(db, values)

    def release_quarantine(self, host: str) -> bool:
        """End ``host``'s quarantine now; False if it had none in force."""
        now = time.time()
        with self._transaction() as db:
            return storehosts.release_quarantine(db, host, now)

    def set_drain(self, target: str, job_id: str, reason: str, within: float) -> None:
        """Drain ``target`` (a host; with a job, also a node index) for ``job_id`` ('': all)."""
        with self._transaction() as db:
            storehosts.set_drain(db, target, job_id, time.time(), reason, within)

    def remove_drain(self, target: str, job_id: str) -> bool:
        with self._transaction() as db:
            return storehosts.remove_drain(db, target, job_id)

    def drains(self) -> list[dict[str, Any]]:
        """Every drain in force, oldest first: {target, job_id, since, reason, within}."""
        return storehosts.drains(self._db)

    # --- reads ---------------------------------------------------------------------------
    def get_job(self, job_id: str) -> JobRecord:
        check_job_id(job_id)
        # One read transaction, so a job, its nodes and its ranks are seen at one moment.
        self._db.execute("BEGIN")
        try:
            job = storejobs.read(self._db, job_id)
            job.nodes = storenodes.read(self._db, job_id)
            storeattempts.read_into(self._db, job)
        finally:
            self._db.execute("COMMIT")
        return job

    def checkpoint_of(self, job_id: str, attempt: int) -> dict[str, Any] | None:
        """The last checkpoint of an attempt (read by a controller that resumes it)."""
        return storeattempts.checkpoint_of(self._db, job_id, attempt)

    def ranks_of_node(self, job_id: str, node_index: int) -> set[int]:
        """The ranks that ran on a node, in any attempt (``logs --node``)."""
        return storeattempts.ranks_of_node(self._db, job_id, node_index)

    def world(self, job_id: str) -> dict[str, Any] | None:
        """The submitter's world kept with the job (None for jobs of older versions). Read
        only by the job's controller: it is never part of a status."""
        return storejobs.world(self._db, check_job_id(job_id))

    def list_jobs(self) -> list[JobRecord]:
        return storejobs.list_all(self._db)

    def request_stacks(self, job_id: str) -> float:
        """Ask the job's controller for every rank's stack (a request, like cancel)."""
        at = time.time()
        with self._transaction() as db:
            storejobs.request_stacks(db, job_id, at)
        return at

    def stacks(self, job_id: str) -> tuple[float | None, float | None, dict[str, Any] | None]:
        """(requested at, answered at, the answer) of the last stacks request."""
        return storejobs.stacks(self._db, job_id)

    def requests(self, job_id: str) -> tuple[bool, bool]:
        """What readers asked of the controller, in one read for its polling loop: (cancel
        requested, a stacks request not answered yet)."""
        return storejobs.requests(self._db, job_id)

    def timeline(self, job_id: str) -> tuple[float, str | None]:
        """When the job was submitted, and the phases its controllers marked (JSON)."""
        return storejobs.timeline(self._db, job_id)

    def job_attempt(self, job_id: str) -> tuple[JobState, int]:
        """The state and the current attempt: what a follower of the logs polls."""
        return storejobs.job_attempt(self._db, job_id)

    def job_state(self, job_id: str) -> tuple[JobState, bool]:
        """The state and the cancel flag: the cheap read a polling loop needs."""
        return storejobs.job_state(self._db, job_id)
