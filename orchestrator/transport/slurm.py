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
from collections.abc import Callable
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator.errors import AgentError
from orchestrator.slurm import slurm_env
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import (
    AGENT_PYTHON_FLAGS,
    BOOTSTRAP,
    Framer,
    PipeConnection,
    agent_payload,
    end_relay_process,
)
from orchestrator.world import UserWorld

HOLDER_TIMEOUT = 60.0  # seconds for a node's holder step to start and say it holds


def srun_argv(job_id: str, node: str, python: str, name: str = "orchestrator-agent"
              ) -> list[str]:
    """The step that runs one node's relay (argv: nothing here passes through a shell)."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", "-w", node,
            f"--job-name={name}", python, *AGENT_PYTHON_FLAGS, "-c", BOOTSTRAP]


def _srun(argv: list[str], world: UserWorld | None, *, merge_stderr: bool = False
          ) -> subprocess.Popen[bytes]:
    """srun, in the submitter's world: a step's tasks get srun's environment (--export=ALL),
    umask and soft limits (PropagateResourceLimits), as under ``srun torchrun`` typed in that
    shell; never the controller's."""
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        env=slurm_env(world.env if world is not None else None),
        umask=world.umask if world is not None else -1,
        preexec_fn=world.restore_limits() if world is not None else None,
        start_new_session=True)  # a Ctrl-C at a terminal must not reach srun


def _keep_tail(proc: subprocess.Popen[bytes], tail: deque[str]) -> None:
    """srun's stderr (Slurm's errors, a traceback), its last lines kept to explain a failure."""
    assert proc.stderr is not None
    for raw in iter(lambda: proc.stderr.readline(4096), b""):  # type: ignore[union-attr]
        tail.append(raw.decode("utf-8", "replace").rstrip())


class Holder:
    """A node's holder step (``agents/holder.py``): the agent is started inside
    it, not inside the relay's step, so that Slurm's proctrack/cgroup, which kills a step's
    every process when the step ends, does not take the agent along with a channel. Its
    srun is in a session of its own and outlives this process: the holder stays while the
    agents it started live, for a replaced controller to find."""

    def __init__(self, job_id: str, node: str, python: str, orchestrator_job: str,
                 world: UserWorld | None = None):
        self.node = node
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.ready = threading.Event()
        self.reply: P.Message | None = None
        self.proc = _srun(srun_argv(job_id, node, python, "orchestrator-holder"), world)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        threading.Thread(target=_keep_tail, args=(self.proc, self.stderr_tail),
                         daemon=True).start()
        threading.Thread(target=self._read_reply, daemon=True).start()
        self.proc.stdin.write(agent_payload() + P.encode(C.wire(C.Hold(orchestrator_job))))
        self.proc.stdin.flush()  # and kept open: its end is the controller's end

    def _read_reply(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(lambda: self.proc.stdout.readline(4096), b""):  # type: ignore[union-attr]
            if self.reply is None:
                message = P.decode(raw)
                try:
                    self.reply = P.parse(message) if message is not None else None
                except P.ProtocolError:
                    self.reply = None
                self.ready.set()
        self.ready.set()  # it ended (before or after saying so)

    def wait_ready(self, timeout: float) -> None:
        if not self.ready.wait(timeout):
            raise AgentError(self.node, f"the holder step did not start within {timeout:g}s")
        if not isinstance(self.reply, P.Holding):
            tail = " | ".join(list(self.stderr_tail)[-3:])
            raise AgentError(self.node, "the holder step failed" + (f": {tail}" if tail else ""))

    def running(self) -> bool:
        return self.proc.poll() is None


class SlurmConnection(PipeConnection):
    """One node's agent through an ``srun --overlap`` step of the job's allocation; srun's
    own messages (Slurm's errors, the relay's traceback) come with the channel's output, and
    the framer keeps them as its noise."""

    def __init__(self, job_id: str, node: str, python: str,
                 holder: Callable[[str], None] | None = None, world: UserWorld | None = None):
        self.host = node
        self._argv = srun_argv(job_id, node, python)
        self._holder = holder
        self._world = world
        self.framer = Framer()

    def send(self, message: dict[str, Any]) -> None:
        via_holder = C.via_holder(message)
        if via_holder is not None and self._holder is not None:
            # An agent to start goes to the holder's step (see Holder).
            try:
                self._holder(C.job_of(message))
            except AgentError:
                self.close()  # the handshake fails here: nothing else ends our relay's step
                raise
            message = via_holder
        super().send(message)

    def open(self) -> None:
        try:
            proc = _srun(self._argv, self._world, merge_stderr=True)
            self._attach_pipes(proc)
            assert proc.stdin is not None
            proc.stdin.write(agent_payload())
            proc.stdin.flush()
        except OSError as exc:
            self.close()
            raise AgentError(self.host, f"cannot start the agent's step with srun: {exc}"
                             ) from exc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_relay_process(proc, timeout=10)


class SlurmConnector:
    """The connection factory for a job on allocation ``job_id`` (node specs carry the
    Slurm node names), and the keeper of each node's holder step."""

    def __init__(self, job_id: str, world: UserWorld | None = None):
        self.job_id = job_id
        self.world = world  # the submitter's: steps start in it (None: this process's)
        self._holders: dict[tuple[str, str], Holder] = {}  # (node, the orchestrator's job)
        self._lock = threading.Lock()

    def __call__(self, node: NodeSpec, spec: JobSpec) -> SlurmConnection:
        name, python = node.hostname, spec.python
        return SlurmConnection(self.job_id, name, python,
                               holder=lambda job: self.ensure_holder(name, python, job),
                               world=self.world)

    def ensure_holder(self, node: str, python: str, job: str) -> None:
        """Start the node's holder step for ``job`` (the orchestrator's) unless ours runs:
        one per node and job in this process."""
        with self._lock:
            holder = self._holders.get((node, job))
            if holder is None or not holder.running():
                try:
                    holder = self._holders[(node, job)] = Holder(self.job_id, node, python,
                                                                 job, self.world)
                except OSError as exc:
                    raise AgentError(node, f"cannot start the holder step with srun: {exc}"
                                     ) from exc
        holder.wait_ready(HOLDER_TIMEOUT)
