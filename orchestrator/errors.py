"""The orchestrator's exceptions, one tree, caught by the CLI and mapped to exit codes.

    OrchestratorError                 anything this package raises on purpose
    ├── SpecError                     the job spec is invalid (exit 2); names the field path
    ├── JobNotFoundError              no job with that id (exit 2)
    ├── JobEndedError                 the job already ended: nothing to resume (exit 2)
    ├── TransportError                a node could not be reached or used; names the host
    │   ├── ConnectError              refused, unreachable, timed out
    │   ├── AuthenticationError       the node refused our credentials
    │   ├── HostKeyError              the host key cannot be trusted
    │   │   ├── HostKeyUnknown        not in known_hosts (and not accepted as new)
    │   │   └── HostKeyChanged        different from the one known_hosts holds
    │   └── AgentError                the agent did not start or broke the protocol
    │       (and, in orchestrator/transport/base.py: AgentGone, WrongVersion, ProtocolViolation)
    ├── LaunchError                   the job could not be started (e.g. preflight failed)
    │   └── AllocationRefused         salloc refused the allocation request (Slurm)
    └── StoreError                    $ORCHESTRATOR_HOME or its database cannot be used
        └── StoreUnwritable           nothing can be written there now (a full disk, a
                                      read-only or vanished home): the controller pauses

Third-party exceptions (paramiko, socket, sqlite) are caught at the module that talks to
them and re-raised as one of these with context and ``from exc``.
"""

from __future__ import annotations

from typing import Any


class OrchestratorError(Exception):
    """Base class of every error the orchestrator raises on purpose."""


class SpecError(OrchestratorError):
    """A job spec is invalid. ``field`` is a dotted path such as ``nodes[1].host``."""

    def __init__(self, field: str, message: str, value: Any = None, *, has_value: bool = False):
        self.field = field
        self.message = message
        self.value = value
        self.has_value = has_value
        # Every problem the spec has, this one first (orchestrator/specwhere.py): a spec with
        # three errors says all three at once. ``str()`` is the first alone.
        self.problems: list[SpecError] = [self]
        self.loc: tuple[Any, ...] = ()  # the field's path as steps, where it is known
        self.kind = ""  # pydantic's error type, where it is one ("missing", ...)
        self.where = ""  # " (line 3, column 1)", " (from --set X=Y)": shown after str()
        where = f"{field}: " if field else ""
        shown = f" (got {value!r})" if has_value else ""
        super().__init__(f"{where}{message}{shown}")


class JobNotFoundError(OrchestratorError):
    """No job with this id exists in the store."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"no job {job_id!r}")


class JobEndedError(OrchestratorError):
    """The job is in a terminal state, so it cannot be resumed."""

    def __init__(self, job_id: str, state: str):
        self.job_id = job_id
        self.state = state
        super().__init__(f"job {job_id} already ended ({state}): nothing to resume")


class TransportError(OrchestratorError):
    """A node could not be reached or used. The host is always part of the message."""

    def __init__(self, host: str, message: str):
        self.host = host
        self.message = message
        super().__init__(f"{host}: {message}")


class ConnectError(TransportError):
    """The node was unreachable, refused the connection, or did not answer in time."""


class AuthenticationError(TransportError):
    """The node refused our credentials."""


class HostKeyError(TransportError):
    """The node's host key cannot be trusted (one of the two below)."""


class HostKeyUnknown(HostKeyError):
    """The node's host key is not in known_hosts."""


class HostKeyChanged(HostKeyError):
    """The node's host key differs from the one known_hosts holds for it."""


class AgentError(TransportError):
    """The node agent failed to start or spoke out of protocol."""


class LaunchError(OrchestratorError):
    """The job could not be started."""


class AllocationRefused(LaunchError):
    """salloc refused the allocation request for a reason that names no setting of the spec
    (those are SpecErrors: orchestrator/slurm.py, ``salloc_error``). Asked without the
    quarantined nodes, the request is made again with them."""


class StoreError(OrchestratorError):
    """The state directory or database cannot be opened or written."""


class StoreUnwritable(StoreError):
    """Nothing can be written under $ORCHESTRATOR_HOME now: its disk is full, or it is
    read-only or gone (an NFS server away). A pause, not a failure (orchestrator/pause.py):
    ``path`` is what could not be written, ``reason`` why."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cannot write {path}: {reason}")
