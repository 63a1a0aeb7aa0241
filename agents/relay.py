"""The relay: what a channel runs (a local pipe, an SSH exec channel, a Slurm step).

It reads ``connect``, attaches to the job's agent through its Unix socket, starting the
agent first when asked to (a daemon: its own session, stdio on /dev/null, so that it
outlives every channel: agents/daemon.py), and then copies bytes both ways until either side
closes. On Slurm the agent is started by the node's holder step instead (agents/holder.py).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, BinaryIO

from agents import commands as C
from agents import protocol as P
from agents.daemon import start_agent
from agents.paths import Lock, agent_paths, alive_path, connect_unix, is_locked


def relay_main() -> int:
    """Join this process's stdin/stdout (the channel) to the job's agent socket."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def say(message: dict[str, Any]) -> None:
        stdout.write(P.encode(message))
        stdout.flush()

    try:
        first, _ = C.parse(P.decode(stdin.readline(P.MAX_MESSAGE)) or {},
                           {C.Connect.OP: C.Connect, C.Hold.OP: C.Hold})
    except P.ProtocolError:
        say({"type": P.ERROR, "message": "expected connect"})
        return 2
    if isinstance(first, C.Hold):
        from agents.holder import holder_main

        return holder_main(first.job_id, say)
    assert isinstance(first, C.Connect)
    try:
        index, job_id, launch = first.node_index, first.job_id, first.launch
        directory, outcome = agent_paths(job_id, index)
        sock_path = os.path.join(directory, "agent.sock")
        sock = connect_unix(sock_path) or _listening_again(job_id, index, sock_path)
        launched = False
        if sock is None and launch is not None:
            with Lock(directory + ".lock"):
                sock = connect_unix(sock_path)  # another relay may have started it meanwhile
                if sock is None:
                    if launch.holder:  # Slurm: the agent belongs to the holder's step
                        from agents.holder import start_agent_by_holder

                        start_agent_by_holder(job_id, index, launch)
                    else:
                        start_agent(directory, outcome, launch)
                    sock = connect_unix(sock_path)
                    launched = True
        if sock is None:
            gone: dict[str, Any] = {"type": P.GONE}
            try:
                with open(outcome, encoding="utf-8") as f:
                    gone["outcome"] = json.loads(f.read(65536))
            except (OSError, ValueError):
                pass
            say(gone)
            if "outcome" in gone:  # told once: nothing of the job is left on the node
                os.unlink(outcome)
            return 0
    except Exception as exc:  # reported on the channel: the controller names the node
        say({"type": P.ERROR, "message": f"relay: {exc}"})
        return 2
    say({"type": P.RELAY, "launched": launched})
    _pump(sock, stdin, stdout)
    return 0


def _listening_again(job_id: str, index: int, sock_path: str) -> socket.socket | None:
    """The agent's socket when the agent lives though its socket was gone a moment ago (its
    runtime directory was removed under it: it listens again within a second); None when
    no agent of the job lives here."""
    deadline = time.monotonic() + 5.0
    while is_locked(alive_path(job_id, index)):
        sock = connect_unix(sock_path)
        if sock is not None:
            return sock
        if time.monotonic() > deadline:
            raise RuntimeError("the job's agent lives on this node but does not listen at "
                               f"{sock_path}")
        time.sleep(0.05)
    return None


def _pump(sock: socket.socket, stdin: BinaryIO, stdout: BinaryIO) -> None:
    def upstream() -> None:  # controller -> agent
        try:
            while data := stdin.read1(65536):  # type: ignore[attr-defined]
                sock.sendall(data)
        except (OSError, ValueError):
            pass
        os._exit(0)  # the channel closed: the agent sees its connection end

    threading.Thread(target=upstream, daemon=True).start()
    try:
        while data := sock.recv(65536):
            stdout.write(data)
            stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(0)
