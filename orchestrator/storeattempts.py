"""The attempts and ranks tables: an attempt from its start to its end (with what its ranks'
steps say of it, summed up once when it ends), its checkpoints, its stragglers, its ranks'
latest state, steps and metrics, and all of it as a status reads it (the current attempt's
ranks; older attempts only as sums, so a status costs about the same at attempt 100 as at 1).

Functions over a connection (or the transaction ``orchestrator.store`` opened); the clock is
the caller's (``now``), and so is ``batch`` (``storedb.update_rows``). May call ``storedb``,
``storesamples`` (the steps of attempts recorded by older versions) and ``records``.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from typing import Any

from orchestrator import storedb, storesamples
from orchestrator.records import AttemptRecord, AttemptSteps, JobRecord, RankRecord, per_attempt


# --- writes ------------------------------------------------------------------------------
def start(db: sqlite3.Connection, job_id: str, attempt: int, master_addr: str,
          master_port: int, world_size: int, ranks: list[tuple[int, int, int]],
          now: float, restored_step: int | None = None) -> None:
    """A new attempt's row (with the checkpoint step its ranks resume, None: fresh) and its
    ranks as (rank, node_index, local_rank), PENDING."""
    db.execute(
        "INSERT INTO attempts (job_id, attempt, started_at, master_addr, master_port,"
        " world_size, restored_step) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (job_id, attempt, now, master_addr, master_port, world_size, restored_step),
    )
    db.executemany(
        "INSERT INTO ranks (job_id, attempt, rank, node_index, local_rank, state)"
        " VALUES (?, ?, ?, ?, ?, 'PENDING')",
        [(job_id, attempt, r, n, lr) for r, n, lr in ranks],
    )


def update_ranks(db: sqlite3.Connection, job_id: str, attempt: int,
                 fields_by_rank: dict[int, dict[str, Any]], batch: bool) -> None:
    """Several ranks of one attempt (``metrics`` as a dict)."""
    rows = {}
    for rank, fields in fields_by_rank.items():
        fields = dict(fields)
        if "metrics" in fields:
            fields["metrics_json"] = json.dumps(fields.pop("metrics"))
        rows[rank] = fields
    storedb.update_rows(db, "ranks", "rank", rows, batch, job_id=job_id, attempt=attempt)


def output_at(db: sqlite3.Connection, job_id: str, attempt: int, ranks: dict[int, float],
              batch: bool) -> None:
    """When each rank last printed (wall clock)."""
    storedb.update_rows(db, "ranks", "rank", {r: {"output_at": t} for r, t in ranks.items()},
                        batch, job_id=job_id, attempt=attempt)


def set_stragglers(db: sqlite3.Connection, job_id: str, attempt: int,
                   stragglers: list[int]) -> None:
    storedb.update(db, "attempts", {"stragglers_json": json.dumps(stragglers)},
                   job_id=job_id, attempt=attempt)


def set_restored_step(db: sqlite3.Connection, job_id: str, attempt: int, step: int) -> None:
    storedb.update(db, "attempts", {"restored_step": step}, job_id=job_id, attempt=attempt)


def checkpoint(db: sqlite3.Connection, job_id: str, attempt: int, state: dict[str, Any],
               warm_starts: int) -> None:
    """An attempt's bookkeeping (log sizes, exits) and its warm starts so far."""
    storedb.update(db, "attempts", {"checkpoint_json": json.dumps(state),
                                    "warm_starts": warm_starts},
                   job_id=job_id, attempt=attempt)


def end(db: sqlite3.Connection, job_id: str, attempt: int, outcome: str,
        failure: dict[str, Any] | None, warm_starts: int, now: float,
        after: dict[str, Any] | None = None) -> None:
    """An attempt's end, with its steps and pace summed up from its ranks, and what comes
    after it (AttemptRecord.next)."""
    steps = _steps_of(db, job_id, attempt)
    rate, total = _rate_of(db, job_id, attempt)
    storedb.update(
        db, "attempts",
        {"ended_at": now, "outcome": outcome,
         "failure_json": json.dumps(failure) if failure else None,
         "warm_starts": warm_starts,
         "next_json": json.dumps(after) if after else None,
         "steps_json": json.dumps({"steps": steps and asdict(steps),
                                   "steps_per_s": rate, "total_steps": total})},
        job_id=job_id, attempt=attempt,
    )


