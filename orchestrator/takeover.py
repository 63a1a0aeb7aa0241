"""Taking over a job whose controller died: what the store says of it, the open attempt as
its last checkpoint left it, and the reattach to every agent that may be alive.

Called by the controller (``Controller._resume``), which owns the counts this returns; the
engine's state changes only through its methods. Nothing here launches an agent: a resumed
controller first finds out which agents kept their workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.attempt import Attempt, Failure
from orchestrator.checkpoints import settings
from orchestrator.engine import Engine
from orchestrator.logfiles import LogSink
from orchestrator.participants import Placed
from orchestrator.plan import plan_attempt
from orchestrator.records import JobRecord
from orchestrator.state import FailureCause, JobState, NodeState

log = logging.getLogger("orchestrator.controller")

#: Builds an attempt's log sink: (ranks, log sizes, sink state) -> the sink.
SinkFactory = Callable[[int, "dict[str, int] | None", "dict[str, Any] | None"], LogSink]


@dataclass(frozen=True)
class Counts:
    """Where the job's restart budget stood when the last controller left it."""

    attempt: int
    restarts: int
    free_restarts: int
    infra_restarts: int
    previous_failure: Failure | None  # the last ended attempt's, for stop_on_repeat
    placed: Placed | None  # who ran that attempt: who runs the next depends on it
    # The job's end the last controller decided on with that attempt's end, and its fields,
    # where it died before writing it (in the job's state it decided in: not one resumed
    # since): the job ends so. It was run again, attempt N+1 of a job that had SUCCEEDED.
    ending: tuple[JobState, dict[str, Any]] | None = None


def counts(engine: Engine, job: JobRecord) -> Counts:
    ended = [a for a in job.attempts if a.ended_at is not None]
    last = job.attempts[-1] if job.attempts else None
    after = last.next if last is not None and last.ended_at is not None else None
    ending = None
    if after and "state" in after and after.get("from") == job.state.value:
        ending = (JobState(after["state"]),
                  {k: v for k, v in after.items() if k not in ("state", "from")})
    previous, placed = None, None
    if ended and ended[-1].failure:
        previous = Failure.from_dict(ended[-1].failure)
        where = (engine.store.checkpoint_of(engine.job_id, ended[-1].attempt) or {}).get(
            "participants")
        if where:
            placed = Placed([int(i) for i in where], previous)
    return Counts(job.attempt, job.restarts, job.free_restarts, job.infra_restarts, previous,
                  placed, ending)


def open_attempt(engine: Engine, job: JobRecord, spec_dir: str, sink: SinkFactory,
                 ended: bool = False) -> Attempt | None:
    """The attempt that was running, as its last checkpoint left it (None: none was); with
    ``ended``, the last attempt where it had ended (its late lines still land: an agent cut
    off while it was stopped replays them later, often the traceback that explains its
    failure, and they were taken and written nowhere, uncounted)."""
    last = job.attempts[-1] if job.attempts else None
    record = last if last is not None and (last.ended_at is not None) == ended else None
    cp = engine.store.checkpoint_of(engine.job_id, record.attempt) if record else None
    if record is None or not cp:
        return None
    spec = engine.spec
    nprocs = {int(k): v for k, v in cp.get("nprocs", {}).items()}
    plan = plan_attempt(spec, engine.job_id, attempt=record.attempt,
                        restart_count=record.attempt - 1, master_port=cp.get("master_port"),
                        node_indices=list(cp["participants"]), spec_dir=spec_dir,
                        sync_tree=engine.preparer.tree().tree if spec.sync else None,
                        nprocs=nprocs)
    attempt = Attempt(plan, sink(plan.world_size, cp["logs"], cp.get("log_state")),
                      engine.hosts, engine.store, engine.job_id, nprocs,
                      settings(spec, record.restored_step))  # what its ranks resume
    attempt.restore(cp, {  # each rank's first step stays its first
        r.rank: (r.first_step, r.first_step_at) for r in job.ranks
        if r.attempt == record.attempt and r.first_step is not None
        and r.first_step_at is not None})
    if ended:
        attempt.end()
    return attempt


def reattach(engine: Engine) -> None:
    """Reattach to every agent that may be alive, launching none, and wait for the
    outcomes (up to launch_timeout)."""
    nodes = engine.nodes
    for node in nodes:
        if node.state not in (NodeState.PENDING, NodeState.FAILED, NodeState.DONE):
            engine.pool.connect(node, launch=False)
    engine.wait(lambda: not any(n.connecting for n in nodes), engine.spec.launch_timeout)


def lost_participant(engine: Engine, attempt: Attempt) -> Failure | None:
    """The open attempt's failure when one of its nodes did not keep its workers while no
    controller was there (restarted, not charged)."""
    gone = [engine.nodes[i] for i in attempt.participants
            if engine.nodes[i].state in (NodeState.LOST, NodeState.FAILED, NodeState.DONE)]
    if not gone:
        return None
    node = gone[0]
    return Failure(
        FailureCause.CONTROLLER_LOST,
        f"the job's controller was gone and the agent on {node.host} "
        f"{node.info.gone_reason or 'is gone'}; restarting (not charged to "
        "max_restarts)", node_index=node.index, node_rank=node.node_rank, host=node.host)
