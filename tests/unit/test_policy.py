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


MISSING_IMPORT = ["Traceback (most recent call last):",
                  '  File "/work/train.py", line 4, in <module>', "    import mymodel",
                  "ModuleNotFoundError: No module named 'mymodel'"]


def crashed(tail=(), code=1, sig=None, rank=0):
    return AttemptResult(AttemptOutcome.FAILED, Failure(
        FailureCause.WORKER_FAILED, f"rank {rank} exited with code {code}", rank=rank,
        exit_code=code, signal=sig, stderr_tail=list(tail)))


def spec(policy="", max_restarts=5):
    return parse_jobspec(f"nodes: [{{host: local}}]\ncommand: [x]\nmax_restarts: {max_restarts}"
                         f"\nrestart_backoff: {{initial: 1, max: 3}}\n{policy}")


def test_the_same_error_twice_ends_the_job_with_the_budget_left():
    first, second = crashed(MISSING_IMPORT), crashed(MISSING_IMPORT)
    assert decide(first, 0, spec()) == Restart(1.0, charged=True)
    assert first.failure.failure_class == "user"
    assert first.failure.decision == "restarted: restart 1 of max_restarts 5"
    end = decide(second, 1, spec(), previous=first.failure)
    assert isinstance(end, Fail) and end.failure["restarts_exhausted"] is False
    assert end.failure["decision"] == \
        "not restarted: the same error twice (ModuleNotFoundError at train.py:4)"
    assert end.failure["message"].endswith(
        "(not restarted: the same error twice (ModuleNotFoundError at train.py:4))")
    # Another error, or stop_on_repeat off: restarted.
    other = MISSING_IMPORT[:3] + ["ModuleNotFoundError: No module named 'x'"]
    assert isinstance(decide(crashed(other[:1] + ['  File "/work/train.py", line 5, in <m>']
                                     + other[2:], rank=1), 1, spec(), previous=first.failure),
                      Restart)
    off = spec("restart_policy: {stop_on_repeat: false}\n")
    assert isinstance(decide(crashed(MISSING_IMPORT), 1, off, previous=first.failure), Restart)


def test_the_same_error_right_after_resuming_a_checkpoint_falls_back_once():
    """A copy that verifies but is bad: the same error right after resuming step 40 is
    restarted once from a checkpoint older than 40 (charged); a second time, or once the
    budget is spent, or without a resumed step, stop_on_repeat ends the job as before."""
    first = crashed(MISSING_IMPORT)
    resumed = AttemptResult(AttemptOutcome.FAILED, crashed(MISSING_IMPORT).failure, 40)
    back = decide(resumed, 1, spec(), previous=first.failure)
    assert isinstance(back, Restart) and back.charged and back.below == 40
    assert resumed.failure is not None and resumed.failure.decision == (
        "restarted: restart 2 of max_restarts 5, from a checkpoint older than step 40: the "
        "same error twice, after resuming step 40")
    again = AttemptResult(AttemptOutcome.FAILED, crashed(MISSING_IMPORT).failure, 39)
    assert isinstance(decide(again, 2, spec(), previous=first.failure, fell_back=True), Fail)
    spent = AttemptResult(AttemptOutcome.FAILED, crashed(MISSING_IMPORT).failure, 40)
    assert isinstance(decide(spent, 5, spec(), previous=first.failure), Fail)
    fresh = crashed(MISSING_IMPORT)  # no checkpoint resumed: nothing to fall back from
    assert isinstance(decide(fresh, 1, spec(), previous=first.failure), Fail)


def test_infrastructure_failures_have_their_own_budget_when_asked():
    own = spec("restart_policy: {max_infra_restarts: 2}\n", max_restarts=1)
    killed = crashed(code=None, sig="SIGKILL")
    assert decide(killed, 0, own) == Restart(1.0, charged=False, infra=True)
    assert killed.failure.decision == "restarted: infrastructure failure 1 of max_infra_restarts 2"
    assert decide(crashed(code=None, sig="SIGKILL"), 1, own, infra_restarts=1) == \
        Restart(3.0, charged=False, infra=True)  # the backoff counts every restart
    spent = decide(crashed(code=None, sig="SIGKILL"), 0, own, infra_restarts=2)
    assert isinstance(spent, Fail)
    assert spent.failure["decision"] == "not restarted: max_infra_restarts (2) reached"
    # Without max_infra_restarts they count against max_restarts, as before.
    assert decide(crashed(code=None, sig="SIGKILL"), 0, spec()) == Restart(1.0, charged=True)


def test_exit_codes_and_log_lines_say_what_a_failure_is():
    rules = spec("restart_policy:\n  restart_on_exit_codes: [75]\n  max_infra_restarts: 3\n"
                 "  fail_on_log: ['CUDA out of memory']\n  restart_on_log: ['EADDRINUSE']\n"
                 "  fail_on_exit_codes: [9]\n")
    tempfail = crashed(MISSING_IMPORT, code=75)
    again = crashed(MISSING_IMPORT, code=75)
    decide(tempfail, 0, rules)
    # restart_on_exit_codes: infrastructure, so the same error twice is restarted all the same.
    assert decide(again, 0, rules, previous=tempfail.failure, infra_restarts=1) == \
        Restart(2.0, charged=False, infra=True)
    assert again.failure.evidence == "exit code 75 is in restart_on_exit_codes"
    oom = decide(crashed(["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"]), 0,
                 rules)
    assert isinstance(oom, Fail)
    assert oom.failure["decision"].startswith("not restarted: fail_on_log matched: torch.OutOf")
    port = crashed(["RuntimeError: EADDRINUSE"])
    assert decide(port, 0, rules) == Restart(1.0, charged=False, infra=True)
    assert port.failure.evidence == "restart_on_log matched: RuntimeError: EADDRINUSE"
    code = decide(crashed(code=9), 0, rules)  # restart_policy.fail_on_exit_codes
    assert isinstance(code, Fail) and "exit code 9 is in fail_on_exit_codes" in \
        code.failure["decision"]
