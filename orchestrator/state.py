"""Job and node states, the transitions allowed between them, and failure causes.

Every state change of a job goes through :func:`check_transition`, so the table below is
the whole lifecycle::

    PENDING ──> LAUNCHING ──> RUNNING ──> SUCCEEDED
       │            │  ▲          │
       │            │  └──────────┤ (a worker or node failed and the budget allows)
       │            │        RESTARTING
       │            ▼             │
       └──────> FAILED <──────────┤
       └──────> CANCELLED <───────┘   (cancel wins from every non-terminal state)
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Lifecycle of a job (Slurm / TorchX vocabulary). Terminal: SUCCEEDED, FAILED, CANCELLED."""

    PENDING = "PENDING"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in _TERMINAL


class NodeState(str, Enum):
    """What the controller knows of one node's agent."""

    PENDING = "PENDING"  # not connected yet
    CONNECTED = "CONNECTED"  # agent said hello, no workers
    RUNNING = "RUNNING"  # workers of the current attempt running
    STOPPED = "STOPPED"  # workers stopped or finished
    LOST = "LOST"  # channel dropped, agent died or heartbeats stopped
    FAILED = "FAILED"  # could not connect or start the agent
    DONE = "DONE"  # agent shut down cleanly


class FailureCause(str, Enum):
    """Why an attempt (and possibly the job) failed."""

    WORKER_FAILED = "WORKER_FAILED"
    NODE_FAIL = "NODE_FAIL"
    HUNG = "HUNG"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    RESTARTS_EXHAUSTED = "RESTARTS_EXHAUSTED"


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.LAUNCHING, JobState.FAILED, JobState.CANCELLED}),
    JobState.LAUNCHING: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RESTARTING: frozenset({JobState.LAUNCHING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    """A state change that the lifecycle does not allow: a bug in the caller."""


def check_transition(current: JobState, new: JobState) -> None:
    """Raise :class:`InvalidTransition` unless ``current -> new`` is in the table."""
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(f"job state {current.value} -> {new.value} is not allowed")
