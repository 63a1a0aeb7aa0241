"""What the store gives back: a job, its nodes (with their history), its ranks and its
attempts, as plain records read in one transaction (orchestrator/store.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.state import JobState, NodeState


@dataclass
class RankRecord:
    attempt: int
    rank: int
    node_index: int
    local_rank: int
    pid: int | None
    state: str
    exit_code: int | None
    signal: str | None
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    steps_per_s: float | None = None
    heartbeat_at: float | None = None
    output_at: float | None = None
    wait_share: float | None = None  # of the last 30 s, spent waiting in collectives
    first_step: int | None = None  # the first step this attempt saw of the rank, and when
    first_step_at: float | None = None
    step_at: float | None = None  # when it gave ``step``
    total_steps: int | None = None  # the steps it said the run takes in all


@dataclass
class NodeEvent:
    at: float
    state: NodeState
    message: str | None


@dataclass
class NodeRecord:
    node_index: int
    host: str
    node_rank: int | None
    state: NodeState
    info: dict[str, Any]
    acked_seq: int = 0
    heard_at: float | None = None
    longest_silence: float | None = None  # seconds unheard at most, while attached
    history: list[NodeEvent] = field(default_factory=list)  # its last changes (storenodes.HISTORY)
    entered: dict[str, int] = field(default_factory=dict)  # state -> times it entered it


@dataclass(frozen=True)
class AttemptSteps:
    """What the ranks' steps say of one attempt (orchestrator/timelost.py): how many ranks
    gave a step, the latest first step's time, the lowest first step, the highest last
    step, and the slowest rank's steps per second (None: no rank stepped twice)."""

    attempt: int
    ranks: int
    first_at_max: float
    first_step_min: int
    last_step_max: int
    rate_min: float | None


@dataclass(frozen=True)
class StepSpan:
    """One rank's steps in one attempt, as its samples have them (orchestrator/timelost.py)."""

    attempt: int
    rank: int
    first_step: int
    first_at: float
    last_step: int
    last_at: float


@dataclass
class AttemptRecord:
    attempt: int
    started_at: float
    ended_at: float | None
    outcome: str | None
    master_addr: str | None
    master_port: int | None
    world_size: int | None
    failure: dict[str, Any] | None
    stragglers: list[int] = field(default_factory=list)
    warm_starts: int = 0  # workers a standby became (agents/standby.py)
    restored_step: int | None = None  # the checkpoint step its ranks resumed (None: fresh)
    # What its controller decided after it, recorded with its end: {"state": the job's end,
    # "failure"} or {"restart": the count it was charged to}. A controller that takes over
    # between the two acts on it (a job that had ended was run again).
    next: dict[str, Any] | None = None


@dataclass
class JobRecord:
    job_id: str
    name: str
    state: JobState
    spec_json: str
    spec_dir: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    attempt: int
    restarts: int
    max_restarts: int
    controller_pid: int | None
    cancel_requested: bool
    failure: dict[str, Any] | None
    secret: str | None = None
    controller_host: str | None = None
    controller_since: float | None = None
    supervisor_pid: int | None = None
    free_restarts: int = 0
    infra_restarts: int = 0  # charged to restart_policy.max_infra_restarts
    controller_pidns: str | None = None
    controller_ident: str | None = None  # orchestrator.pids.identity of controller_pid
    supervisor_ident: str | None = None
    slurm: dict[str, Any] | None = None  # the Slurm allocation (orchestrator.slurm.Allocation)
    paused: dict[str, Any] | None = None  # {since, reason}: the home cannot be written
    failing: dict[str, Any] | None = None  # the controller keeps failing (supervisor.py)
    resume_requested_at: float | None = None  # `resume` asked a failing job to try again
    timeline_json: str | None = None  # the phases reached (orchestrator/timeline.py)
    nodes: list[NodeRecord] = field(default_factory=list)
    ranks: list[RankRecord] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)
    steps: list[AttemptSteps] = field(default_factory=list)  # by attempt
    rates: dict[int, float] = field(default_factory=dict)  # attempt -> its slowest steps/s
    totals: dict[int, int] = field(default_factory=dict)  # attempt -> total_steps its ranks said


def per_attempt(spans: list[StepSpan]) -> list[AttemptSteps]:
    """Ranks' spans summed up by attempt (the store keeps them so: AttemptSteps)."""
    by_attempt: dict[int, list[StepSpan]] = {}
    for s in spans:
        by_attempt.setdefault(s.attempt, []).append(s)
    out = []
    for attempt, its in sorted(by_attempt.items()):
        rates = [(s.last_step - s.first_step) / (s.last_at - s.first_at) for s in its
                 if s.last_step > s.first_step and s.last_at > s.first_at]
        out.append(AttemptSteps(attempt, len(its), max(s.first_at for s in its),
                                min(s.first_step for s in its),
                                max(s.last_step for s in its), min(rates) if rates else None))
    return out
