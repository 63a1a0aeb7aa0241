"""How far a job is and when it will end: ``status``'s ``progress`` (pure: from a job's
record, its time lost so far and the clock).

- ``step``: the job is as far as its slowest rank (synchronous training waits for it): the
  lowest step among the current attempt's ranks that reported one; before any has (a
  restart just began), the highest step any attempt reached.
- ``total_steps``: what a rank gave ``heartbeat(total_steps=...)`` (the newest attempt's
  that gave one), else the spec's ``total_steps``; ``total_from`` says which.
- ``steps_per_s``: the current attempt's pace (its slowest rank since its first step), else
  the last attempt's that had one (a restart does not make the job slower).
- ``eta_s``: the remaining steps at that pace, stretched by the share of its wall time the
  job has lost to faults so far (known losses, and the downtime of incidents whose loss is
  unknown), as if the rest of the run meets faults as often; ``eta_without_faults_s`` is the
  remaining steps at that pace alone. None while the pace is unknown and once the job ended.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.records import JobRecord

# A job that lost more than this share of its time so far gets no longer ETA than this
# share would give: the ETA stays a number however bad the start was.
MOST_LOST_SHARE = 0.9


def progress(job: JobRecord, time_lost: dict[str, Any], now: float) -> dict[str, Any] | None:
    """``status --json``'s ``progress``, or None when the job reported no step and no total
    is known. ``eta_at`` is a time stamp (seconds since the epoch) for the caller to show."""
    step = _step(job)
    total, total_from = _total(job)
    if step is None and total is None:
        return None
    pace = _pace(job)
    lost_share = _lost_share(job, time_lost, now)
    out: dict[str, Any] = {
        "step": step, "total_steps": total, "total_from": total_from,
        "percent": None, "remaining_steps": None,
        "steps_per_s": None if pace is None else round(pace, 4),
        "lost_share": None if lost_share is None else round(lost_share, 4),
        "eta_s": None, "eta_without_faults_s": None, "eta_at": None,
    }
    if step is None or total is None:
        return out
    remaining = max(0, total - step)
    out["percent"] = round(min(100.0, 100.0 * step / total), 1)
    out["remaining_steps"] = remaining
    if pace and not job.state.is_at_rest():
        clean = remaining / pace
        eta = clean / (1.0 - min(lost_share or 0.0, MOST_LOST_SHARE))
        out.update(eta_s=round(eta, 1), eta_without_faults_s=round(clean, 1),
                   eta_at=now + eta)
    return out


def _step(job: JobRecord) -> int | None:
    current = [r.step for r in job.ranks if r.attempt == job.attempt and r.step is not None]
    if current:
        return min(current)
    reached = [s.last_step_max for s in job.steps]
    return max(reached) if reached else None


def _total(job: JobRecord) -> tuple[int | None, str | None]:
    if job.totals:
        return job.totals[max(job.totals)], "heartbeat"
    try:
        total = json.loads(job.spec_json).get("total_steps")
    except (ValueError, AttributeError):
        total = None
    return (total, "spec") if type(total) is int and total > 0 else (None, None)


def _pace(job: JobRecord) -> float | None:
    for attempt in sorted(job.rates, reverse=True):
        if job.rates[attempt] > 0:
            return job.rates[attempt]
    return None


def _lost_share(job: JobRecord, time_lost: dict[str, Any], now: float) -> float | None:
    """The share of the wall time since the first attempt started lost to faults."""
    if not job.attempts:
        return None
    wall = (job.ended_at or now) - job.attempts[0].started_at
    if wall <= 0:
        return None
    lost = (time_lost.get("seconds") or 0.0) + (time_lost.get("unknown_downtime_s") or 0.0)
    return min(1.0, max(0.0, lost / wall))
