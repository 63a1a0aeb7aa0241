"""What happens between ``submit`` and the first line of output, and on to the recorded end:
the phases of a job's run, each marked when reached, once per attempt.

    submitted      the job is recorded (``submit``; the store's ``submitted_at``)
    controller     its controller process runs (the supervisor forked it; the spec read)
    connect        every node's agent is asked for (orchestrator/bringup.py): an SSH login,
                   a relay, the agent started where none answers
    hello          every node's agent answered (or the launch failed for want of them)
    prepared       sync and setup are done on every node that needs them (prepare.py)
    checked        the health checks and the network check passed (healthcheck.py), and the
                   attempt's nodes are chosen (participants.py)
    start          the attempt's ``start`` went to every node (its master port picked)
    started        every worker of the attempt is running
    first_output   the attempt's first line of output reached the controller
    exit           the attempt ended (every rank exited, or the first failure)
    teardown       the agents were shut down (the job's end)
    state_written  the job's end is being recorded

The controller's log has a line for each, and ``status --json`` shows them (``timeline``:
the phase, the attempt, seconds since ``submitted``): that is where a slow submit shows
where its time went (benchmarks/bench_latency.py). A resumed controller carries on the
marks its predecessor wrote.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("orchestrator.controller")

PHASES = ("submitted", "controller", "connect", "hello", "prepared", "checked", "start",
          "started", "first_output", "exit", "teardown", "state_written")
MAX_MARKS = 256  # a job restarted hundreds of times keeps its first marks and its latest


class Timeline:
    """The marks of one job, in the order they were reached."""

    def __init__(self, submitted_at: float | None = None,
                 marks: list[tuple[str, int | None, float]] | None = None):
        self.submitted_at = submitted_at
        self.marks = list(marks or [])
        self._seen = {(phase, attempt) for phase, attempt, _ in self.marks}
        self.dirty = False  # marks not yet written to the store

    def mark(self, phase: str, attempt: int | None = None, at: float | None = None) -> None:
        """``phase`` (one of PHASES) is reached now (or at ``at``), for ``attempt``; a phase
        already marked for that attempt keeps its first time."""
        assert phase in PHASES, phase
        if (phase, attempt) in self._seen:
            return
        self._seen.add((phase, attempt))
        at = time.time() if at is None else at
        self.marks.append((phase, attempt, at))
        if len(self.marks) > MAX_MARKS:
            del self.marks[MAX_MARKS // 2]
        self.dirty = True
        since = f" (+{at - self.submitted_at:.3f}s since submit)" if self.submitted_at else ""
        log.info("phase %s%s%s", phase, f" of attempt {attempt}" if attempt else "", since)

    def to_json(self) -> str:
        self.dirty = False
        return json.dumps([[p, a, round(t, 6)] for p, a, t in self.marks])

    @classmethod
    def from_json(cls, text: str | None, submitted_at: float | None) -> Timeline:
        """The marks a store kept; what cannot be read is left out (a record is never the
        reader's error)."""
        marks = []
        try:
            for phase, attempt, at in json.loads(text or "[]"):
                if phase in PHASES and (attempt is None or type(attempt) is int) and \
                        isinstance(at, (int, float)):
                    marks.append((phase, attempt, float(at)))
        except (ValueError, TypeError):
            pass
        return cls(submitted_at, marks)


def shown(text: str | None, submitted_at: float | None) -> list[dict[str, Any]]:
    """The marks as ``status --json`` shows them: phase, attempt, seconds since submit."""
    timeline = Timeline.from_json(text, submitted_at)
    start = submitted_at or (timeline.marks[0][2] if timeline.marks else 0.0)
    out: list[dict[str, Any]] = []
    if submitted_at is not None:
        out.append({"phase": "submitted", "attempt": None, "seconds": 0.0})
    out += [{"phase": p, "attempt": a, "seconds": round(t - start, 3)}
            for p, a, t in timeline.marks]
    return out
