"""Job, node, rank and attempt states, the transitions allowed between them, failure causes.

Every state change of a job goes through :func:`check_transition`, and of a node through
:func:`check_node_transition`, so the tables below are the whole lifecycle. A job::

    PENDING ──> LAUNCHING ──> RUNNING ──> SUCCEEDED
       │            │  ▲          │
       │            │  └──────────┤ (a worker or node failed and the budget allows)
       │            │        RESTARTING
       │            ▼             │
       └──────> FAILED <──────────┤
       └──────> CANCELLED <───────┘   (cancel wins from every non-terminal state)

    RUNNING ──> PREEMPTED ──> RESTARTING (``resume``), or CANCELLED
                (every node left on notice or drain, at a step every rank saved)

PREEMPTED is at rest, as the terminal states are (no controller runs the job, nothing waits
for it to go on), but not terminal: the job keeps its secrets, and ``resume`` continues it
from the saved step.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Lifecycle of a job (Slurm / TorchX vocabulary). Terminal: SUCCEEDED, FAILED, CANCELLED;
    at rest as well: PREEMPTED (until resumed)."""

    PENDING = "PENDING"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"

    def is_terminal(self) -> bool:
        """The job ended for good: nothing resumes it (its secrets go)."""
        return self in _TERMINAL

    def is_at_rest(self) -> bool:
        """No controller runs the job, and none is to be started for it unasked: it ended,
        or it stopped PREEMPTED (until ``resume``)."""
        return self in _TERMINAL or self == JobState.PREEMPTED


class NodeState(str, Enum):
    """What the controller knows of one node's agent.

    A dropped channel (or a silence) makes a node UNREACHABLE, not LOST: its agent keeps the
    workers and spools their output, and the controller reconnects (a silent node's word on
    the channel it kept brings it back sooner). Only when the agent has not been
    heard for ``health.node_timeout`` (or is gone) is the node LOST::

        PENDING ─> CONNECTED <─> RUNNING <─> STOPPED        (any of these) ─> DONE
                       ▲  │         │  ▲        │
                       │  └──> UNREACHABLE <────┘   (reattached: back where it was)
                       │            │
                       └── LOST <───┘ (also from CONNECTED, RUNNING, STOPPED)
        PENDING / LOST ─> FAILED (could not reach or start the agent) ─> CONNECTED (retried)
    """

    PENDING = "PENDING"  # not connected yet
    CONNECTED = "CONNECTED"  # agent said hello, no workers of the current attempt
    RUNNING = "RUNNING"  # workers of the current attempt running
    STOPPED = "STOPPED"  # workers stopped or finished
    UNREACHABLE = "UNREACHABLE"  # channel dropped or silent: reconnecting, the agent goes on
    LOST = "LOST"  # agent gone or unheard for node_timeout
    FAILED = "FAILED"  # could not connect or start the agent
    DONE = "DONE"  # agent shut down cleanly


class RankState(str, Enum):
    """One rank of one attempt."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # exited non-zero or by a signal, on its own
    STOPPED = "STOPPED"  # ended by the orchestrator (another rank failed, cancel, ...)


class AttemptOutcome(str, Enum):
    """How an attempt ended (``RUNNING`` while it has not)."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class FailureCause(str, Enum):
    """Why an attempt (and possibly the job) failed."""

    WORKER_FAILED = "WORKER_FAILED"
    NODE_FAIL = "NODE_FAIL"
    HUNG = "HUNG"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    RESTARTS_EXHAUSTED = "RESTARTS_EXHAUSTED"
    # The controller was gone longer than the agents' controller_grace: they stopped the
    # workers. Restarted without charging max_restarts (not the user's failure).
    CONTROLLER_LOST = "CONTROLLER_LOST"
    TIMEOUT = "TIMEOUT"  # max_duration reached: never restarted
    SETUP_FAILED = "SETUP_FAILED"  # a node's setup commands failed: no restart charged
    # Nodes failed their health check (health.node_check, min_free_bytes) and too few were
    # left for nnodes MIN: the job fails at once, naming them.
    NODE_UNHEALTHY = "NODE_UNHEALTHY"
    # The controller kept failing on the same error (a bug of ours, or an environment it
    # cannot run in): after the agents' controller_grace (or a cancel) the job ends, naming
    # the error; no restart is charged (orchestrator/supervisor.py).
    CONTROLLER_FAILED = "CONTROLLER_FAILED"
    # A planned interruption (orchestrator/drain.py): the ranks saved an agreed step and the
    # job goes on without the drained nodes, at once, no restart charged. Naming no node:
    # every node left, and the job stops PREEMPTED until ``resume``.
    PREEMPTED = "PREEMPTED"


_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.LAUNCHING, JobState.FAILED, JobState.CANCELLED}),
    JobState.LAUNCHING: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED,
         JobState.PREEMPTED}
    ),
    JobState.RESTARTING: frozenset({JobState.LAUNCHING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.PREEMPTED: frozenset({JobState.RESTARTING, JobState.CANCELLED}),
}


class InvalidTransition(ValueError):
    """A state change that the lifecycle does not allow: a bug in the caller."""


def check_transition(current: JobState, new: JobState) -> None:
    """Raise :class:`InvalidTransition` unless ``current -> new`` is in the table."""
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(f"job state {current.value} -> {new.value} is not allowed")


_N = NodeState
_LIVE = frozenset({_N.CONNECTED, _N.RUNNING, _N.STOPPED})
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _N.PENDING: frozenset({_N.CONNECTED, _N.FAILED, _N.LOST, _N.DONE}),
    _N.CONNECTED: frozenset({_N.RUNNING, _N.STOPPED, _N.UNREACHABLE, _N.LOST, _N.FAILED,
                             _N.DONE}),
    _N.RUNNING: frozenset({_N.CONNECTED, _N.STOPPED, _N.UNREACHABLE, _N.LOST, _N.DONE}),
    _N.STOPPED: frozenset({_N.CONNECTED, _N.RUNNING, _N.UNREACHABLE, _N.LOST, _N.DONE}),
    _N.UNREACHABLE: _LIVE | {_N.LOST, _N.DONE},
    _N.LOST: frozenset({_N.CONNECTED, _N.FAILED, _N.DONE}),
    _N.FAILED: frozenset({_N.CONNECTED, _N.LOST, _N.DONE}),
    _N.DONE: frozenset({_N.CONNECTED}),  # a replaced controller finds a node it had closed
}


def check_node_transition(current: NodeState, new: NodeState) -> None:
    """Raise :class:`InvalidTransition` unless ``current -> new`` is allowed (or the same)."""
    if new != current and new not in NODE_TRANSITIONS[current]:
        raise InvalidTransition(f"node state {current.value} -> {new.value} is not allowed")
