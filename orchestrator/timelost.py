"""Time lost to failures, per incident and per job, from the attempts' timeline and the steps
the ranks gave ``heartbeat(step=...)`` (the store's samples).

For each attempt that failed and was followed by another:

- ``detected_s``: from the fault (a worker's exit as its agent saw it, the last word from a
  lost node, the last activity of a hung job) to the controller's verdict;
- ``recovered_s``: from the fault to every rank of the next attempt having reported a step
  (training again);
- ``steps_redone``: the last step reached before the fault, less the step the next attempt
  resumed at (work since the last checkpoint, done twice);
- ``lost_s``: ``recovered_s`` plus the redone steps at the failed attempt's pace, and
  ``gpu_s``, that times the ranks (one GPU each where there are GPUs).

The job's ``goodput`` is its useful step time (the steps it advanced, at its pace) over its
wall time since the first attempt started. Without steps (no ``heartbeat(step=...)``) only
``detected_s`` and the downtime until the next attempt started are known.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.records import AttemptRecord, StepSpan


@dataclass(frozen=True)
class Incident:
    attempt: int  # the attempt that failed
    cause: str
    fault_at: float
    detected_s: float | None
    restarted_s: float | None  # fault -> the next attempt started
    recovered_s: float | None
    steps_redone: int | None
    lost_s: float | None
    gpu_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _pace(spans: list[StepSpan]) -> float | None:
    """Seconds per step of an attempt: its slowest rank's (synchronous training goes at it)."""
    rates = [(s.last_step - s.first_step) / (s.last_at - s.first_at) for s in spans
             if s.last_step > s.first_step and s.last_at > s.first_at]
    return 1.0 / min(rates) if rates else None


def incidents(attempts: list[AttemptRecord], spans: list[StepSpan]) -> list[Incident]:
    by_attempt: dict[int, list[StepSpan]] = {}
    for s in spans:
        by_attempt.setdefault(s.attempt, []).append(s)
    out = []
    for failed, following in zip(attempts, attempts[1:], strict=False):  # each with the next
        failure = failed.failure or {}
        fault = failure.get("at") or failed.ended_at
        if failed.outcome != "FAILED" or fault is None:
            continue
        detected = failure.get("detected_at")
        before, after = by_attempt.get(failed.attempt, []), by_attempt.get(following.attempt, [])
        recovered = redone = lost = gpu = None
        ranks = following.world_size or 0
        if after and ranks and len(after) >= ranks:
            recovered = max(s.first_at for s in after) - fault
        if before and after:
            redone = max(0, max(s.last_step for s in before) + 1 - min(s.first_step
                                                                      for s in after))
        pace = _pace(before)
        if recovered is not None:
            lost = recovered + (redone or 0) * (pace or 0.0)
            gpu = lost * ranks
        out.append(Incident(failed.attempt, str(failure.get("cause") or "UNKNOWN"), fault,
                            None if detected is None else max(0.0, detected - fault),
                            max(0.0, following.started_at - fault), recovered, redone, lost,
                            gpu))
    return out


def summary(attempts: list[AttemptRecord], spans: list[StepSpan], ended_at: float | None
            ) -> dict[str, Any]:
    """What ``status --json`` shows as ``time_lost``."""
    found = incidents(attempts, spans)
    lost = [i.lost_s for i in found if i.lost_s is not None]
    gpu = [i.gpu_s for i in found if i.gpu_s is not None]
    goodput = None
    paces = [p for a in sorted({s.attempt for s in spans})
             if (p := _pace([s for s in spans if s.attempt == a])) is not None]
    first = [s for s in spans if attempts and s.attempt == attempts[0].attempt]
    if first and paces:
        advanced = max(s.last_step for s in spans) + 1 - min(s.first_step for s in first)
        wall = (ended_at or time.time()) - attempts[0].started_at
        if wall > 0:
            goodput = min(1.0, advanced * statistics.median(paces) / wall)
    return {"seconds": round(sum(lost), 3), "gpu_seconds": round(sum(gpu), 3),
            "goodput": None if goodput is None else round(goodput, 4),
            "incidents": [i.to_dict() for i in found]}
