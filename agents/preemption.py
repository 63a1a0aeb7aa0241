"""A cloud's preemption notice, asked on the node (``health.preemption_check``).

The user's script (a spot instance's metadata service, read with curl) runs every
``preemption_check_interval`` seconds while the node has workers or a controller (a hot spare
too: one the job moved onto would go away with the rest of a reclaim): exit 0 means that the node
is to go, and the first line of its output, where it is a number of seconds or an ISO 8601
time (AWS's ``spot/instance-action`` gives ``"time": "2026-11-26T17:00:00Z"``), says when.
The agent then has a notice, as from a SIGTERM (agents/agent.py): its heartbeats carry it,
and the controller moves the job off the node at a step every rank saves
(orchestrator/drain.py). Without a time, the notice leaves the job's stop_grace_period.

The script runs as ``/bin/sh <file>`` from a 0600 file in the agent's private directory
(never on a command line: it may hold a token), in the agent's environment and directory,
stdin /dev/null, in a process group of its own that is stopped past the interval (the
runner of setup and node checks, agents/setup.py).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Any

from agents import protocol as P
from agents.processes import TOKEN_VAR
from agents.setup import run_command
from agents.workers import running

MAX_LINE = 4096  # bytes of a line of the script's output
MAX_AHEAD = 86400.0  # a deadline further away than this is taken as this


def watch(agent: Any, script: str, interval: float) -> None:
    """Run on a thread of its own for the agent's life: sets ``agent.notice`` once the
    script says so (and never clears one)."""
    path = os.path.join(agent.directory, "preemption-check.sh")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(script)
    while not agent.outbox.closed:
        time.sleep(interval)
        if agent.notice is not None or not (running(agent.workers) or
                                            agent.outbox.current() is not None):
            continue
        said = ask(path, interval, agent.token)
        if said is not None and agent.notice is None:
            agent.notice = P.Notice(("preemption_check: " + said)[:200] if said else
                                    "preemption_check", deadline(said, agent.stop_grace))


def ask(path: str, timeout: float, token: str) -> str | None:
    """The first line the script printed (of its last TAIL) when it exited 0 (a notice is
    pending), else None (nonzero, past ``timeout``, or it could not run)."""
    result = run_command(["/bin/sh", path], ".", {**os.environ, TOKEN_VAR: token},
                         lambda _: None, MAX_LINE, max(timeout, 1.0))
    if result.exit_code != 0 or result.timed_out:
        return None
    return result.tail[0].strip() if result.tail else ""


def deadline(said: str, grace: float, now: float | None = None) -> float:
    """When the node goes (a Unix time): ``said`` as seconds from now or an ISO 8601 time
    (without a zone: UTC), else ``grace`` seconds from now; never past MAX_AHEAD."""
    now = time.time() if now is None else now
    when = now + grace
    word = said.strip().strip('"')
    try:
        when = now + float(word)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(word.replace("Z", "+00:00"))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=timezone.utc)
            when = parsed.timestamp()
        except ValueError:
            pass
    return min(max(when, now), now + MAX_AHEAD) if when == when else now + grace
