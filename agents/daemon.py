"""Starting the job's agent as a daemon on this node: its own session, stdio on /dev/null,
its log beside its state, so that it outlives every channel (and, on Slurm, lives in the
holder's step). Called by the relay (agents/relay.py) and the holder (agents/holder.py)."""

from __future__ import annotations

import os
import shutil
import signal
import traceback
from collections.abc import Mapping
from typing import Any

from agents import commands as C


def start_agent(directory: str, outcome: str, config: C.Launch,
                inherited: Mapping[int, Any] | None = None) -> int:
    """Start the agent as a daemon; return its pid once its socket listens. ``inherited``:
    the signal dispositions the caller had before it handled them itself (the agent's
    workers inherit what it inherited: an ignored USR2 stays ignored, as under torchrun)."""
    shutil.rmtree(directory, ignore_errors=True)  # a dead agent's leftovers
    try:
        os.unlink(outcome)
    except FileNotFoundError:
        pass
    os.mkdir(directory, 0o700)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: detach twice, so the agent is nobody's child and no session's
        try:
            os.close(ready_r)
            os.setsid()
            for sig, how in (inherited or {}).items():
                if how is not None:  # None: a handler not from Python, nothing to restore
                    signal.signal(sig, how)
            if os.fork() != 0:
                os._exit(0)
            os.closerange(3, ready_w)
            os.closerange(ready_w + 1, 65536)
            devnull = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(directory, "agent.log"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            os.dup2(log, 2)
            code = 1
            try:
                from agents.agent import Agent

                agent = Agent(directory, outcome, config)
                agent.listen()
                os.write(ready_w, b"ok %d" % os.getpid())
                os.close(ready_w)
                code = agent.run()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        except BaseException:
            os._exit(1)
    os.close(ready_w)
    os.waitpid(pid, 0)
    with os.fdopen(ready_r, "rb") as ready:
        said = ready.read(32).split()
        if said[:1] != [b"ok"]:
            tail = ""
            try:
                with open(os.path.join(directory, "agent.log"), encoding="utf-8",
                          errors="replace") as f:
                    tail = " | ".join(f.read()[-2000:].strip().splitlines()[-3:])
            except OSError:
                pass
            raise RuntimeError(f"the agent did not start: {tail or 'no error given'}")
    return int(said[1])
