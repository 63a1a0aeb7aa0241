"""Time lost to failures, per incident and per job, from the attempts' timeline and the steps
the ranks gave ``heartbeat(step=...)`` (each rank's first and last of each attempt, summed
up by attempt: AttemptSteps).

For each attempt that failed and was followed by another:

- ``detected_s``: from the fault (a worker's exit as its agent saw it, the last word from a
  lost node, the last activity of a hung job) to the controller's verdict;
- ``recovered_s``: from the fault to every rank of the next attempt having reported a step
  (training again);
- ``steps_redone``: the last step reached before the fault, less the step the next attempt
  resumed at (work since the last checkpoint, done twice): the checkpoint step its ranks
  loaded (``restored_step``: the one they were told, orchestrator/checkpoints.py, until
  they all say which they loaded, Attempt.loaded) where there was one, else the first step
  its ranks reported;
- ``lost_s``: ``recovered_s`` plus the redone steps at the failed attempt's pace, and
  ``gpu_s``, that times the ranks (one GPU each where there are GPUs).

The job's ``goodput`` is its useful step time (the steps it advanced, at its pace) over its
wall time since the first attempt started. Without steps (no ``heartbeat(step=...)``) only
``detected_s`` and the downtime until the next attempt started are known: such an incident
counts in ``unknown`` (with that downtime in ``unknown_downtime_s``), never as 0 s lost.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.records import AttemptRecord, AttemptSteps, StepSpan, per_attempt


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


def _steps(steps: list[StepSpan] | list[AttemptSteps]) -> dict[int, AttemptSteps]:
    summed = [s for s in steps if isinstance(s, AttemptSteps)] or \
        per_attempt([s for s in steps if isinstance(s, StepSpan)])
    return {s.attempt: s for s in summed}


def _pace(steps: AttemptSteps | None) -> float | None:
    """Seconds per step of an attempt: its slowest rank's (synchronous training goes at it)."""
    return 1.0 / steps.rate_min if steps is not None and steps.rate_min else None


def incidents(attempts: list[AttemptRecord],
              steps: list[StepSpan] | list[AttemptSteps]) -> list[Incident]:
    by_attempt = _steps(steps)
    out = []
    for failed, following in zip(attempts, attempts[1:], strict=False):  # each with the next
        failure = failed.failure or {}
        fault = failure.get("at") or failed.ended_at
        if failed.outcome != "FAILED" or fault is None:
            continue
        detected = failure.get("detected_at")
        before, after = by_attempt.get(failed.attempt), by_attempt.get(following.attempt)
        recovered = redone = lost = gpu = None
        ranks = following.world_size or 0
        if after and ranks and after.ranks >= ranks:
            recovered = after.first_at_max - fault
        if before and following.restored_step is not None:  # resumed after that step
            redone = max(0, before.last_step_max - following.restored_step)
        elif before and after:
            redone = max(0, before.last_step_max + 1 - after.first_step_min)
        pace = _pace(before)
        if recovered is not None:
            lost = recovered + (redone or 0) * (pace or 0.0)
            gpu = lost * ranks
        out.append(Incident(failed.attempt, str(failure.get("cause") or "UNKNOWN"), fault,
                            None if detected is None else max(0.0, detected - fault),
                            max(0.0, following.started_at - fault), recovered, redone, lost,
                            gpu))
    return out


def summary(attempts: list[AttemptRecord], steps: list[StepSpan] | list[AttemptSteps],
            ended_at: float | None) -> dict[str, Any]:
    """What ``status --json`` shows as ``time_lost``: ``seconds`` and ``gpu_seconds`` over the
    incidents whose loss is known; ``unknown``, how many are not (no steps reported), and the
    downtime those had until the next attempt started."""
    found = incidents(attempts, steps)
    lost = [i.lost_s for i in found if i.lost_s is not None]
    unknown = [i for i in found if i.lost_s is None]
    gpu = [i.gpu_s for i in found if i.gpu_s is not None]
    goodput = None
    by_attempt = _steps(steps)
    paces = [p for a in sorted(by_attempt) if (p := _pace(by_attempt[a])) is not None]
    first = by_attempt.get(attempts[0].attempt) if attempts else None
    if first is not None and paces:
        advanced = max(s.last_step_max for s in by_attempt.values()) + 1 - first.first_step_min
        wall = (ended_at or time.time()) - attempts[0].started_at
        if wall > 0:
            goodput = min(1.0, advanced * statistics.median(paces) / wall)
    return {"seconds": round(sum(lost), 3), "gpu_seconds": round(sum(gpu), 3),
            "goodput": None if goodput is None else round(goodput, 4),
            "unknown": len(unknown),
            "unknown_downtime_s": round(sum(i.restarted_s or 0.0 for i in unknown), 3),
            "incidents": [i.to_dict() for i in found]}
