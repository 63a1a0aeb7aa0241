"""What kind of failure ended an attempt, and was it the same error as the attempt before?

``classify`` gives every failure a class and the evidence that decided it, so that the restart
policy spends no restart on a bug that no restart can fix and keeps a separate budget for the
cluster's own failures::

    user            the program failed on its own: a Python exception, a nonzero exit
    infrastructure  a node or agent lost, a worker killed from outside (SIGKILL: the kernel's
                    OOM killer, most often), a bus error, a gloo/NCCL connection or timeout
                    error, a GPU error, a host that cannot be reached, a checkpoint copy
                    that could not be pulled from another node
    preempted       a SIGTERM (or SIGHUP, SIGINT) from outside the orchestrator: ours never
                    end an attempt's first failure (e.g. a Slurm preemption); a planned
                    move off drained nodes (orchestrator/drain.py)
    hung            no output and no heartbeat for health.hang_timeout
    unknown         none of those (SIGSEGV, SIGABRT, max_duration); but a SIGABRT right
                    after an uncaught exception (C++ ``terminate`` as the interpreter exits)
                    is that exception's class

``signature`` is the error itself (exception type and innermost frame), from torch's error
file or the traceback at the end of the rank's stderr. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from orchestrator.state import FailureCause

if TYPE_CHECKING:
    from orchestrator.attempt import Failure


class FailureClass(str, Enum):
    USER = "user"
    INFRASTRUCTURE = "infrastructure"
    PREEMPTED = "preempted"
    HUNG = "hung"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Verdict:
    klass: FailureClass
    evidence: str  # the line, signal or event that decided it


# Lines that say the machine or the network failed, not the program: a rank that lost its
# peers, a collective that timed out, a GPU that reported a hardware error.
_INFRA_LINE = re.compile(
    r"Connection (closed|reset) by peer|Connection refused|Connection timed out"
    r"|No route to host|Network is unreachable|Broken pipe"
    r"|NCCL (error|communicator was aborted)|nccl(System|Remote|Internal)Error"
    r"|Socket Timeout|Watchdog caught collective operation timeout"
    r"|\bXid\b|uncorrectable ECC|ECC error|cudaErrorECCUncorrectable"
    r"|unspecified launch failure|GPU is lost|fell off the bus"
    r"|no copy of step \d+ of rank \d+ from",  # a copy not pulled (agents/pulls.py)
    re.IGNORECASE)
# What the C++ runtime prints as it aborts a process on its way out (a thread left running).
_ABORT_LINE = re.compile(r"terminate called |\s*what\(\):|Aborted( \(core dumped\))?$")
_PREEMPTING = frozenset({"SIGTERM", "SIGHUP", "SIGINT"})
_INFRA_SIGNALS = {"SIGKILL": "killed by SIGKILL from outside the orchestrator (the kernel's "
                             "OOM killer, most often)",
                  "SIGBUS": "bus error (SIGBUS: a memory or /dev/shm fault)"}
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s(?P<text>.*))?$")
_INFRA_CAUSES = {
    FailureCause.NODE_FAIL: "node lost",
    FailureCause.CONTROLLER_LOST: "the controller was gone longer than controller_grace",
    FailureCause.NODE_UNHEALTHY: "health check failed",
}


def classify(failure: Failure) -> Verdict:
    """The class of ``failure`` and why."""
    cause = failure.cause
    if cause == FailureCause.HUNG:
        return Verdict(FailureClass.HUNG, failure.message)
    if cause == FailureCause.PREEMPTED:
        return Verdict(FailureClass.PREEMPTED, failure.message)
    if cause in _INFRA_CAUSES:
        return Verdict(FailureClass.INFRASTRUCTURE, f"{_INFRA_CAUSES[cause]}: {failure.message}")
    if cause == FailureCause.LAUNCH_FAILED:
        line = _infra_line([failure.message])
        if line is not None:
            return Verdict(FailureClass.INFRASTRUCTURE, line)
        return Verdict(FailureClass.USER, failure.message)
    if cause == FailureCause.SETUP_FAILED:  # the spec's own commands
        return Verdict(FailureClass.USER, failure.message)
    if cause != FailureCause.WORKER_FAILED:
        return Verdict(FailureClass.UNKNOWN, failure.message)
    sig = failure.signal
    if sig in _PREEMPTING:
        return Verdict(FailureClass.PREEMPTED, f"{sig} from outside the orchestrator")
    if sig in _INFRA_SIGNALS:
        return Verdict(FailureClass.INFRASTRUCTURE, _INFRA_SIGNALS[sig])
    line = _infra_line(failure.stderr_tail)
    if line is not None:
        return Verdict(FailureClass.INFRASTRUCTURE, line)
    if sig == "SIGABRT" and _aborted_exiting(failure):
        return Verdict(FailureClass.USER, f"{exception_line(failure)} (then SIGABRT, exiting)")
    if sig is not None:
        return Verdict(FailureClass.UNKNOWN, f"killed by {sig}")
    error = exception_line(failure)
    if error is not None:
        return Verdict(FailureClass.USER, error)
    if failure.exit_code:
        return Verdict(FailureClass.USER, f"exit code {failure.exit_code}")
    return Verdict(FailureClass.UNKNOWN, failure.message)


def _infra_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if _INFRA_LINE.search(line):
            return _RANK_PREFIX.sub("", line).strip()[:300]
    return None


def _aborted_exiting(failure: Failure) -> bool:
    """The rank's stderr ends with an uncaught exception and then only the C++ runtime's
    abort: the program failed of its exception and the abort came with the interpreter's
    exit (a thread torch left running), which is no second error."""
    error = exception_line(failure)
    if error is None:
        return False
    tail = [_RANK_PREFIX.sub("", line) for line in failure.stderr_tail]
    after = next((tail[i + 1:] for i in range(len(tail) - 1, -1, -1)
                  if tail[i].strip() == error), None)
    if after is None:  # the exception came from torch's error file, not the tail
        return bool(failure.error_file)
    return all(not line.strip() or _ABORT_LINE.match(line) for line in after)


def _traceback_lines(failure: Failure) -> list[str]:
    """The traceback torch's ``@record`` wrote, else the rank's stderr tail, unprefixed."""
    if failure.error_file:
        try:
            message = json.loads(failure.error_file)["message"]
            stack = message["extraInfo"]["py_callstack"]
            if isinstance(stack, str) and stack.strip():
                return stack.splitlines()
        except Exception:  # noqa: BLE001 (the worker's file: any shape at all)
            pass
    return [_RANK_PREFIX.sub("", line) for line in failure.stderr_tail]


def _last_traceback(failure: Failure) -> tuple[str | None, str | None]:
    """(innermost frame as ``file:line``, the exception line) of the last traceback."""
    lines = _traceback_lines(failure)
    frame, error = None, None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            frame, error = f"{m['file']}:{m['line']}", None
            for after in lines[i + 1:]:
                if after.startswith((" ", "\t")) or not after.strip():
                    continue
                e = _EXCEPTION.match(after.strip())
                if e and not after.startswith("Traceback"):
                    error = after.strip()
                break
    return frame, error


def exception_line(failure: Failure) -> str | None:
    """``ModuleNotFoundError: No module named 'x'``, when the rank died of an exception."""
    return _last_traceback(failure)[1]


def signature(failure: Failure) -> str | None:
    """The error, as two failures are compared: ``ModuleNotFoundError at train.py:4``
    (exception type and innermost frame), or None when the rank left no traceback."""
    frame, error = _last_traceback(failure)
    if frame is None or error is None:
        return None
    m = _EXCEPTION.match(error)
    kind = m["type"] if m else error.split(":", 1)[0]
    path, _, line = frame.rpartition(":")
    return f"{kind} at {path.rsplit('/', 1)[-1]}:{line}"


def same_error(failure: Failure, previous: Failure | None) -> bool:
    """The same error at the same step (where steps are known) as the attempt before.

    Whichever rank reports it: when every rank hits the same bug, which of them fails first
    is a race, and comparing ranks would let a deterministic bug spend the whole budget."""
    if previous is None:
        return False
    sig = signature(failure)
    if sig is None or sig != signature(previous):
        return False
    if failure.step is not None and previous.step is not None:
        return failure.step == previous.step
    return True
