"""SlurmConnection: the channel to a node's agent through a Slurm job step.

``srun --jobid=J --overlap --nodes=1 --ntasks=1 -w NODE PYTHON -u -c BOOTSTRAP`` runs the
agent's relay on one node of allocation J; the step's stdin and stdout are the channel, as an
SSH exec channel is for ``ssh.py``: the agent's source travels over it ahead of the JSON
lines, and no secret or environment value is ever on the command line (only the
interpreter and the bootstrap). ``--overlap`` lets the step share the node's CPUs with the
workers of the job and with other channels. Closing the channel ends the step; the agent,
a daemon of its own, lives on.

srun's own stderr (Slurm's errors, the relay's traceback) is kept, the last lines of it
explaining a failed start.
"""

from __future__ import annotations

import subprocess
import threading
from collections import deque

from orchestrator.errors import AgentError
from orchestrator.slurm import slurm_env
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import (
    BOOTSTRAP,
    JsonLines,
    LineConnection,
    agent_payload,
    end_relay_process,
)


def srun_argv(job_id: str, node: str, python: str) -> list[str]:
    """The step that runs one node's relay (argv: nothing here passes through a shell)."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", "-w", node,
            "--job-name=orchestrator-agent", "--quiet", python, "-u", "-c", BOOTSTRAP]


class SlurmConnection(LineConnection):
    """One node's agent through an ``srun --overlap`` step of the job's allocation."""

    def __init__(self, job_id: str, node: str, python: str):
        self.host = node
        self._argv = srun_argv(job_id, node, python)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: JsonLines | None = None
        self.stderr_tail: deque[str] = deque(maxlen=20)

    def open(self) -> None:
        try:
            self._proc = subprocess.Popen(
                self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=slurm_env(),
                start_new_session=True,  # a Ctrl-C at a terminal must not reach srun
            )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            threading.Thread(target=self._drain_stderr, args=(self._proc,), daemon=True).start()
            self._proc.stdin.write(agent_payload())
            self._proc.stdin.flush()
        except OSError as exc:
            self.close()
            raise AgentError(self.host, f"cannot start the agent's step with srun: {exc}"
                             ) from exc
        self._lines = JsonLines(self.host, self._proc.stdout, self._proc.stdin)

    def _drain_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in iter(lambda: proc.stderr.readline(4096), b""):  # type: ignore[union-attr]
            self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip())

    def close(self) -> None:
        proc, self._lines = self._proc, None
        self._proc = None
        if proc is None:
            return
        end_relay_process(proc, timeout=10)


class SlurmConnector:
    """The connection factory for a job on allocation ``job_id`` (node specs carry the
    Slurm node names)."""

    def __init__(self, job_id: str):
        self.job_id = job_id

    def __call__(self, node: NodeSpec, spec: JobSpec) -> SlurmConnection:
        return SlurmConnection(self.job_id, node.hostname, spec.python)
