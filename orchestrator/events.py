"""What the controller's event loop hands to the controller, one frozen class each
(dispatched with ``match``): a channel's news, and what the node pool's and the preparer's
threads post. Replies to requests never appear here: they complete their request
(orchestrator/channel.py), and agents' heartbeats only stamp their channel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents import protocol as P
from orchestrator.channel import Channel


@dataclass(frozen=True)
class Attached:
    """A channel is ready: the agent said hello."""

    node: int
    channel: Channel


@dataclass(frozen=True)
class Unavailable:
    """No channel: ``gone`` when the relay found no agent (``reason``: why it gave up);
    ``refused`` when the agent is one we must not trust: "version" (another orchestrator's)
    or "protocol" (its hello was out of protocol)."""

    node: int
    error: str
    gone: bool = False
    reason: str | None = None
    refused: str | None = None
    cause: Exception | None = None  # what the connect raised (``check`` reports by its type)


@dataclass(frozen=True)
class Received:
    """A message of an attached channel (anything but a reply or a heartbeat)."""

    channel: Channel
    message: P.Message


@dataclass(frozen=True)
class Rejected:
    """A channel's agent said something out of protocol (``problem`` names the field)."""

    channel: Channel
    problem: str


@dataclass(frozen=True)
class Closed:
    """A channel ended."""

    channel: Channel


@dataclass(frozen=True)
class Prepared:
    """A node's sync and setup ended: ``failure`` None when it is ready; ``interrupted``
    when its channel dropped under it (prepared again once reattached)."""

    node: int
    failure: Any = None  # an attempt.Failure
    interrupted: bool = False


@dataclass(frozen=True)
class SyncProgress:
    node: int
    progress: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wake:
    """Nothing: look at the flags (a cancel, a signal)."""


Event = Attached | Unavailable | Received | Rejected | Closed | Prepared | SyncProgress | Wake
