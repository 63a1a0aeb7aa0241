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
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrator import homefs, pids
from orchestrator.errors import JobNotFoundError, StoreError, StoreUnwritable
from orchestrator.records import (
    AttemptRecord,
    AttemptSteps,
    JobRecord,
    NodeEvent,
    NodeRecord,
    RankRecord,
    StepSpan,
    per_attempt,
)
from orchestrator.state import JobState, NodeState, check_node_transition, check_transition

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    spec_dir TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    attempt INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    max_restarts INTEGER NOT NULL,
    controller_pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    failure_json TEXT,
    secret TEXT,
    controller_host TEXT,
    controller_since REAL,
    supervisor_pid INTEGER,
    free_restarts INTEGER NOT NULL DEFAULT 0,
    infra_restarts INTEGER NOT NULL DEFAULT 0,
    controller_pidns TEXT,
    stacks_requested_at REAL,
    stacks_json TEXT,
    stacks_at REAL,
    slurm_json TEXT,
    world_json TEXT,
    controller_ident TEXT,
    supervisor_ident TEXT,
    paused_json TEXT,
    failing_json TEXT,
    resume_requested_at REAL
);
CREATE TABLE IF NOT EXISTS nodes (
    job_id TEXT NOT NULL,
    node_index INTEGER NOT NULL,
    host TEXT NOT NULL,
    node_rank INTEGER,
    state TEXT NOT NULL,
    info_json TEXT,
    acked_seq INTEGER NOT NULL DEFAULT 0,
    heard_at REAL,
    longest_silence REAL,
    PRIMARY KEY (job_id, node_index)
);
CREATE TABLE IF NOT EXISTS node_events (
    job_id TEXT NOT NULL,
    node_index INTEGER NOT NULL,
    at REAL NOT NULL,
    state TEXT NOT NULL,
    message TEXT
);
CREATE INDEX IF NOT EXISTS node_events_by_job ON node_events (job_id, at);
CREATE TABLE IF NOT EXISTS ranks (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    node_index INTEGER NOT NULL,
    local_rank INTEGER NOT NULL,
    pid INTEGER,
    state TEXT NOT NULL,
    exit_code INTEGER,
    signal TEXT,
    step INTEGER,
    metrics_json TEXT,
    steps_per_s REAL,
    heartbeat_at REAL,
    output_at REAL,
    wait_share REAL,
    first_step INTEGER,
    first_step_at REAL,
    step_at REAL,
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    outcome TEXT,
    master_addr TEXT,
    master_port INTEGER,
    world_size INTEGER,
    failure_json TEXT,
    checkpoint_json TEXT,
    stragglers_json TEXT,
    warm_starts INTEGER,
    steps_json TEXT,
    PRIMARY KEY (job_id, attempt)
);
-- Across jobs: what happened to each host (infrastructure failures it was part of), and the
-- hosts quarantined for it (orchestrator/reputation.py).
CREATE TABLE IF NOT EXISTS host_events (
    host TEXT NOT NULL,
    at REAL NOT NULL,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS host_events_by_host ON host_events (host, at);
CREATE TABLE IF NOT EXISTS quarantine (
    host TEXT PRIMARY KEY,
    since REAL NOT NULL,
    until REAL NOT NULL,
    level INTEGER NOT NULL,
    reason TEXT NOT NULL,
    released_at REAL
);
-- Settings of this home, across jobs (the quarantine's thresholds: `orchestrator nodes policy`).
CREATE TABLE IF NOT EXISTS settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- Steps and metrics as the ranks reported them, for plots across attempts.
CREATE TABLE IF NOT EXISTS samples (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    step INTEGER,
    at REAL NOT NULL,
    metrics_json TEXT NOT NULL
);
-- The newest of a job (the dashboard's plot), of one rank, and those of an age (compaction).
CREATE INDEX IF NOT EXISTS samples_by_time ON samples (job_id, at);
CREATE INDEX IF NOT EXISTS samples_by_rank ON samples (job_id, rank, at);
DROP INDEX IF EXISTS samples_by_job;
CREATE INDEX IF NOT EXISTS jobs_by_end ON jobs (ended_at);
"""
# Columns added since the first release, for databases created before them.
_ADDED_COLUMNS = {
    "jobs": {"secret": "TEXT", "controller_host": "TEXT", "controller_since": "REAL",
             "supervisor_pid": "INTEGER", "free_restarts": "INTEGER NOT NULL DEFAULT 0",
             "infra_restarts": "INTEGER NOT NULL DEFAULT 0",
             "controller_pidns": "TEXT", "stacks_requested_at": "REAL",
             "stacks_json": "TEXT", "stacks_at": "REAL", "slurm_json": "TEXT",
             "world_json": "TEXT", "controller_ident": "TEXT", "supervisor_ident": "TEXT",
             "paused_json": "TEXT", "failing_json": "TEXT", "resume_requested_at": "REAL"},
    "nodes": {"acked_seq": "INTEGER NOT NULL DEFAULT 0", "heard_at": "REAL",
              "longest_silence": "REAL"},
    "ranks": {"step": "INTEGER", "metrics_json": "TEXT", "steps_per_s": "REAL",
              "heartbeat_at": "REAL", "output_at": "REAL", "wait_share": "REAL",
              "first_step": "INTEGER", "first_step_at": "REAL", "step_at": "REAL"},
    "attempts": {"checkpoint_json": "TEXT", "stragglers_json": "TEXT",
                 "warm_starts": "INTEGER", "steps_json": "TEXT"},
}


def _can_batch() -> bool:
    """Whether this SQLite has UPDATE ... FROM (3.33), MATERIALIZED (3.35) and the JSON
    functions, with which many rows go in one statement (Store._update_rows)."""
    if sqlite3.sqlite_version_info < (3, 35, 0):
        return False
    try:
        with closing(sqlite3.connect(":memory:")) as db:
            db.execute("SELECT value FROM json_each('[1]')").fetchall()
    except sqlite3.Error:
        return False
    return True


_BATCH = _can_batch()


# Metric samples as they age (Store.compact_samples): every one for the last hour; older,
# one per rank per bucket of 2 min (1-2 h old), 4 min (2-4 h), ... 32 min (16-32 h): 30 to
# each doubling of the age; past 32 h, 15 (128 min for 32-64 h, ... 1024 min past 256 h);
# at most MAX_SAMPLES a job. A 1,000-rank job keeps about 260 samples a rank after a week.
SAMPLE_BANDS = tuple((3600.0 * 2 ** k, (120.0 if k < 5 else 240.0) * 2 ** k)
                     for k in range(9))
MAX_SAMPLES = 1_000_000
HISTORY = 10  # node changes a status shows per node (NodeRecord.entered counts them all)

# SQLite's primary result codes that mean "cannot write here now", not "a bug of ours".
_SQLITE_UNWRITABLE = {13: "the disk is full", 10: "an I/O error", 8: "it is read-only",
                      14: "it cannot be opened"}


_ERRNO_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE}


def unwritable(exc: BaseException) -> str | None:
    """Why a write under the home failed when it is not our bug: SQLite or the filesystem
    said the disk is full (or the quota), it is read-only, gone (a stale NFS handle) or
    failing; None for anything else."""
    if isinstance(exc, StoreUnwritable):
        return exc.reason
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) if exc.errno in _ERRNO_UNWRITABLE else None
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if isinstance(code, int) and (code & 0xFF) in _SQLITE_UNWRITABLE:
        return f"{_SQLITE_UNWRITABLE[code & 0xFF]} ({exc})"
    text = str(exc).lower()
    for words, why in (("disk is full", 13), ("i/o error", 10), ("readonly", 8),
                       ("unable to open", 14)):
        if isinstance(exc, sqlite3.OperationalError) and words in text:
            return f"{_SQLITE_UNWRITABLE[why]} ({exc})"
    return None


_TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
REDACTED = "***"
REDACTED_URL = "https://redacted.invalid/"


def _without_secrets(spec_json: str) -> str:
    """An ended job's spec, its env values and webhook URLs replaced (still a valid spec)."""
    try:
        spec = json.loads(spec_json)
    except ValueError:
        return "{}"
    if not isinstance(spec, dict):
        return "{}"
    if isinstance(spec.get("env"), dict):
        spec["env"] = {k: REDACTED for k in spec["env"]}
    for target in spec.get("notify") or ():
        if isinstance(target, dict) and "url" in target:
            target["url"] = REDACTED_URL
    return json.dumps(spec)


def _json_or_none(text: str | None) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


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
            self._db = sqlite3.connect(self.home / "state.db", timeout=30,
                                       isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            # Pages the thinning of samples frees go back to the filesystem (a new database
            # only, and set before its journal mode: one made by an older version keeps its
            # free pages for new rows instead). Only when new: on an existing database the
            # pragma writes its header, and a reader must work on a full disk.
            if self._db.execute("PRAGMA page_count").fetchone()[0] == 0:
                self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            # WAL where the home is local; the rollback journal on a network filesystem,
            # where WAL is not safe (orchestrator/homefs.py).
            self.journal, self.journal_why = homefs.journal_mode(self.home)
            got = self._db.execute(f"PRAGMA journal_mode={self.journal}").fetchone()[0]
            if got != self.journal:  # another process has it open in the other mode
                self.journal = got
            # A controller's checkpoints are acknowledged to agents, which then forget: each
            # commit must be on disk (FULL). Readers need no such care.
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.execute("PRAGMA busy_timeout=30000")
            # The WAL is cut back to 4 MiB after a checkpoint, not kept at its high water.
            self._db.execute("PRAGMA journal_size_limit=4194304")
            # What is deleted or overwritten is zeroed on disk: an ended job's secrets are
            # wiped (set_state), not left in free pages.
            self._db.execute("PRAGMA secure_delete=ON")
            # Sorting and grouping (compact_samples) in memory: a full /tmp is not ours.
            self._db.execute("PRAGMA temp_store=MEMORY")
            self._db.executescript(_SCHEMA)
            self._migrate()
            for name in ("state.db", "state.db-wal", "state.db-shm"):  # made by older versions
                path = self.home / name
                if path.exists() and path.stat().st_mode & 0o077:
                    os.chmod(path, 0o600)
        except (OSError, sqlite3.Error) as exc:
            reason = unwritable(exc)
            if reason is not None:
                raise StoreUnwritable(str(self.home / "state.db"), reason) from exc
            raise StoreError(f"cannot use the state directory {self.home} "
                             f"($ORCHESTRATOR_HOME): {exc}") from exc
        finally:
            os.umask(old_umask)

    def _migrate(self) -> None:
        for table, columns in _ADDED_COLUMNS.items():
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction. A database that cannot be written now (a full disk, a
        read-only or vanished home) raises StoreUnwritable, and nothing of it is kept."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")  # on a full disk, COMMIT itself may fail
            except BaseException:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise
        except sqlite3.Error as exc:
            reason = unwritable(exc)
            if reason is None:
                raise
            raise StoreUnwritable(str(self.home / "state.db"), reason) from exc

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
            db.execute(
                "INSERT INTO jobs (job_id, name, state, spec_json, spec_dir, submitted_at,"
                " max_restarts, secret, slurm_json, world_json)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, name, JobState.PENDING.value, spec_json, spec_dir, time.time(),
                 max_restarts, secret, json.dumps(slurm) if slurm is not None else None,
                 json.dumps(world) if world is not None else None),
            )
            db.executemany(
                "INSERT INTO nodes (job_id, node_index, host, state) VALUES (?, ?, ?, ?)",
                [(job_id, i, h, NodeState.PENDING.value) for i, h in enumerate(hosts)],
            )
        self.job_dir(job_id).mkdir(mode=0o700, parents=True, exist_ok=True)

    def request_cancel(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE job_id = ?", (job_id,))

    # --- writes (the job's controller) ---------------------------------------------------
    def set_state(self, job_id: str, new: JobState, **fields: Any) -> None:
        """Change a job's state after checking the transition table; extra columns too. A
        job that ends keeps no secret: its agent secret, the submitter's environment, its
        env values and webhook URLs are wiped in the same transaction."""
        with self._transaction() as db:
            row = db.execute("SELECT state, spec_json FROM jobs WHERE job_id = ?",
                             (job_id,)).fetchone()
            if row is None:
                raise JobNotFoundError(job_id)
            check_transition(JobState(row["state"]), new)
            if new.is_terminal():
                fields.setdefault("ended_at", time.time())
                fields.update(secret=None, world_json=None,
                              spec_json=_without_secrets(row["spec_json"]))
            self._update(db, "jobs", {"state": new.value, **fields}, job_id=job_id)
        if new.is_terminal():  # the old page versions, with the secrets, leave the WAL too
            self._db.execute("PRAGMA busy_timeout=200")  # never wait on readers for it
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass  # a reader holds it: the next checkpoint overwrites them
            finally:
                self._db.execute("PRAGMA busy_timeout=30000")

    # --- retention ------------------------------------------------------------------------
    def prune(self, ended_before: float, *, dry_run: bool = False) -> list[str]:
        """Jobs that ended before ``ended_before`` (unix time): their records, samples and
        logs removed (unless ``dry_run``), and host events as old. Their ids, oldest first."""
        terminal = tuple(s.value for s in _TERMINAL)
        ended = [r["job_id"] for r in self._db.execute(
            "SELECT job_id FROM jobs WHERE ended_at IS NOT NULL AND ended_at < ? AND state IN"
            " (?, ?, ?) ORDER BY ended_at", (ended_before, *terminal))]
        if dry_run:
            return ended
        for job_id in ended:  # a transaction each: running controllers never wait long
            with self._transaction() as db:
                for table in ("samples", "ranks", "attempts", "node_events", "nodes", "jobs"):
                    db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        with self._transaction() as db:
            db.execute("DELETE FROM host_events WHERE at < ?", (ended_before,))
            # Jobs that ended under an older version still hold their secrets: not any more.
            for row in db.execute("SELECT job_id, spec_json FROM jobs WHERE state IN (?, ?, ?)"
                                  " AND (secret IS NOT NULL OR world_json IS NOT NULL)",
                                  terminal).fetchall():
                self._update(db, "jobs", {"secret": None, "world_json": None,
                                          "spec_json": _without_secrets(row["spec_json"])},
                             job_id=row["job_id"])
        return ended

    def update_job(self, job_id: str, **fields: Any) -> None:
        if "state" in fields:
            raise ValueError("use set_state to change a job's state")
        with self._transaction() as db:
            self._update(db, "jobs", fields, job_id=job_id)

    def set_nodes(self, job_id: str,
                  changes: list[tuple[int, NodeState, str | None, dict[str, Any]]]) -> None:
        """Changes of nodes' states (each checked against the node transition table, and kept
        in the node's history with its message when the state changes) and fields, in order,
        in one transaction (one fsync, not one per
        node: a launch on thousands of nodes)."""
        if not changes:
            return
        with self._transaction() as db:
            states = self._node_states(db, job_id)
            rows: dict[int, dict[str, Any]] = {}
            events: list[list[Any]] = []
            now = time.time()
            for node_index, state, message, given in changes:
                if node_index not in states:
                    raise JobNotFoundError(job_id)
                fields = dict(given)
                if "info" in fields:
                    fields["info_json"] = json.dumps(fields.pop("info"))
                current = states[node_index]
                check_node_transition(current, state)
                states[node_index] = state
                merged = rows.setdefault(node_index, {})
                merged.pop("state", None)  # the state goes last: columns keep one order
                merged.update(fields, state=state.value)
                if current != state:
                    events.append([node_index, now, state.value, message])
            self._update_rows(db, "nodes", "node_index", rows, job_id=job_id)
            if events and not _BATCH:
                db.executemany("INSERT INTO node_events (job_id, node_index, at, state, message)"
                               " VALUES (?, ?, ?, ?, ?)", [(job_id, *e) for e in events])
            elif events:
                db.execute("INSERT INTO node_events (job_id, node_index, at, state, message) "
                           "SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]'), "
                           "json_extract(value, '$[2]'), json_extract(value, '$[3]') "
                           "FROM json_each(?)", (job_id, json.dumps(events)))

    @staticmethod
    def _node_states(db: sqlite3.Connection, job_id: str) -> dict[int, NodeState]:
        if _BATCH:  # one row back, not one per node (see _update_rows for why that matters)
            row = db.execute("SELECT json_group_object(node_index, state) AS states FROM nodes "
                             "WHERE job_id = ?", (job_id,)).fetchone()
            pairs = json.loads(row["states"]).items()
        else:
            pairs = db.execute("SELECT node_index, state FROM nodes WHERE job_id = ?",
                               (job_id,)).fetchall()
        return {int(k): NodeState(v) for k, v in pairs}

    def set_slurm(self, job_id: str, allocation: dict[str, Any],
                  hosts: list[str] | None = None) -> None:
        """Record the job's Slurm allocation and, once granted, its nodes' host names."""
        with self._transaction() as db:
            self._update(db, "jobs", {"slurm_json": json.dumps(allocation)}, job_id=job_id)
            db.executemany("UPDATE nodes SET host = ? WHERE job_id = ? AND node_index = ?",
                           [(h, job_id, i) for i, h in enumerate(hosts or [])])

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

    def liveness(self, job_id: str, attempt: int, nodes: dict[int, float],
                 ranks: dict[int, float], silences: dict[int, float] | None = None) -> None:
        """When each node was last heard (and the longest it went unheard) and each rank
        last printed (wall clock)."""
        silences = silences or {}
        with self._transaction() as db:
            self._update_rows(db, "nodes", "node_index", {
                i: {"heard_at": t, **({"longest_silence": silences[i]} if i in silences
                                      else {})} for i, t in nodes.items()}, job_id=job_id)
            self._update_rows(db, "ranks", "rank", {r: {"output_at": t} for r, t in ranks.items()},
                              job_id=job_id, attempt=attempt)

    def checkpoint(self, job_id: str, attempt: int, state: dict[str, Any],
                   acked: dict[int, int], warm_starts: int = 0) -> None:
        """Record, at one moment, an attempt's bookkeeping (log sizes, exits) and how far
        each node's messages are kept; and its warm starts so far, for readers."""
        with self._transaction() as db:
            self._update(db, "attempts", {"checkpoint_json": json.dumps(state),
                                          "warm_starts": warm_starts},
                         job_id=job_id, attempt=attempt)
            self._update_rows(db, "nodes", "node_index",
                              {i: {"acked_seq": seq} for i, seq in acked.items()}, job_id=job_id)

    def start_attempt(self, job_id: str, attempt: int, master_addr: str, master_port: int,
                      world_size: int, ranks: list[tuple[int, int, int]]) -> None:
        """Record a new attempt and its ranks as (rank, node_index, local_rank)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO attempts (job_id, attempt, started_at, master_addr, master_port,"
                " world_size) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, attempt, time.time(), master_addr, master_port, world_size),
            )
            db.executemany(
                "INSERT INTO ranks (job_id, attempt, rank, node_index, local_rank, state)"
                " VALUES (?, ?, ?, ?, ?, 'PENDING')",
                [(job_id, attempt, r, n, lr) for r, n, lr in ranks],
            )
            self._update(db, "jobs", {"attempt": attempt}, job_id=job_id)

    def update_ranks(self, job_id: str, attempt: int,
                     fields_by_rank: dict[int, dict[str, Any]]) -> None:
        """Several ranks of one attempt in one transaction (``metrics`` as a dict)."""
        with self._transaction() as db:
            self._update_ranks(db, job_id, attempt, fields_by_rank)

    def _update_ranks(self, db: sqlite3.Connection, job_id: str, attempt: int,
                      fields_by_rank: dict[int, dict[str, Any]]) -> None:
        rows = {}
        for rank, fields in fields_by_rank.items():
            fields = dict(fields)
            if "metrics" in fields:
                fields["metrics_json"] = json.dumps(fields.pop("metrics"))
            rows[rank] = fields
        self._update_rows(db, "ranks", "rank", rows, job_id=job_id, attempt=attempt)

    def record_progress(self, job_id: str, attempt: int,
                        fields_by_rank: dict[int, dict[str, Any]],
                        samples: list[tuple[int, int | None, float, dict[str, float]]],
                        stragglers: list[int] | None = None) -> None:
        """Ranks' latest steps and metrics, new samples for the history as (rank, step, at,
        metrics), and the attempt's stragglers when they changed: one transaction."""
        with self._transaction() as db:
            self._update_ranks(db, job_id, attempt, fields_by_rank)
            db.executemany(
                "INSERT INTO samples (job_id, attempt, rank, step, at, metrics_json)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(job_id, attempt, r, step, at, json.dumps(m)) for r, step, at, m in samples])
            if stragglers is not None:
                self._update(db, "attempts", {"stragglers_json": json.dumps(stragglers)},
                             job_id=job_id, attempt=attempt)

    def samples(self, job_id: str, *, rank: int | None = None, limit: int = 20000,
                ) -> list[tuple[int, int, int | None, float, dict[str, float]]]:
        """The metric history as (attempt, rank, step, at, metrics), oldest first; the
        newest ``limit`` of them."""
        where, args = "job_id = ?", list[Any]([job_id])
        if rank is not None:
            where, args = where + " AND rank = ?", [*args, rank]
        # By time, newest first, on an index: a poll costs the same on a job's 7th day.
        rows = self._db.execute(
            f"SELECT * FROM (SELECT rowid, attempt, rank, step, at, metrics_json FROM samples"
            f" WHERE {where} ORDER BY at DESC LIMIT ?) ORDER BY at, rowid", (*args, limit))
        return [(r["attempt"], r["rank"], r["step"], r["at"], _json_or_none(r["metrics_json"])
                 or {}) for r in rows]

    def compact_samples(self, job_id: str, now: float, since: float | None = None) -> int:
        """Thin a job's samples as they age (SAMPLE_BANDS: every one for an hour, then one
        per rank per bucket whose width doubles with the age) and keep at most MAX_SAMPLES
        (the oldest go). ``since``: when this was last done, so that only the samples that
        aged into a band since are looked at (None: every band whole, once). Rows removed."""
        removed = 0
        with self._transaction() as db:
            for age, width in SAMPLE_BANDS:
                upper = now - age
                lower = 0.0 if since is None else upper - (now - since) - 2 * width
                removed += db.execute(
                    "DELETE FROM samples WHERE job_id = ? AND at >= ? AND at < ? AND rowid NOT"
                    " IN (SELECT MIN(rowid) FROM samples WHERE job_id = ? AND at >= ? AND"
                    " at < ? GROUP BY attempt, rank, CAST(at / ? AS INTEGER))",
                    (job_id, lower, upper, job_id, lower, upper, width)).rowcount
            count = db.execute("SELECT COUNT(*) FROM samples WHERE job_id = ?",
                               (job_id,)).fetchone()[0]
            if count > MAX_SAMPLES:
                removed += db.execute(
                    "DELETE FROM samples WHERE rowid IN (SELECT rowid FROM samples WHERE"
                    " job_id = ? ORDER BY at LIMIT ?)", (job_id, count - MAX_SAMPLES)).rowcount
        if removed:
            self._db.execute("PRAGMA incremental_vacuum")
        return removed

    def end_attempt(self, job_id: str, attempt: int, outcome: str,
                    failure: dict[str, Any] | None, warm_starts: int = 0) -> None:
        """An attempt's end; what its ranks' steps say of it is summed up now, once, so
        that readers never go through an ended attempt's ranks again."""
        with self._transaction() as db:
            steps = self._steps_of(db, job_id, attempt)
            rate = self._rate_of(db, job_id, attempt)
            self._update(
                db, "attempts",
                {"ended_at": time.time(), "outcome": outcome,
                 "failure_json": json.dumps(failure) if failure else None,
                 "warm_starts": warm_starts,
                 "steps_json": json.dumps({"steps": steps and asdict(steps),
                                           "steps_per_s": rate})},
                job_id=job_id, attempt=attempt,
            )

    def end_open_attempt(self, job_id: str, final: JobState,
                         failure: dict[str, Any] | None) -> None:
        """End the job's last attempt, if it is still open, as the job ends ``final``
        without its controller (a controller that kept failing)."""
        job = self.get_job(job_id)
        if job.attempts and job.attempts[-1].ended_at is None:
            outcome = "CANCELLED" if final == JobState.CANCELLED else "FAILED"
            self.end_attempt(job_id, job.attempts[-1].attempt, outcome, failure,
                             job.attempts[-1].warm_starts)

    @staticmethod
    def _update_rows(db: sqlite3.Connection, table: str, key: str,
                     rows: dict[int, dict[str, Any]], **where: Any) -> None:
        """UPDATE many rows of ``table`` (``key`` value -> fields, within ``where``): one
        statement for all rows that set the same columns. Why: SQLite lets go of the GIL
        for each row it steps through, and with thousands of busy threads (a channel each)
        getting it back takes a while each time; one statement over a JSON array is one
        step. Older SQLite (before 3.35): a statement per row."""
        groups: dict[tuple[str, ...], list[list[Any]]] = {}
        for k, fields in rows.items():
            if fields:
                groups.setdefault(tuple(fields), []).append([k, *fields.values()])
        conds = " AND ".join(f"{table}.{c} = ?" for c in where)
        for columns, values in groups.items():
            finite = all(not isinstance(v, float) or math.isfinite(v)
                         for row in values for v in row)
            if not (_BATCH and finite):  # (JSON has no NaN)
                for k, *vs in values:
                    Store._update(db, table, dict(zip(columns, vs, strict=True)),
                                  **where, **{key: k})
                continue
            # MATERIALIZED: the rows come from the array, each finding its row by the key;
            # the other way round (every row of the table against the whole array) is
            # quadratic, and the planner picks it for a plain json_each in the FROM.
            cols = ", ".join(f"json_extract(value, '$[{i}]')" for i in range(len(columns) + 1))
            sets = ", ".join(f"{c} = j.c{i}" for i, c in enumerate(columns))
            db.execute(f"WITH j(k, {', '.join(f'c{i}' for i in range(len(columns)))}) AS "
                       f"MATERIALIZED (SELECT {cols} FROM json_each(?)) "
                       f"UPDATE {table} SET {sets} FROM j WHERE {conds} AND {table}.{key} = j.k",
                       [json.dumps(values), *where.values()])

    @staticmethod
    def _update(db: sqlite3.Connection, table: str, fields: dict[str, Any], **where: Any) -> None:
        if "failure" in fields:
            failure = fields.pop("failure")
            fields["failure_json"] = json.dumps(failure) if failure is not None else None
        sets = ", ".join(f"{k} = ?" for k in fields)
        conds = " AND ".join(f"{k} = ?" for k in where)
        db.execute(f"UPDATE {table} SET {sets} WHERE {conds}", [*fields.values(), *where.values()])

    # --- hosts across jobs (orchestrator/reputation.py) -----------------------------------------
    def add_host_event(self, host: str, job_id: str, kind: str, detail: str,
                       at: float | None = None) -> None:
        with self._transaction() as db:
            db.execute("INSERT INTO host_events (host, at, job_id, kind, detail) "
                       "VALUES (?, ?, ?, ?, ?)", (host, at or time.time(), job_id, kind, detail))

    def host_events(self, since: float, host: str | None = None) -> list[dict[str, Any]]:
        """Events since ``since``, oldest first (of one host, or all)."""
        rows = self._db.execute(
            "SELECT host, at, job_id, kind, detail FROM host_events WHERE at >= ?"
            + (" AND host = ?" if host is not None else "") + " ORDER BY at",
            (since, host) if host is not None else (since,)).fetchall()
        return [dict(r) for r in rows]

    def quarantines(self) -> dict[str, dict[str, Any]]:
        """Every host ever quarantined: host -> {since, until, level, reason, released_at}."""
        rows = self._db.execute("SELECT * FROM quarantine").fetchall()
        return {r["host"]: dict(r) for r in rows}

    def set_quarantine(self, host: str, since: float, until: float, level: int,
                       reason: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO quarantine (host, since, until, level, reason, "
                       "released_at) VALUES (?, ?, ?, ?, ?, NULL)",
                       (host, since, until, level, reason))

    def settings(self, prefix: str) -> dict[str, str]:
        """Stored settings whose names start with ``prefix``: name -> value (JSON text)."""
        rows = self._db.execute("SELECT name, value FROM settings WHERE name LIKE ? || '%'",
                                (prefix,)).fetchall()
        return {r["name"]: r["value"] for r in rows}

    def set_settings(self, values: dict[str, str]) -> None:
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO settings (name, value) VALUES (?, ?)",
                           list(values.items()))

    def release_quarantine(self, host: str) -> bool:
        """End ``host``'s quarantine now; False if it had none in force."""
        now = time.time()
        with self._transaction() as db:
            done = db.execute("UPDATE quarantine SET until = ?, released_at = ? WHERE host = ? "
                              "AND until > ?", (now, now, host, now))
            return done.rowcount > 0

    # --- reads ---------------------------------------------------------------------------
    def get_job(self, job_id: str) -> JobRecord:
        check_job_id(job_id)
        # One read transaction, so a job, its nodes and its ranks are seen at one moment.
        self._db.execute("BEGIN")
        try:
            row = self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFoundError(job_id)
            job = self._job(row)
            job.nodes = [
                NodeRecord(r["node_index"], r["host"], r["node_rank"], NodeState(r["state"]),
                           json.loads(r["info_json"] or "{}"), r["acked_seq"], r["heard_at"],
                           r["longest_silence"])
                for r in self._db.execute(
                    "SELECT * FROM nodes WHERE job_id = ? ORDER BY node_index", (job_id,))
            ]
            # The last HISTORY changes of each node, and how often it entered each state:
            # a restart a day for a week must not make every status read them all.
            for r in self._db.execute(
                    "SELECT * FROM (SELECT rowid AS id, node_index, at, state, message,"
                    " ROW_NUMBER() OVER (PARTITION BY node_index ORDER BY at DESC, rowid DESC)"
                    " AS n FROM node_events WHERE job_id = ?) WHERE n <= ? ORDER BY at, id",
                    (job_id, HISTORY)):
                job.nodes[r["node_index"]].history.append(
                    NodeEvent(r["at"], NodeState(r["state"]), r["message"]))
            for r in self._db.execute(
                    "SELECT node_index, state, COUNT(*) FROM node_events WHERE job_id = ?"
                    " GROUP BY node_index, state", (job_id,)):
                job.nodes[r[0]].entered[r[1]] = r[2]
            # The current attempt's ranks (what status shows); older attempts only as sums
            # (time lost, rates): a status costs about the same at attempt 100 as at 1.
            job.ranks = [
                RankRecord(r["attempt"], r["rank"], r["node_index"], r["local_rank"], r["pid"],
                           r["state"], r["exit_code"], r["signal"], r["step"],
                           _json_or_none(r["metrics_json"]) or {}, r["steps_per_s"],
                           r["heartbeat_at"], r["output_at"], r["wait_share"],
                           r["first_step"], r["first_step_at"], r["step_at"])
                for r in self._db.execute(
                    "SELECT * FROM ranks WHERE job_id = ? AND attempt = ? ORDER BY rank",
                    (job_id, job.attempt))
            ]
            job.attempts = [
                AttemptRecord(r["attempt"], r["started_at"], r["ended_at"], r["outcome"],
                              r["master_addr"], r["master_port"], r["world_size"],
                              _json_or_none(r["failure_json"]),
                              _json_or_none(r["stragglers_json"]) or [], r["warm_starts"] or 0)
                for r in self._db.execute(
                    "SELECT attempt, started_at, ended_at, outcome, master_addr, master_port,"
                    " world_size, failure_json, stragglers_json, warm_starts FROM attempts"
                    " WHERE job_id = ? ORDER BY attempt", (job_id,))
            ]
            self._attempt_steps(job)
        finally:
            self._db.execute("COMMIT")
        return job

    def _attempt_steps(self, job: JobRecord) -> None:
        """Each attempt's steps and pace (``job.steps``, ``job.rates``): summed up when it
        ended, or now from its ranks (the running one, or one an older version ended)."""
        summed = {r["attempt"]: _json_or_none(r["steps_json"]) for r in self._db.execute(
            "SELECT attempt, steps_json FROM attempts WHERE job_id = ?", (job.job_id,))}
        for attempt in sorted(summed):
            kept = summed[attempt]
            if isinstance(kept, dict):
                steps = AttemptSteps(**kept["steps"]) if kept.get("steps") else None
                rate = kept.get("steps_per_s")
            else:
                steps = self._steps_of(self._db, job.job_id, attempt)
                rate = self._rate_of(self._db, job.job_id, attempt)
            if steps is not None:
                job.steps.append(steps)
            if rate is not None:
                job.rates[attempt] = rate

    @staticmethod
    def _rate_of(db: sqlite3.Connection, job_id: str, attempt: int) -> float | None:
        """An attempt's pace: its slowest rank's steps a second."""
        return db.execute("SELECT MIN(steps_per_s) FROM ranks WHERE job_id = ? AND attempt = ?",
                          (job_id, attempt)).fetchone()[0]

    @staticmethod
    def _steps_of(db: sqlite3.Connection, job_id: str, attempt: int) -> AttemptSteps | None:
        """An attempt's steps, summed up from its ranks' first and last step."""
        row = db.execute(
            "SELECT COUNT(*), MAX(first_step_at), MIN(first_step), MAX(step),"
            " MIN(CASE WHEN step > first_step AND step_at > first_step_at"
            " THEN (step - first_step) * 1.0 / (step_at - first_step_at) END) FROM ranks"
            " WHERE job_id = ? AND attempt = ? AND first_step IS NOT NULL AND first_step_at"
            " IS NOT NULL AND step IS NOT NULL AND step_at IS NOT NULL",
            (job_id, attempt)).fetchone()
        if row[0]:
            return AttemptSteps(attempt, *row)
        older = db.execute("SELECT 1 FROM ranks WHERE job_id = ? AND attempt = ? AND step IS"
                           " NOT NULL AND first_step IS NULL LIMIT 1", (job_id, attempt))
        if older.fetchone() is None:
            return None
        # Recorded by an older version: from the attempt's samples, as it did (steps only
        # increase within an attempt: its first and last are its min and max).
        spans = [StepSpan(*r) for r in db.execute(
            "SELECT attempt, rank, MIN(step), MIN(at), MAX(step), MAX(at) FROM samples"
            " WHERE job_id = ? AND attempt = ? AND step IS NOT NULL GROUP BY attempt, rank",
            (job_id, attempt))]
        found = per_attempt(spans)
        return found[0] if found else None

    def checkpoint_of(self, job_id: str, attempt: int) -> dict[str, Any] | None:
        """The last checkpoint of an attempt (read by a controller that resumes it)."""
        row = self._db.execute("SELECT checkpoint_json FROM attempts WHERE job_id = ? AND"
                               " attempt = ?", (job_id, attempt)).fetchone()
        return _json_or_none(row["checkpoint_json"]) if row is not None else None

    def ranks_of_node(self, job_id: str, node_index: int) -> set[int]:
        """The ranks that ran on a node, in any attempt (``logs --node``)."""
        return {r[0] for r in self._db.execute(
            "SELECT DISTINCT rank FROM ranks WHERE job_id = ? AND node_index = ?",
            (job_id, node_index))}

    def world(self, job_id: str) -> dict[str, Any] | None:
        """The submitter's world kept with the job (None for jobs of older versions). Read
        only by the job's controller: it is never part of a status."""
        row = self._db.execute("SELECT world_json FROM jobs WHERE job_id = ?",
                               (check_job_id(job_id),)).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        return json.loads(row["world_json"]) if row["world_json"] else None

    def list_jobs(self) -> list[JobRecord]:
        rows = self._db.execute("SELECT * FROM jobs ORDER BY submitted_at, job_id").fetchall()
        return [self._job(r) for r in rows]

    def request_stacks(self, job_id: str) -> float:
        """Ask the job's controller for every rank's stack (a request, like cancel)."""
        at = time.time()
        with self._transaction() as db:
            db.execute("UPDATE jobs SET stacks_requested_at = ? WHERE job_id = ?", (at, job_id))
        return at

    def stacks(self, job_id: str) -> tuple[float | None, float | None, dict[str, Any] | None]:
        """(requested at, answered at, the answer) of the last stacks request."""
        row = self._db.execute("SELECT stacks_requested_at, stacks_at, stacks_json FROM jobs "
                               "WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        return (row["stacks_requested_at"], row["stacks_at"],
                json.loads(row["stacks_json"]) if row["stacks_json"] else None)

    def requests(self, job_id: str) -> tuple[bool, bool]:
        """What readers asked of the controller, in one read for its polling loop: (cancel
        requested, a stacks request not answered yet)."""
        row = self._db.execute(
            "SELECT cancel_requested, stacks_requested_at, stacks_at FROM jobs WHERE job_id = ?",
            (job_id,)).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        asked, answered = row["stacks_requested_at"], row["stacks_at"]
        return bool(row["cancel_requested"]), bool(asked and (answered is None or
                                                              answered < asked))

    def job_attempt(self, job_id: str) -> tuple[JobState, int]:
        """The state and the current attempt: what a follower of the logs polls."""
        row = self._db.execute("SELECT state, attempt FROM jobs WHERE job_id = ?",
                               (job_id,)).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        return JobState(row["state"]), int(row["attempt"])

    def job_state(self, job_id: str) -> tuple[JobState, bool]:
        """The state and the cancel flag: the cheap read a polling loop needs."""
        row = self._db.execute(
            "SELECT state, cancel_requested FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()
        if row is None:
            raise JobNotFoundError(job_id)
        return JobState(row["state"]), bool(row["cancel_requested"])

    @staticmethod
    def _job(row: sqlite3.Row) -> JobRecord:
        return JobRecord(
            job_id=row["job_id"], name=row["name"], state=JobState(row["state"]),
            spec_json=row["spec_json"], spec_dir=row["spec_dir"],
            submitted_at=row["submitted_at"], started_at=row["started_at"],
            ended_at=row["ended_at"], attempt=row["attempt"], restarts=row["restarts"],
            max_restarts=row["max_restarts"], controller_pid=row["controller_pid"],
            cancel_requested=bool(row["cancel_requested"]),
            failure=json.loads(row["failure_json"]) if row["failure_json"] else None,
            secret=row["secret"], controller_host=row["controller_host"],
            controller_since=row["controller_since"], supervisor_pid=row["supervisor_pid"],
            free_restarts=row["free_restarts"], infra_restarts=row["infra_restarts"],
            controller_pidns=row["controller_pidns"],
            controller_ident=row["controller_ident"], supervisor_ident=row["supervisor_ident"],
            slurm=json.loads(row["slurm_json"]) if row["slurm_json"] else None,
            paused=_json_or_none(row["paused_json"]),
            failing=_json_or_none(row["failing_json"]),
            resume_requested_at=row["resume_requested_at"],
        )
