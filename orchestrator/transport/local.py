"""LocalConnection: the agent as a subprocess of the controller, for ``host: local``."""

from __future__ import annotations

import subprocess
import sys

from orchestrator.errors import AgentError
from orchestrator.transport.base import AGENT_SOURCE_PATH, JsonLines, LineConnection


class LocalConnection(LineConnection):
    """Runs the node agent on this machine. Its stderr is the controller's (controller.log)."""

    def __init__(self, host: str = "local"):
        self.host = host
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: JsonLines | None = None

    def open(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", str(AGENT_SOURCE_PATH)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C at a terminal must not reach the workers
            )
        except OSError as exc:
            raise AgentError(self.host, f"cannot start agent: {exc}") from exc
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._lines = JsonLines(self.host, self._proc.stdout, self._proc.stdin)

    def close(self) -> None:
        proc, self._lines = self._proc, None
        if proc is None:
            return
        if proc.stdin:
            try:
                proc.stdin.close()  # EOF: the agent stops its workers and exits
            except OSError:
                pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
