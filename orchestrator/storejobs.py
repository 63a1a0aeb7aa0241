"""The jobs table: a job's row from ``submit`` to its end, the requests readers leave in it
(cancel, stacks), the state change checked against the transition table, and the wiping of
an ended job's secrets (its agent secret, the submitter's environment, its env values and
webhook URLs).

Functions over a connection (or the transaction ``orchestrator.store`` opened); the clock is
the caller's (``now``). May call ``storedb``, ``records``, ``state`` and ``errors``.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from orchestrator import storedb
from orchestrator.errors import JobNotFoundError
from orchestrator.records import JobRecord
from orchestrator.state import JobState, check_transition

TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
REDACTED = "***"
REDACTED_URL = "https://redacted.invalid/"


def without_secrets(spec_json: str) -> str:
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


# --- writes ------------------------------------------------------------------------------
def insert(db: sqlite3.Connection, job_id: str, name: str, spec_json: str, spec_dir: str,
           max_restarts: int, now: float, secret: str | None,
           slurm: dict[str, Any] | None, world: dict[str, Any] | None) -> None:
    """A new PENDING job's row."""
    db.execute(
        "INSERT INTO jobs (job_id, name, state, spec_json, spec_dir, submitted_at,"
        " max_restarts, secret, slurm_json, world_json)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (job_id, name, JobState.PENDING.value, spec_json, spec_dir, now,
         max_restarts, secret, json.dumps(slurm) if slurm is not None else None,
         json.dumps(world) if world is not None else None),
    )


def set_state(db: sqlite3.Connection, job_id: str, new: JobState, fields: dict[str, Any],
              now: float) -> None:
    """Change a job's state after checking the transition table, and ``fields``; a job that
    ends (at ``now`` unless ``ended_at`` is given) loses its secrets in the same write."""
    row = db.execute("SELECT state, spec_json FROM jobs WHERE job_id = ?",
                     (job_id,)).fetchone()
    if row is None:
        raise JobNotFoundError(job_id)
    check_transition(JobState(row["state"]), new)
    if new.is_at_rest():
        fields.setdefault("ended_at", now)  # PREEMPTED: until resumed
    if new.is_terminal():
        fields.update(secret=None, world_json=None,
                      spec_json=without_secrets(row["spec_json"]))
    storedb.update(db, "jobs", {"state": new.value, **fields}, job_id=job_id)


def request_cancel(db: sqlite3.Connection, job_id: str) -> None:
    db.execute("UPDATE jobs SET cancel_requested = 1 WHERE job_id = ?", (job_id,))


def request_stacks(db: sqlite3.Connection, job_id: str, at: float) -> None:
    db.execute("UPDATE jobs SET stacks_requested_at = ? WHERE job_id = ?", (at, job_id))


def ended_before(db: sqlite3.Connection, before: float) -> list[str]:
    """The jobs that ended before ``before`` (unix time), oldest first."""
    return [r["job_id"] for r in db.execute(
        "SELECT job_id FROM jobs WHERE ended_at IS NOT NULL AND ended_at < ? AND state IN"
        " (?, ?, ?) ORDER BY ended_at", (before, *(s.value for s in TERMINAL)))]


def wipe_ended_secrets(db: sqlite3.Connection) -> None:
    """Jobs that ended under an older version still hold their secrets: not any more."""
    for row in db.execute("SELECT job_id, spec_json FROM jobs WHERE state IN (?, ?, ?)"
                          " AND (secret IS NOT NULL OR world_json IS NOT NULL)",
                          tuple(s.value for s in TERMINAL)).fetchall():
        storedb.update(db, "jobs", {"secret": None, "world_json": None,
                                    "spec_json": without_secrets(row["spec_json"])},
                       job_id=row["job_id"])


# --- reads -------------------------------------------------------------------------------
def _row(db: sqlite3.Connection, columns: str, job_id: str) -> sqlite3.Row:
    row = db.execute(f"SELECT {columns} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    if row is None:
        raise JobNotFoundError(job_id)
    return row


def read(db: sqlite3.Connection, job_id: str) -> JobRecord:
    """The job's own row (no nodes, ranks or attempts)."""
    return record(_row(db, "*", job_id))


def list_all(db: sqlite3.Connection) -> list[JobRecord]:
    rows = db.execute("SELECT * FROM jobs ORDER BY submitted_at, job_id").fetchall()
    return [record(r) for r in rows]


def world(db: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    row = _row(db, "world_json", job_id)
    return json.loads(row["world_json"]) if row["world_json"] else None


def stacks(db: sqlite3.Connection,
           job_id: str) -> tuple[float | None, float | None, dict[str, Any] | None]:
    row = _row(db, "stacks_requested_at, stacks_at, stacks_json", job_id)
    return (row["stacks_requested_at"], row["stacks_at"],
            json.loads(row["stacks_json"]) if row["stacks_json"] else None)


def requests(db: sqlite3.Connection, job_id: str) -> tuple[bool, bool]:
    row = _row(db, "cancel_requested, stacks_requested_at, stacks_at", job_id)
    asked, answered = row["stacks_requested_at"], row["stacks_at"]
    return bool(row["cancel_requested"]), bool(asked and (answered is None or
                                                          answered < asked))


def job_attempt(db: sqlite3.Connection, job_id: str) -> tuple[JobState, int]:
    row = _row(db, "state, attempt", job_id)
    return JobState(row["state"]), int(row["attempt"])


def timeline(db: sqlite3.Connection, job_id: str) -> tuple[float, str | None]:
    row = _row(db, "submitted_at, timeline_json", job_id)
    return float(row["submitted_at"]), row["timeline_json"]


def job_state(db: sqlite3.Connection, job_id: str) -> tuple[JobState, bool]:
    row = _row(db, "state, cancel_requested", job_id)
    return JobState(row["state"]), bool(row["cancel_requested"])


def record(row: sqlite3.Row) -> JobRecord:
    """A JobRecord of a jobs row."""
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
        paused=storedb.json_or_none(row["paused_json"]),
        failing=storedb.json_or_none(row["failing_json"]),
        resume_requested_at=row["resume_requested_at"],
        timeline_json=row["timeline_json"],
    )
