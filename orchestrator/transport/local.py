"""LocalConnection: the agent as a subprocess of the controller, for ``host: local``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from orchestrator.errors import AgentError
from orchestrator.transport.base import AGENT_SOURCE_PATH, JsonLines


class LocalConnection:
    """Runs the node agent on this machine; its stderr goes to ``agent_log``."""

    def __init__(self, host: str = "local", agent_log: Path | None = None):
        self.host = host
        self._agent_log = agent_log
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: JsonLines | None = None

    def open(self) -> None:
        log: Any = open(self._agent_log, "ab") if self._agent_log else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", str(AGENT_SOURCE_PATH)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the controller only
            )
        except OSError as exc:
            raise AgentError(self.host, f"cannot start agent: {exc}") from exc
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._lines = JsonLines(self.host, self._proc.stdout, self._proc.stdin)

    def send(self, message: dict[str, Any]) -> None:
        if self._lines is None:
            raise AgentError(self.host, "not open")
        self._lines.send(message)

    def receive(self) -> dict[str, Any] | None:
        return self._lines.receive() if self._lines else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def close(self) -> None:
        proc = self._proc
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
