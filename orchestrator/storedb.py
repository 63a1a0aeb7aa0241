"""The state database as a file and a connection: its schema and the migrations of databases
made by older versions, the pragmas a connection is opened with (journal, durability, the
wiping of deleted pages), one write transaction at a time, what counts as "this home cannot
be written now" (``unwritable``, ``StoreUnwritable``), and the two generic row writers every
table's module uses (``update``, ``update_rows``).

Owns no table's meaning: the modules of each concern (``storejobs``, ``storenodes``,
``storeattempts``, ``storesamples``, ``storehosts``) say what their rows are, and
``orchestrator.store`` puts them together. May call ``homefs`` (which journal is safe) and
``errors``; nothing else of ours.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from orchestrator import homefs
from orchestrator.errors import StoreUnwritable

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
    resume_requested_at REAL,
    timeline_json TEXT
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
    total_steps INTEGER,
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
    restored_step INTEGER,
    next_json TEXT,
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
-- Hosts drained by an operator (`orchestrator drain`): for every job (job_id ''), or for one,
-- where target may also be a node index of that job (orchestrator/drain.py).
CREATE TABLE IF NOT EXISTS drains (
    target TEXT NOT NULL,
    job_id TEXT NOT NULL,
    since REAL NOT NULL,
    reason TEXT NOT NULL,
    within REAL NOT NULL,
    PRIMARY KEY (target, job_id)
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
             "paused_json": "TEXT", "failing_json": "TEXT", "resume_requested_at": "REAL",
             "timeline_json": "TEXT"},
    "nodes": {"acked_seq": "INTEGER NOT NULL DEFAULT 0", "heard_at": "REAL",
              "longest_silence": "REAL"},
    "ranks": {"step": "INTEGER", "metrics_json": "TEXT", "steps_per_s": "REAL",
              "heartbeat_at": "REAL", "output_at": "REAL", "wait_share": "REAL",
              "first_step": "INTEGER", "first_step_at": "REAL", "step_at": "REAL",
              "total_steps": "INTEGER"},
    "attempts": {"checkpoint_json": "TEXT", "stragglers_json": "TEXT",
                 "warm_starts": "INTEGER", "steps_json": "TEXT",
                 "restored_step": "INTEGER", "next_json": "TEXT"},
}


def migrate(db: sqlite3.Connection) -> None:
    """Add the columns a database made by an older version lacks (_ADDED_COLUMNS)."""
    for table, columns in _ADDED_COLUMNS.items():
        have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _can_batch() -> bool:
    """Whether this SQLite has UPDATE ... FROM (3.33), MATERIALIZED (3.35) and the JSON
    functions, with which many rows go in one statement (update_rows)."""
    if sqlite3.sqlite_version_info < (3, 35, 0):
        return False
    try:
        with closing(sqlite3.connect(":memory:")) as db:
            db.execute("SELECT value FROM json_each('[1]')").fetchall()
    except sqlite3.Error:
        return False
    return True


CAN_BATCH = _can_batch()

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


def connect(home: Path, *, durable: bool) -> tuple[sqlite3.Connection, str, str]:
    """The home's ``state.db``, opened, made or migrated: (the connection, its journal mode,
    why that mode). Call with the umask that keeps the files private."""
    db = sqlite3.connect(home / "state.db", timeout=30, isolation_level=None,
                         check_same_thread=False)
    db.row_factory = sqlite3.Row
    # Pages the thinning of samples frees go back to the filesystem (a new database
    # only, and set before its journal mode: one made by an older version keeps its
    # free pages for new rows instead). Only when new: on an existing database the
    # pragma writes its header, and a reader must work on a full disk.
    if db.execute("PRAGMA page_count").fetchone()[0] == 0:
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
    # WAL where the home is local; the rollback journal on a network filesystem,
    # where WAL is not safe (orchestrator/homefs.py).
    journal, journal_why = homefs.journal_mode(home)
    got = db.execute(f"PRAGMA journal_mode={journal}").fetchone()[0]
    if got != journal:  # another process has it open in the other mode
        journal = got
    # A controller's checkpoints are acknowledged to agents, which then forget: each
    # commit must be on disk (FULL). Readers need no such care.
    db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    db.execute("PRAGMA busy_timeout=30000")
    # The WAL is cut back to 4 MiB after a checkpoint, not kept at its high water.
    db.execute("PRAGMA journal_size_limit=4194304")
    # What is deleted or overwritten is zeroed on disk: an ended job's secrets are
    # wiped (Store.set_state), not left in free pages.
    db.execute("PRAGMA secure_delete=ON")
    # Sorting and grouping (Store.compact_samples) in memory: a full /tmp is not ours.
    db.execute("PRAGMA temp_store=MEMORY")
    db.executescript(_SCHEMA)
    migrate(db)
    for name in ("state.db", "state.db-wal", "state.db-shm"):  # made by older versions
        path = home / name
        if path.exists() and path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    return db, journal, journal_why


@contextmanager
def transaction(db: sqlite3.Connection, path: str) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``db`` (the database at ``path``, for the error). A database
    that cannot be written now (a full disk, a read-only or vanished home) raises
    StoreUnwritable, and nothing of it is kept."""
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")  # on a full disk, COMMIT itself may fail
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise
    except sqlite3.Error as exc:
        reason = unwritable(exc)
        if reason is None:
            raise
        raise StoreUnwritable(path, reason) from exc


