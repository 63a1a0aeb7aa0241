"""Where is each rank? Stacks from every node, the ranks' flight recorder dumps, and the
one-line diagnosis (orchestrator/diagnosis.py): taken when ``health.hang_timeout`` fires
(``health.startup_timeout`` before an attempt's first line: ``silence_allowed``),
before anything is stopped (that is the why), or when a reader asks (``orchestrator
stacks``). The agents do the taking (agents/stacks.py); this module asks them all at once,
through the controller's requests, and fetches the dumps into the attempt's log directory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator.channel import Channel
from orchestrator.diagnosis import diagnose

#: The controller's request helper: (channels by key, request, timeout) -> replies by key.
AskAll = Callable[..., dict[Any, "P.Reply | None"]]

log = logging.getLogger("orchestrator.controller")

STACKS_TIMEOUT = 20.0  # seconds for every node's stacks (the agents use 5 s less)
FETCH_BUDGET = 20.0  # seconds for fetching flight recorder dumps, all of them
FETCH_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class Stacks:
    """Every live rank's stack (``found``: rank -> {host, method, text, error?, note?}), and
    where each rank's flight recorder dump lies on its node, or why its node did not take it
    (``refused``: rank -> "host: why", e.g. a FIFO or a symlink where the dump goes)."""

    found: dict[str, dict[str, Any]] = field(default_factory=dict)
    # rank -> (its node's channel, the node's host, the dump's path there)
    dumps: dict[str, tuple[Channel, str, str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def texts(self) -> dict[str, str]:
        return {r: s["text"] for r, s in self.found.items() if s.get("text")}

    @property
    def diagnosis(self) -> str | None:
        texts = self.texts
        return diagnose({int(r): t for r, t in texts.items()}) if texts else None


def silence_allowed(health: Any, heard: bool) -> tuple[float | None, str]:
    """How long an attempt's ranks may all be silent (None: for ever), and what says so.
    Before the attempt's first line or heartbeat (``heard``), ``health.startup_timeout`` where
    set: the program's start (imports, a model or a checkpoint loaded) is no hang."""
    if not heard and health.startup_timeout is not None:
        return health.startup_timeout, "since the attempt started (health.startup_timeout)"
    return health.hang_timeout, "(health.hang_timeout)"


def collect(channels: dict[int, Channel], hosts: dict[int, str], ask_all: AskAll, *,
            flight_recorder: bool, timeout: float = STACKS_TIMEOUT,
            owns: Callable[[int, int], bool] | None = None) -> Stacks:
    """Ask every node (``channels`` by node index) for its ranks' stacks, and with
    ``flight_recorder`` for their dumps too. ``owns(node, rank)``: may that node speak for
    that rank (the running attempt's answer)? A node's word about another's rank would
    forge the diagnosis: it is left out, and said in the log."""
    replies = ask_all(channels, C.GetStacks(timeout - 5, flight_recorder), timeout)
    out = Stacks()
    for index, reply in replies.items():
        if not isinstance(reply, P.Stacks):
            continue
        host = hosts[index]
        foreign = sorted(r for r in {*reply.stacks, *reply.traces, *reply.refused}
                         if owns is not None and not owns(index, r))
        if foreign:
            log.warning("%s: stacks for ranks it does not run, left out: %s", host,
                        foreign[:8])
        for rank, entry in reply.stacks.items():
            if rank in foreign:
                continue
            shown = {"method": entry.method, "text": entry.text}
            shown.update({k: v for k, v in (("error", entry.error), ("note", entry.note))
                          if v is not None})
            out.found[str(rank)] = {**shown, "host": host}
        for rank, path in reply.traces.items():
            if rank in foreign:
                continue
            out.dumps[str(rank)] = (channels[index], host, path)
        for rank, why in reply.refused.items():
            if rank not in foreign:
                out.refused[str(rank)] = f"{host}: {why}"
    return out


def fetch_dumps(stacks: Stacks, directory: Path, ask_all: AskAll,
                budget: float = FETCH_BUDGET, max_bytes: int = FETCH_MAX_BYTES
                ) -> dict[str, Any] | None:
    """Flight recorder dumps from the nodes into ``directory`` (what torch's analyzer reads:
    ``python -m torch.distributed.flight_recorder.fr_trace DIR``). Those not fetched within
    ``budget`` seconds or ``max_bytes`` stay on their nodes; those a node refused to take
    are named with why (``refused``)."""
    if not stacks.dumps and not stacks.refused:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    deadline, total = time.monotonic() + budget, 0
    fetched, left = list[int](), dict[str, str]()
    for rank, (channel, host, path) in sorted(stacks.dumps.items(), key=lambda kv: int(kv[0])):
        data, size = bytearray(), None
        while (size is None or len(data) < size) and not channel.closed:
            if time.monotonic() > deadline or total + len(data) > max_bytes:
                break
            reply = ask_all({0: channel}, C.ReadTrace(path, len(data)), 10.0)[0]
            if not isinstance(reply, P.TraceChunk) or not reply.data:
                break
            size = reply.size
            data += reply.data
        if size is not None and len(data) == size:
            (directory / f"nccl_trace_rank_{rank}").write_bytes(bytes(data))
            fetched.append(int(rank))
            total += size
        else:
            left[rank] = f"{host}:{path}"
    return {"dir": str(directory), "ranks": fetched, "left_on_nodes": left,
            "refused": dict(stacks.refused)}
