"""The NodeConnection protocol: how the controller reaches one node's agent.

A connection starts the agent on its node and carries JSON-line messages both ways. The
controller receives a factory and never knows whether a node is a local subprocess or an
SSH session; tests can pass their own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

import agents.node_agent
from orchestrator.errors import AgentError
from orchestrator.spec import JobSpec, NodeSpec

MAX_MESSAGE = 1024 * 1024  # an agent's line is bounded (output lines are cut at 8 KiB)

AGENT_SOURCE_PATH = Path(agents.node_agent.__file__)


class NodeConnection(Protocol):
    """One node's agent session."""

    host: str

    def open(self) -> None:
        """Start the agent (raises a TransportError naming the host)."""

    def send(self, message: dict[str, Any]) -> None:
        """Send one command; raises AgentError if the channel is gone."""

    def receive(self) -> dict[str, Any] | None:
        """Block for the agent's next message; None once the channel is closed."""

    def close(self) -> None:
        """Close the channel (the agent then stops its workers) and release resources."""


ConnectionFactory = Callable[[NodeSpec, JobSpec], NodeConnection]


class JsonLines:
    """JSON-lines framing over a pair of byte streams, shared by the real transports."""

    def __init__(self, host: str, reader: IO[bytes], writer: IO[bytes]):
        self.host = host
        self._reader = reader
        self._writer = writer
        self._write_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        with self._write_lock:
            try:
                self._writer.write(data)
                self._writer.flush()
            except (OSError, ValueError) as exc:
                raise AgentError(self.host, f"agent channel closed: {exc}") from exc

    def receive(self) -> dict[str, Any] | None:
        while True:
            try:
                raw = self._reader.readline(MAX_MESSAGE)
            except (OSError, ValueError):
                return None
            if not raw:
                return None
            try:
                message = json.loads(raw)
            except ValueError:
                # Not ours (e.g. a login banner on stdout): skip it rather than fail the node.
                continue
            if isinstance(message, dict):
                return message


class LineConnection:
    """send() and receive() over the JsonLines that a transport's open() sets up."""

    host: str
    _lines: JsonLines | None = None

    def send(self, message: dict[str, Any]) -> None:
        if self._lines is None:
            raise AgentError(self.host, "not open")
        self._lines.send(message)

    def receive(self) -> dict[str, Any] | None:
        return self._lines.receive() if self._lines else None


def agent_source() -> bytes:
    """The agent program, as shipped to nodes."""
    return AGENT_SOURCE_PATH.read_bytes()