def truncate_wal(db: sqlite3.Connection) -> None:
    """Cut the WAL back to nothing if no reader holds it: the old page versions of what was
    just wiped (an ended job's secrets) leave it too."""
    db.execute("PRAGMA busy_timeout=200")  # never wait on readers for it
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error:
        pass  # a reader holds it: the next checkpoint overwrites them
    finally:
        db.execute("PRAGMA busy_timeout=30000")


def update(db: sqlite3.Connection, table: str, fields: dict[str, Any], **where: Any) -> None:
    """UPDATE ``table`` SET ``fields`` WHERE ``where`` (``failure`` as JSON)."""
    if "failure" in fields:
        failure = fields.pop("failure")
        fields["failure_json"] = json.dumps(failure) if failure is not None else None
    sets = ", ".join(f"{k} = ?" for k in fields)
    conds = " AND ".join(f"{k} = ?" for k in where)
    db.execute(f"UPDATE {table} SET {sets} WHERE {conds}", [*fields.values(), *where.values()])


def update_rows(db: sqlite3.Connection, table: str, key: str, rows: dict[int, dict[str, Any]],
                batch: bool, **where: Any) -> None:
    """UPDATE many rows of ``table`` (``key`` value -> fields, within ``where``): one
    statement for all rows that set the same columns. Why: SQLite lets go of the GIL
    for each row it steps through, and with thousands of busy threads (a channel each)
    getting it back takes a while each time; one statement over a JSON array is one
    step. Without ``batch`` (older SQLite, before 3.35: CAN_BATCH): a statement per row."""
    groups: dict[tuple[str, ...], list[list[Any]]] = {}
    for k, fields in rows.items():
        if fields:
            groups.setdefault(tuple(fields), []).append([k, *fields.values()])
    conds = " AND ".join(f"{table}.{c} = ?" for c in where)
    for columns, values in groups.items():
        finite = all(not isinstance(v, float) or math.isfinite(v)
                     for row in values for v in row)
        if not (batch and finite):  # (JSON has no NaN)
            for k, *vs in values:
                update(db, table, dict(zip(columns, vs, strict=True)), **where, **{key: k})
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


def json_or_none(text: str | None) -> Any:
    """A JSON column's value; None for none, or for text that is not JSON."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


# Every table with a job's rows, the job's own row last.
JOB_TABLES = ("samples", "ranks", "attempts", "node_events", "nodes", "jobs")


def delete_job(db: sqlite3.Connection, job_id: str) -> None:
    """Every row of a job, in every table."""
    for table in JOB_TABLES:
        db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
