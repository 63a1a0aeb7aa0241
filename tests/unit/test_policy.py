"""The restart policy alone: a pure decision, no cluster."""

from __future__ import annotations

from orchestrator.attempt import AttemptResult, Failure
from orchestrator.policy import Fail, Restart, Succeed, decide
from orchestrator.spec import parse_jobspec
from orchestrator.state import AttemptOutcome, FailureCause

SPEC = parse_jobspec("nodes: [{host: local}]\ncommand: [x]\nmax_restarts: 2\n"
                     "fail_on_exit_codes: [42]\nrestart_backoff: {initial: 1, max: 3}\n")


def failed(cause=FailureCause.WORKER_FAILED, code=1):
    return AttemptResult(AttemptOutcome.FAILED, Failure(cause, "boom", exit_code=code))


def test_success_failure_and_the_budget():
    assert decide(AttemptResult(AttemptOutcome.SUCCEEDED), 0, SPEC) == Succeed()
    assert decide(failed(), 0, SPEC) == Restart(1.0, charged=True)
    assert decide(failed(), 1, SPEC) == Restart(2.0, charged=True)
    last = decide(failed(), 2, SPEC)
    assert isinstance(last, Fail) and last.failure["cause"] == "RESTARTS_EXHAUSTED"
    assert last.failure["root_cause"] == "WORKER_FAILED"
    assert "after 2 restart(s), max_restarts reached" in last.failure["message"]


def test_what_is_never_restarted_and_what_is_free():
    code = decide(failed(code=42), 0, SPEC)
    assert isinstance(code, Fail) and code.failure["restarts_exhausted"] is False
    assert isinstance(decide(failed(FailureCause.LAUNCH_FAILED), 0, SPEC), Fail)
    assert decide(failed(FailureCause.CONTROLLER_LOST), 2, SPEC) == Restart(1.0, charged=False)
    many = parse_jobspec("nodes: [{host: local}]\ncommand: [x]\nmax_restarts: 9\n"
                         "restart_backoff: {initial: 1, max: 3}\n")
    assert decide(failed(), 5, many) == Restart(3.0, charged=True)  # capped at max
