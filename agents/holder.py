"""The holder (Slurm): each node's agent lives in a step of its own.

Under ProctrackType=proctrack/cgroup, Slurm kills every process of a job step when the step
ends, daemon or not: an agent started by a relay's step would die with its channel (a
dropped connection, a replaced controller). So, on Slurm, each node runs a *holder*: a step
of its own (kept open by the controller, outliving it) that starts the node's agent when a
relay asks, so that the agent lives in the holder's step. The holder leaves once its
controller has gone (its stdin closed) and no agent it started answers any more; a second
holder on the node (a new controller's) waits on standby until the first leaves.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from agents import commands as C
from agents import protocol as P
from agents.daemon import start_agent
from agents.paths import Lock, agent_paths, bind_unix, connect_unix, holder_path
from agents.processes import pidfd


def start_agent_by_holder(job_id: str, node_index: int, config: C.Launch) -> None:
    """Ask this node's holder to start the agent (a relay's request, on Slurm)."""
    sock = connect_unix(holder_path(job_id))
    if sock is None:
        raise RuntimeError("no holder step of the job on this node (Slurm)")
    with sock, sock.makefile("rwb") as f:
        f.write(P.encode(C.wire(C.HolderStart(node_index, config))))
        f.flush()
        reply = C.parse_holder_started(P.decode(f.readline(P.MAX_MESSAGE)))
    if not reply.ok:
        raise RuntimeError(f"the holder could not start the agent: {reply.error}")


NOTICES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # what a --signal would send


def holder_main(job_id: str, say: Any) -> int:
    path = holder_path(job_id)
    started: set[int] = set()
    agents: dict[int, tuple[int, int | None]] = {}  # node index -> its agent's pid, pidfd
    controller = threading.Event()  # set once our stdin (the controller's end) closes
    # Slurm signals a step's task, this holder, when it preempts the job (GraceTime) or a
    # --signal time comes (SIGUSR1 unless it names another; Lightning's recipe): a notice
    # for the agents it started (a SIGTERM to them), which move the job off the node at a
    # saved step within stop_grace_period (agents/agent.py). The holder stays: if it left,
    # Slurm would kill every process of its step at once, the agents' included.
    inherited: dict[int, Any] = {
        sig: signal.signal(sig, lambda *_: _forward(agents, signal.SIGTERM)) for sig in NOTICES}

    def watch() -> None:
        try:
            while os.read(0, 65536):
                pass
        except (OSError, ValueError):
            pass
        controller.set()

    threading.Thread(target=watch, daemon=True).start()
    server: socket.socket | None = None
    said = False
    while True:
        if server is None:
            with Lock(path + ".lock"):
                other = connect_unix(path)
                if other is None:
                    try:
                        os.unlink(path)  # a dead holder's
                    except FileNotFoundError:
                        pass
                    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    bind_unix(server, path)
                    server.listen(16)
                    server.settimeout(1.0)
                else:
                    other.close()
            if not said:
                say({"type": P.HOLDING, "standby": server is None})
                said = True
        if server is None:
            time.sleep(1.0)
        else:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                _serve_start(conn, job_id, started, agents, inherited)
        if controller.is_set() and (server is not None or not started) and \
                not any(_agent_answers(job_id, index) for index in started):
            if server is not None:
                with Lock(path + ".lock") as lock:  # a standby holder may take over after
                    server.close()
                    os.unlink(path)
                    lock.remove()  # one empty file per node and job, never read again
            return 0


def _agent_answers(job_id: str, node_index: int) -> bool:
    probe = connect_unix(os.path.join(agent_paths(job_id, node_index)[0], "agent.sock"))
    if probe is None:
        return False
    probe.close()
    return True


def _forward(agents: dict[int, tuple[int, int | None]], signum: int) -> None:
    for pid, fd in list(agents.values()):
        try:  # through its pidfd: never another process that took a dead agent's pid
            if fd is not None:
                signal.pidfd_send_signal(fd, signum)
            else:
                os.kill(pid, signum)
        except OSError:
            pass  # gone already


def _serve_start(conn: socket.socket, job_id: str, started: set[int],
                 agents: dict[int, tuple[int, int | None]],
                 inherited: Mapping[int, Any]) -> None:
    conn.settimeout(30.0)
    with conn, conn.makefile("rwb") as f:
        try:
            request = C.parse_holder_start(P.decode(f.readline(P.MAX_MESSAGE)))
            directory, outcome = agent_paths(job_id, request.node_index)
            pid = start_agent(directory, outcome, request.launch, inherited)
            _, earlier = agents.pop(request.node_index, (0, None))
            if earlier is not None:
                os.close(earlier)
            agents[request.node_index] = (pid, pidfd(pid))
            started.add(request.node_index)
            reply = C.HolderStarted(True)
        except Exception as exc:  # said to the relay, which tells the controller
            reply = C.HolderStarted(False, str(exc))
        try:
            f.write(P.encode(C.holder_started(reply)))
            f.flush()
        except OSError:
            pass