# --- reads -------------------------------------------------------------------------------
def checkpoint_of(db: sqlite3.Connection, job_id: str, attempt: int) -> dict[str, Any] | None:
    row = db.execute("SELECT checkpoint_json FROM attempts WHERE job_id = ? AND"
                     " attempt = ?", (job_id, attempt)).fetchone()
    return storedb.json_or_none(row["checkpoint_json"]) if row is not None else None


def ranks_of_node(db: sqlite3.Connection, job_id: str, node_index: int) -> set[int]:
    return {r[0] for r in db.execute(
        "SELECT DISTINCT rank FROM ranks WHERE job_id = ? AND node_index = ?",
        (job_id, node_index))}


def read_into(db: sqlite3.Connection, job: JobRecord) -> None:
    """A job's attempts as a status reads them: ``job.ranks`` (the current attempt's),
    ``job.attempts``, and each attempt's steps and pace (``job.steps``, ``job.rates``)."""
    # The current attempt's ranks (what status shows); older attempts only as sums
    # (time lost, rates): a status costs about the same at attempt 100 as at 1.
    job.ranks = [
        RankRecord(r["attempt"], r["rank"], r["node_index"], r["local_rank"], r["pid"],
                   r["state"], r["exit_code"], r["signal"], r["step"],
                   storedb.json_or_none(r["metrics_json"]) or {}, r["steps_per_s"],
                   r["heartbeat_at"], r["output_at"], r["wait_share"],
                   r["first_step"], r["first_step_at"], r["step_at"], r["total_steps"])
        for r in db.execute(
            "SELECT * FROM ranks WHERE job_id = ? AND attempt = ? ORDER BY rank",
            (job.job_id, job.attempt))
    ]
    job.attempts = [
        AttemptRecord(r["attempt"], r["started_at"], r["ended_at"], r["outcome"],
                      r["master_addr"], r["master_port"], r["world_size"],
                      storedb.json_or_none(r["failure_json"]),
                      storedb.json_or_none(r["stragglers_json"]) or [], r["warm_starts"] or 0,
                      r["restored_step"], storedb.json_or_none(r["next_json"]))
        for r in db.execute(
            "SELECT attempt, started_at, ended_at, outcome, master_addr, master_port,"
            " world_size, failure_json, stragglers_json, warm_starts, restored_step,"
            " next_json FROM attempts"
            " WHERE job_id = ? ORDER BY attempt", (job.job_id,))
    ]
    _attempt_steps(db, job)


def _attempt_steps(db: sqlite3.Connection, job: JobRecord) -> None:
    """Each attempt's steps, pace and the total its ranks said (``job.steps``, ``job.rates``,
    ``job.totals``): summed up when it ended, or now from its ranks (the running one, or one
    an older version ended)."""
    summed = {r["attempt"]: storedb.json_or_none(r["steps_json"]) for r in db.execute(
        "SELECT attempt, steps_json FROM attempts WHERE job_id = ?", (job.job_id,))}
    for attempt in sorted(summed):
        kept = summed[attempt]
        if isinstance(kept, dict):
            steps = AttemptSteps(**kept["steps"]) if kept.get("steps") else None
            rate, total = kept.get("steps_per_s"), kept.get("total_steps")
        else:
            steps = _steps_of(db, job.job_id, attempt)
            rate, total = _rate_of(db, job.job_id, attempt)
        if steps is not None:
            job.steps.append(steps)
        if rate is not None:
            job.rates[attempt] = rate
        if total is not None:
            job.totals[attempt] = total


def _rate_of(db: sqlite3.Connection, job_id: str, attempt: int
             ) -> tuple[float | None, int | None]:
    """An attempt's pace (its slowest rank's steps a second) and the total steps its ranks
    said the run takes (the largest, should they differ)."""
    row = db.execute("SELECT MIN(steps_per_s), MAX(total_steps) FROM ranks"
                     " WHERE job_id = ? AND attempt = ?", (job_id, attempt)).fetchone()
    return row[0], row[1]


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
    # Recorded by an older version: from the attempt's samples, as it did.
    found = per_attempt(storesamples.spans(db, job_id, attempt))
    return found[0] if found else None
