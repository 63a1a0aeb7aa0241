"""Elastic cluster job orchestrator for PyTorch distributed training.

The public API, used by the ``orchestrator`` command and by scripts::

    import orchestrator
    job_id = orchestrator.submit("jobspecs/local-ddp.yaml")
    result = orchestrator.wait(job_id)          # the status dict, once terminal
    for line in orchestrator.logs(job_id, rank=0):
        print(line)
"""

from orchestrator.api import (
    cancel,
    check,
    drain_node,
    drains,
    dry_run,
    list_jobs,
    logs,
    nodes,
    prune,
    quarantine_policy,
    release_node,
    resume,
    retention_policy,
    stacks,
    status,
    submit,
    undrain_node,
    wait,
)
from orchestrator.errors import (
    AgentError,
    AuthenticationError,
    ConnectError,
    HostKeyError,
    JobEndedError,
    JobNotFoundError,
    LaunchError,
    OrchestratorError,
    SpecError,
    StoreError,
    TransportError,
)
from orchestrator.heartbeat import heartbeat
from orchestrator.spec import JobSpec, load_jobspec
from orchestrator.state import AttemptOutcome, FailureCause, JobState, NodeState, RankState

__all__ = [
    "AgentError",
    "AttemptOutcome",
    "AuthenticationError",
    "ConnectError",
    "FailureCause",
    "HostKeyError",
    "JobEndedError",
    "JobNotFoundError",
    "JobSpec",
    "JobState",
    "LaunchError",
    "NodeState",
    "OrchestratorError",
    "RankState",
    "SpecError",
    "StoreError",
    "TransportError",
    "cancel",
    "check",
    "drain_node",
    "drains",
    "dry_run",
    "heartbeat",
    "list_jobs",
    "nodes",
    "prune",
    "quarantine_policy",
    "release_node",
    "load_jobspec",
    "logs",
    "resume",
    "retention_policy",
    "stacks",
    "status",
    "submit",
    "undrain_node",
    "wait",
]
