"""The restart policy: after an attempt ends, what next? Pure (no I/O, no clock), in the shape
of torch's ``_invoke_run``: the controller asks, and does what it is told.

- every rank exited 0: the job SUCCEEDED;
- the agents gave up while no controller was there (CONTROLLER_LOST): restart, not charged
  to ``max_restarts`` (infrastructure failures are not the user's budget);
- a planned interruption (PREEMPTED: orchestrator/drain.py): restart at once, not charged;
  one that names no node (every node left): the job stops PREEMPTED, until ``resume``;
- never restarted: a launch failure, an exit code in ``fail_on_exit_codes``, a line matching
  ``restart_policy.fail_on_log``, or (``stop_on_repeat``) the same error from the same rank
  at the same step as in the attempt before: no restart can fix those;
- an infrastructure failure (orchestrator/failclass.py; ``restart_on_exit_codes`` and
  ``restart_on_log`` make one) with ``max_infra_restarts`` set: restart on that budget;
- otherwise: restart after ``restart_backoff`` (doubling per restart), charged to
  ``max_restarts``, or FAILED when it is spent.

Every failure gets its class, evidence and error signature, and the decision with its reason,
written on it: the attempt history keeps them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from orchestrator import failclass
from orchestrator.attempt import AttemptResult, Failure
from orchestrator.failclass import FailureClass, Verdict
from orchestrator.spec import JobSpec
from orchestrator.state import AttemptOutcome, FailureCause, JobState


@dataclass(frozen=True)
class Succeed:
    pass


@dataclass(frozen=True)
class Restart:
    delay: float  # seconds to wait first
    charged: bool  # counted against max_restarts
    infra: bool = False  # counted against max_infra_restarts instead
    reason: str = field(default="", compare=False)
    below: int | None = None  # resume a checkpoint older than this step (a fall back)


@dataclass(frozen=True)
class Fail:
    failure: dict[str, Any]  # the job's failure, as status shows it
    state = JobState.FAILED


@dataclass(frozen=True)
class Preempted:
    """Every node left at a saved step: the job stops, to be resumed from it."""

    failure: dict[str, Any]
    state = JobState.PREEMPTED


Decision = Succeed | Restart | Fail | Preempted


def decide(result: AttemptResult, restarts: int, spec: JobSpec,
           previous: Failure | None = None, infra_restarts: int = 0,
           fell_back: bool = False) -> Decision:
    """What to do after an attempt that ended with ``result``, ``restarts`` (and
    ``infra_restarts``) having been charged before it; ``previous`` is the failure of the
    attempt before, if it failed. Writes the class and the decision on ``result.failure``.

    The same error again right after resuming a checkpoint may be that checkpoint's (a state
    that verifies but is bad: NaN, a poisoned batch): once per job (``fell_back``: done), it
    is restarted from an older checkpoint rather than ended by ``stop_on_repeat``."""
    if result.outcome == AttemptOutcome.SUCCEEDED:
        return Succeed()
    failure = result.failure
    assert failure is not None
    verdict = verdict_of(failure, spec)
    failure.failure_class, failure.evidence = verdict.klass.value, verdict.evidence
    failure.signature = failclass.signature(failure)
    if failure.cause == FailureCause.CONTROLLER_LOST:
        failure.decision = "restarted, not charged: the controller was gone, not the job"
        return Restart(spec.restart_backoff.initial, charged=False, reason=failure.decision)
    if failure.cause == FailureCause.PREEMPTED and failure.node_index is None:
        failure.decision = "stopped PREEMPTED, not charged: every node left; resume goes on"
        return Preempted(failure.to_dict())
    if failure.cause == FailureCause.PREEMPTED:
        failure.decision = "moved, not charged: a planned interruption"
        return Restart(0.0, charged=False, reason=failure.decision)
    never = _never_restarted(failure, spec)
    repeat = (never is None and spec.restart_policy.stop_on_repeat
              and verdict.klass == FailureClass.USER and failclass.same_error(failure, previous))
    below = result.restored_step if repeat and not fell_back else None
    if below is not None and restarts < spec.max_restarts:
        failure.decision = (f"restarted: restart {restarts + 1} of max_restarts "
                            f"{spec.max_restarts}, from a checkpoint older than step {below}: "
                            f"the same error twice, after resuming step {below}")
        return Restart(backoff(restarts + infra_restarts + 1, spec), charged=True,
                       reason=failure.decision, below=below)
    if repeat:
        never = f"the same error twice ({failure.signature})"
    if never is not None:
        failure.decision = f"not restarted: {never}"
        return Fail(final_failure(failure, restarts, spec, exhausted=False))
    delay = backoff(restarts + infra_restarts + 1, spec)
    infra_budget = spec.restart_policy.max_infra_restarts
    if verdict.klass == FailureClass.INFRASTRUCTURE and infra_budget is not None:
        if infra_restarts < infra_budget:
            failure.decision = (f"restarted: infrastructure failure {infra_restarts + 1} of "
                                f"max_infra_restarts {infra_budget}")
            return Restart(delay, charged=False, infra=True, reason=failure.decision)
        failure.decision = f"not restarted: max_infra_restarts ({infra_budget}) reached"
        return Fail(final_failure(failure, restarts, spec, exhausted=False))
    if restarts < spec.max_restarts:
        failure.decision = f"restarted: restart {restarts + 1} of max_restarts {spec.max_restarts}"
        return Restart(delay, charged=True, reason=failure.decision)
    failure.decision = (f"not restarted: max_restarts ({spec.max_restarts}) reached"
                        if spec.max_restarts else "not restarted: max_restarts is 0")
    return Fail(final_failure(failure, restarts, spec))


def verdict_of(failure: Failure, spec: JobSpec) -> Verdict:
    """The failure's class, where ``restart_on_exit_codes`` and ``restart_on_log`` say that
    a failure of the program is the infrastructure's."""
    verdict = failclass.classify(failure)
    if verdict.klass == FailureClass.INFRASTRUCTURE:
        return verdict
    policy = spec.restart_policy
    if failure.exit_code is not None and failure.exit_code in policy.restart_on_exit_codes:
        return Verdict(FailureClass.INFRASTRUCTURE,
                       f"exit code {failure.exit_code} is in restart_on_exit_codes")
    line = _matching_line(failure, policy.restart_on_log)
    if line is not None:
        return Verdict(FailureClass.INFRASTRUCTURE, f"restart_on_log matched: {line}")
    return verdict


