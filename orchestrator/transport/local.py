"""LocalConnection: the channel to an agent on this machine, for ``host: local``.

The relay (and so the agent it starts, and the workers) runs in the submitter's world
(environment, umask and resource limits, see orchestrator/world.py), not in the
controller's.
"""

from __future__ import annotations

import subprocess
import sys

from orchestrator.errors import AgentError
from orchestrator.transport.base import (
    AGENT_PYTHON_FLAGS,
    BOOTSTRAP,
    Framer,
    PipeConnection,
    agent_payload,
    end_relay_process,
)
from orchestrator.world import UserWorld


class LocalConnection(PipeConnection):
    """Runs the relay as a subprocess; its stderr is the controller's (controller.log).
    ``world`` None: this process's own environment, umask and limits."""

    def __init__(self, host: str = "local", world: UserWorld | None = None):
        self.host = host
        self._world = world
        self.framer = Framer()

    def open(self) -> None:
        world = self._world
        try:
            proc = subprocess.Popen(
                [sys.executable, *AGENT_PYTHON_FLAGS, "-c", BOOTSTRAP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C at a terminal must not reach it
                env=dict(world.env) if world is not None else None,
                umask=world.umask if world is not None else -1,
                preexec_fn=world.restore_limits() if world is not None else None,
            )
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(agent_payload())
            proc.stdin.flush()
        except OSError as exc:
            raise AgentError(self.host, f"cannot start the agent's relay: {exc}") from exc
        self._attach_pipes(proc)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_relay_process(proc, timeout=5)
