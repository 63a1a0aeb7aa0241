"""The restart policy: after an attempt ends, what next? Pure (no I/O, no clock), in the shape
of torch's ``_invoke_run``: the controller asks, and does what it is told.

- every rank exited 0: the job SUCCEEDED;
- the agents gave up while no controller was there (CONTROLLER_LOST): restart, not charged
  to ``max_restarts`` (infrastructure failures are not the user's budget);
- an exit code in ``fail_on_exit_codes``, a launch failure, or no budget left: FAILED, with
  the attempt's first failure as the root cause;
- otherwise: restart after ``restart_backoff`` (doubling per restart), charged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.attempt import AttemptResult, Failure
from orchestrator.spec import JobSpec
from orchestrator.state import AttemptOutcome, FailureCause


@dataclass(frozen=True)
class Succeed:
    pass


@dataclass(frozen=True)
class Restart:
    delay: float  # seconds to wait first
    charged: bool  # counted against max_restarts


@dataclass(frozen=True)
class Fail:
    failure: dict[str, Any]  # the job's failure, as status shows it


Decision = Succeed | Restart | Fail


def decide(result: AttemptResult, restarts: int, spec: JobSpec) -> Decision:
    """What to do after an attempt that ended with ``result``, ``restarts`` having been
    charged before it."""
    if result.outcome == AttemptOutcome.SUCCEEDED:
        return Succeed()
    failure = result.failure
    assert failure is not None
    if failure.cause == FailureCause.CONTROLLER_LOST:
        return Restart(spec.restart_backoff.initial, charged=False)
    if not _may_restart(failure, restarts, spec):
        return Fail(final_failure(failure, restarts, spec))
    return Restart(backoff(restarts + 1, spec), charged=True)


def _may_restart(failure: Failure, restarts: int, spec: JobSpec) -> bool:
    if failure.exit_code is not None and failure.exit_code in spec.fail_on_exit_codes:
        return False
    if failure.cause == FailureCause.LAUNCH_FAILED:
        return False
    return restarts < spec.max_restarts


def final_failure(failure: Failure, restarts: int, spec: JobSpec) -> dict[str, Any]:
    """The job's failure: the last attempt's first failure, as ``root_cause``; the cause is
    RESTARTS_EXHAUSTED when a restart budget was spent on it."""
    d = failure.to_dict()
    d["root_cause"] = d["cause"]
    d["restarts_exhausted"] = spec.max_restarts > 0 and restarts >= spec.max_restarts
    if d["restarts_exhausted"]:
        d["cause"] = FailureCause.RESTARTS_EXHAUSTED.value
        d["message"] += f" (after {restarts} restart(s), max_restarts reached)"
    return d


def backoff(restart: int, spec: JobSpec) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...)."""
    b = spec.restart_backoff
    return float(min(b.max, b.initial * 2 ** (restart - 1)))
