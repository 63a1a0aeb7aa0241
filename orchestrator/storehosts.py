"""The tables across jobs: what happened to each host (``host_events``: infrastructure
failures it was part of), the hosts quarantined for it (``quarantine``), those an operator
drained (``drains``: orchestrator/drain.py), and this home's
settings (``settings``: the quarantine's thresholds, the retention). What they mean is
``reputation.py``'s and ``retention.py``'s; this is only how they are kept.

Functions over a connection (or the transaction ``orchestrator.store`` opened); the clock is
the caller's. May call nothing of ours.
"""

from __future__ import annotations

import sqlite3
from typing import Any


def add_event(db: sqlite3.Connection, host: str, job_id: str, kind: str, detail: str,
              at: float) -> None:
    """Once: the same failure of a job's (its host, kind and time) decided again by a
    controller that took over is not a second one."""
    db.execute("INSERT INTO host_events (host, at, job_id, kind, detail) SELECT ?, ?, ?, ?, ? "
               "WHERE NOT EXISTS (SELECT 1 FROM host_events WHERE host = ? AND at = ? AND "
               "job_id = ? AND kind = ?)", (host, at, job_id, kind, detail, host, at, job_id,
                                            kind))


def events(db: sqlite3.Connection, since: float, host: str | None) -> list[dict[str, Any]]:
    rows = db.execute(
        "SELECT host, at, job_id, kind, detail FROM host_events WHERE at >= ?"
        + (" AND host = ?" if host is not None else "") + " ORDER BY at",
        (since, host) if host is not None else (since,)).fetchall()
    return [dict(r) for r in rows]


def forget_events(db: sqlite3.Connection, before: float) -> None:
    db.execute("DELETE FROM host_events WHERE at < ?", (before,))


def quarantines(db: sqlite3.Connection) -> dict[str, dict[str, Any]]:
    rows = db.execute("SELECT * FROM quarantine").fetchall()
    return {r["host"]: dict(r) for r in rows}


def set_quarantine(db: sqlite3.Connection, host: str, since: float, until: float, level: int,
                   reason: str) -> None:
    db.execute("INSERT OR REPLACE INTO quarantine (host, since, until, level, reason, "
               "released_at) VALUES (?, ?, ?, ?, ?, NULL)",
               (host, since, until, level, reason))


def release_quarantine(db: sqlite3.Connection, host: str, now: float) -> bool:
    done = db.execute("UPDATE quarantine SET until = ?, released_at = ? WHERE host = ? "
                      "AND until > ?", (now, now, host, now))
    return done.rowcount > 0


def settings(db: sqlite3.Connection, prefix: str) -> dict[str, str]:
    rows = db.execute("SELECT name, value FROM settings WHERE name LIKE ? || '%'",
                      (prefix,)).fetchall()
    return {r["name"]: r["value"] for r in rows}


def set_settings(db: sqlite3.Connection, values: dict[str, str]) -> None:
    db.executemany("INSERT OR REPLACE INTO settings (name, value) VALUES (?, ?)",
                   list(values.items()))


def set_drain(db: sqlite3.Connection, target: str, job_id: str, since: float, reason: str,
              within: float) -> None:
    db.execute("INSERT OR REPLACE INTO drains (target, job_id, since, reason, within) "
               "VALUES (?, ?, ?, ?, ?)", (target, job_id, since, reason, within))


def remove_drain(db: sqlite3.Connection, target: str, job_id: str) -> bool:
    done = db.execute("DELETE FROM drains WHERE target = ? AND job_id = ?", (target, job_id))
    return done.rowcount > 0


def drains(db: sqlite3.Connection) -> list[dict[str, Any]]:
    return [dict(r) for r in db.execute("SELECT * FROM drains ORDER BY since").fetchall()]