def _never_restarted(failure: Failure, spec: JobSpec) -> str | None:
    """Why no restart can help, or None (``stop_on_repeat`` aside: see decide)."""
    if failure.cause == FailureCause.LAUNCH_FAILED:
        return "the launch failed"
    if failure.exit_code is not None and failure.exit_code in spec.fail_on_exit_codes:
        return f"exit code {failure.exit_code} is in fail_on_exit_codes"
    line = _matching_line(failure, spec.restart_policy.fail_on_log)
    if line is not None:
        return f"fail_on_log matched: {line}"
    return None


def _matching_line(failure: Failure, patterns: tuple[str, ...]) -> str | None:
    lines = [*failure.stderr_tail, failure.message]
    for pattern in patterns:
        regex = re.compile(pattern)
        for line in lines:
            if regex.search(line):
                return line.strip()[:300]
    return None


def final_failure(failure: Failure, restarts: int, spec: JobSpec,
                  exhausted: bool = True) -> dict[str, Any]:
    """The job's failure: the last attempt's first failure, as ``root_cause``; the cause is
    RESTARTS_EXHAUSTED when a restart budget was spent on it (``exhausted``: may have been)."""
    d = failure.to_dict()
    d["root_cause"] = d["cause"]
    d["restarts_exhausted"] = exhausted and spec.max_restarts > 0 and restarts >= spec.max_restarts
    if not exhausted and failure.decision and failure.cause != FailureCause.LAUNCH_FAILED:
        d["message"] += f" ({failure.decision})"
    if d["restarts_exhausted"]:
        d["cause"] = FailureCause.RESTARTS_EXHAUSTED.value
        d["message"] += f" (after {restarts} restart(s), max_restarts reached)"
    return d


def backoff(restart: int, spec: JobSpec) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...)."""
    b = spec.restart_backoff
    return float(min(b.max, b.initial * 2 ** (restart - 1)))
