"""The samples table: the steps and metrics ranks reported, kept for the plots across
attempts, and their thinning as they age (SAMPLE_BANDS, MAX_SAMPLES), so that a job's
history costs about the same to keep and to read on its 7th day as on its first.

Functions over a connection (or the transaction ``orchestrator.store`` opened). May call
``storedb`` and ``records``.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from orchestrator import storedb
from orchestrator.records import StepSpan

# Metric samples as they age (Store.compact_samples): every one for the last hour; older,
# one per rank per bucket of 2 min (1-2 h old), 4 min (2-4 h), ... 32 min (16-32 h): 30 to
# each doubling of the age; past 32 h, 15 (128 min for 32-64 h, ... 1024 min past 256 h);
# at most MAX_SAMPLES a job. A 1,000-rank job keeps about 260 samples a rank after a week.
SAMPLE_BANDS = tuple((3600.0 * 2 ** k, (120.0 if k < 5 else 240.0) * 2 ** k)
                     for k in range(9))
MAX_SAMPLES = 1_000_000

Sample = tuple[int, int | None, float, dict[str, float]]  # (rank, step, at, metrics)


def add(db: sqlite3.Connection, job_id: str, attempt: int, samples: list[Sample]) -> None:
    db.executemany(
        "INSERT INTO samples (job_id, attempt, rank, step, at, metrics_json)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [(job_id, attempt, r, step, at, json.dumps(m)) for r, step, at, m in samples])


def read(db: sqlite3.Connection, job_id: str, rank: int | None,
         limit: int) -> list[tuple[int, int, int | None, float, dict[str, float]]]:
    """The newest ``limit`` samples as (attempt, rank, step, at, metrics), oldest first."""
    where, args = "job_id = ?", list[Any]([job_id])
    if rank is not None:
        where, args = where + " AND rank = ?", [*args, rank]
    # By time, newest first, on an index: a poll costs the same on a job's 7th day.
    rows = db.execute(
        f"SELECT * FROM (SELECT rowid, attempt, rank, step, at, metrics_json FROM samples"
        f" WHERE {where} ORDER BY at DESC LIMIT ?) ORDER BY at, rowid", (*args, limit))
    return [(r["attempt"], r["rank"], r["step"], r["at"],
             storedb.json_or_none(r["metrics_json"]) or {}) for r in rows]


def compact(db: sqlite3.Connection, job_id: str, now: float, since: float | None,
            cap: int) -> int:
    """Thin a job's samples by SAMPLE_BANDS and keep at most ``cap`` (see
    Store.compact_samples). Rows removed."""
    removed = 0
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
    if count > cap:
        removed += db.execute(
            "DELETE FROM samples WHERE rowid IN (SELECT rowid FROM samples WHERE"
            " job_id = ? ORDER BY at LIMIT ?)", (job_id, count - cap)).rowcount
    return removed


def spans(db: sqlite3.Connection, job_id: str, attempt: int) -> list[StepSpan]:
    """Each rank's first and last step in an attempt, from its samples (steps only
    increase within an attempt: its first and last are its min and max)."""
    return [StepSpan(*r) for r in db.execute(
        "SELECT attempt, rank, MIN(step), MIN(at), MAX(step), MAX(at) FROM samples"
        " WHERE job_id = ? AND attempt = ? AND step IS NOT NULL GROUP BY attempt, rank",
        (job_id, attempt))]
