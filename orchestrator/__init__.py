"""Elastic cluster job orchestrator for PyTorch distributed training.

The public API, used by the ``orchestrator`` command and by scripts::

    import orchestrator
    job_id = orchestrator.submit("jobspecs/local-ddp.yaml")
    result = orchestrator.wait(job_id)          # the status dict, once terminal
    for line in orchestrator.logs(job_id, rank=0):
        print(line)
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# The names are imported when first used (PEP 562): ``python -m orchestrator submit`` forks
# its job's supervisor before it imports the API (orchestrator/entry.py), and a script that
# imports one submodule does not pay for all of them.
_WHERE = {
    "AgentError": "orchestrator.errors",
    "AttemptOutcome": "orchestrator.state",
    "AuthenticationError": "orchestrator.errors",
    "ConnectError": "orchestrator.errors",
    "FailureCause": "orchestrator.state",
    "HostKeyError": "orchestrator.errors",
    "JobEndedError": "orchestrator.errors",
    "JobNotFoundError": "orchestrator.errors",
    "JobSpec": "orchestrator.spec",
    "JobState": "orchestrator.state",
    "LaunchError": "orchestrator.errors",
    "NodeState": "orchestrator.state",
    "OrchestratorError": "orchestrator.errors",
    "RankState": "orchestrator.state",
    "SpecError": "orchestrator.errors",
    "StoreError": "orchestrator.errors",
    "TransportError": "orchestrator.errors",
    "cancel": "orchestrator.api",
    "check": "orchestrator.api",
    "drain_node": "orchestrator.api",
    "drains": "orchestrator.api",
    "dry_run": "orchestrator.api",
    "heartbeat": "orchestrator.heartbeat",
    "list_jobs": "orchestrator.api",
    "load_jobspec": "orchestrator.spec",
    "logs": "orchestrator.api",
    "nodes": "orchestrator.api",
    "prune": "orchestrator.api",
    "quarantine_policy": "orchestrator.api",
    "release_node": "orchestrator.api",
    "resume": "orchestrator.api",
    "retention_policy": "orchestrator.api",
    "stacks": "orchestrator.api",
    "status": "orchestrator.api",
    "submit": "orchestrator.api",
    "undrain_node": "orchestrator.api",
    "wait": "orchestrator.api",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
