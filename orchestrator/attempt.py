"""One attempt of a job: what was started where, what every rank did, and its logs.

An :class:`Attempt` is fed the agents' messages by the controller (``handle``) and says when
it is over (``result``): every rank exited 0, or the first failure. It never talks to nodes
itself. Its bookkeeping is a plain dict (``snapshot``/``restore``) that the controller saves
with each checkpoint, so that a replaced controller carries on the same attempt.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from agents import protocol as P
from orchestrator.plan import TORCHRUN_LINE_RE, LaunchPlan
from orchestrator.state import AttemptOutcome, FailureCause, RankState

STDERR_TAIL = 20  # lines of a failing rank's stderr kept for the failure message


@dataclass
class Failure:
    """The first thing that went wrong in an attempt."""

    cause: FailureCause
    message: str
    node_index: int | None = None
    node_rank: int | None = None
    host: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    error_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cause"] = self.cause.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        fields = {k: d.get(k) for k in cls.__dataclass_fields__ if k in d}
        fields["cause"] = FailureCause(d["cause"])
        fields["stderr_tail"] = list(d.get("stderr_tail") or [])
        return cls(**fields)


@dataclass(frozen=True)
class AttemptResult:
    """How an attempt ended; ``failure`` is None exactly when it SUCCEEDED."""

    outcome: AttemptOutcome
    failure: Failure | None = None


class LogSink:
    """Each rank's output, written in batches to ``rank-<label>.log`` and ``combined.log``.

    Writes are buffered; :meth:`flush` returns every file's size, which the controller
    records in its checkpoint. Opening with ``sizes`` cuts every file back to its recorded
    size, so that what the agents replay after a checkpoint is written exactly once.
    """

    def __init__(self, directory: Path, sizes: dict[str, int] | None = None):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        if sizes is not None:
            for path in directory.glob("*.log"):
                with open(path, "r+b") as f:
                    f.truncate(min(sizes.get(path.name, 0), path.stat().st_size))
        self._files: dict[str, IO[bytes]] = {}
        self.stderr: dict[str, deque[str]] = {}

    def _file(self, name: str) -> IO[bytes]:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.directory / name, "ab")  # noqa: SIM115
        return f

    def write(self, host: str, label: str, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        self._file(f"rank-{label}.log").write(("\n".join(lines) + "\n").encode())
        prefix = f"[{host}:{label}] "
        self._file("combined.log").write("".join([prefix + ln + "\n" for ln in lines]).encode())
        if stream == "stderr":
            self.stderr.setdefault(label, deque(maxlen=STDERR_TAIL)).extend(lines[-STDERR_TAIL:])

    def flush(self) -> dict[str, int]:
        sizes = {}
        for name, f in self._files.items():
            f.flush()
            sizes[name] = f.tell()
        return sizes

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


class Attempt:
    """Attempt ``plan.attempt``: its ranks' states, exits and first failure."""

    def __init__(self, plan: LaunchPlan, sink: LogSink, hosts: dict[int, str],
                 store: Any, job_id: str):
        self.plan = plan
        self.number = plan.attempt
        self.sink = sink
        self.hosts = hosts  # node index -> the host shown in log prefixes
        self.store = store
        self.job_id = job_id
        self.node_ranks = {n.node_index: n.node_rank for n in plan.nodes}
        self.expected = sum(len(n.workers) for n in plan.nodes)
        self.started: set[tuple[int, int]] = set()  # (node_index, local_rank)
        self.exits: dict[int, tuple[int | None, str | None]] = {}  # rank key -> (code, signal)
        self.stopped_nodes: set[int] = set()
        self.failure: Failure | None = None
        self.stopping = False  # exits from here on are our doing, not failures
        self.last_activity = time.monotonic()  # output, or a worker's heartbeat()
        self.launched_at = time.monotonic()

    @property
    def participants(self) -> list[int]:
        return [n.node_index for n in self.plan.nodes]

    # --- the agents' messages ---------------------------------------------------------------
    def handle(self, node_index: int, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == P.PROGRESS:
            self.last_activity = time.monotonic()
            return
        if message.get("attempt") != self.number or node_index not in self.node_ranks:
            return  # a late message of an earlier attempt
        if kind == P.OUTPUT:
            self._on_output(node_index, message)
        elif kind == P.STARTED:
            self._on_started(node_index, message)
        elif kind == P.EXITED:
            self._on_exited(node_index, message)
        elif kind == P.SPAWN_FAILED:
            self.fail(Failure(
                FailureCause.LAUNCH_FAILED if self.number == 1 else FailureCause.WORKER_FAILED,
                f"rank {message.get('rank')} on {self._host(node_index)} could not start: "
                f"{message.get('error')}",
                node_index=node_index, node_rank=self.node_ranks[node_index],
                host=self._host(node_index), rank=message.get("rank"),
                local_rank=message.get("local_rank")))
        elif kind == P.STOPPED:
            self.stopped_nodes.add(node_index)
        elif kind == P.DROPPED:
            label = self._label(node_index, message.get("rank"))
            self.sink.write(self.hosts[node_index], label, str(message.get("stream")), [
                f"[orchestrator] {message.get('lines')} {message.get('stream')} lines of this "
                "rank were not kept: the agent's spool was full while no controller was "
                "attached (spool_max_bytes)"])

    def _host(self, node_index: int) -> str:
        return self.plan.nodes[self.participants.index(node_index)].host

    def _label(self, node_index: int, rank: Any) -> str:
        return str(rank) if rank is not None else f"node{self.node_ranks[node_index]}"

    def _on_output(self, node_index: int, message: dict[str, Any]) -> None:
        host, rank, stream = self.hosts[node_index], message.get("rank"), str(message["stream"])
        lines = [str(ln) for ln in message.get("lines") or ()]
        self.last_activity = time.monotonic()
        if rank is not None:
            self.sink.write(host, str(rank), stream, lines)
            return
        # torchrun (c10d): each worker line comes prefixed with its global rank.
        label, group = self._label(node_index, None), []
        for line in lines:
            if m := TORCHRUN_LINE_RE.match(line):
                this, line = str(int(m.group(1))), line[m.end():]
            else:
                this = self._label(node_index, None)
            if this != label and group:
                self.sink.write(host, label, stream, group)
                group = []
            label = this
            group.append(line)
        self.sink.write(host, label, stream, group)

    def _on_started(self, node_index: int, message: dict[str, Any]) -> None:
        self.started.add((node_index, int(message.get("local_rank") or 0)))
        if message.get("rank") is not None:
            self.store.update_rank(self.job_id, self.number, int(message["rank"]),
                                   pid=message.get("pid"), state=RankState.RUNNING.value)

    def _on_exited(self, node_index: int, message: dict[str, Any]) -> None:
        rank, code, sig = message.get("rank"), message.get("exit_code"), message.get("signal")
        key = int(rank) if rank is not None else -1 - node_index
        self.exits[key] = (code, sig)
        stopping = self.stopping or self.failure is not None
        ok = code == 0
        state = RankState.SUCCEEDED if ok else (RankState.STOPPED if stopping else
                                                RankState.FAILED)
        if rank is not None:
            self.store.update_rank(self.job_id, self.number, int(rank), state=state.value,
                                   exit_code=code, signal=sig)
        if ok or stopping:
            return
        node_rank = self.node_ranks[node_index]
        host = self._host(node_index)
        label = self._label(node_index, rank)
        who = f"rank {rank}" if rank is not None else f"torchrun on node {node_rank}"
        how = f"exited with code {code}" if code is not None else f"was killed by {sig}"
        error_file = message.get("error_file")
        detail = _error_file_message(error_file)
        self.fail(Failure(
            FailureCause.WORKER_FAILED,
            f"{who} (local rank {message.get('local_rank')} on node {node_rank}, {host}) {how}"
            + (f": {detail}" if detail else ""),
            node_index=node_index, node_rank=node_rank, host=host, rank=rank,
            local_rank=message.get("local_rank"), exit_code=code, signal=sig,
            stderr_tail=list(self.sink.stderr.get(label, [])), error_file=error_file))

    # --- verdicts ------------------------------------------------------------------------------
    def fail(self, failure: Failure) -> None:
        """Keep the first failure of the attempt; later ones are its consequences."""
        if self.failure is None:
            self.failure = failure

    @property
    def all_started(self) -> bool:
        return len(self.started) >= self.expected

    def result(self) -> AttemptResult | None:
        """None while the attempt runs."""
        if self.failure is not None:
            return AttemptResult(AttemptOutcome.FAILED, self.failure)
        if len(self.exits) >= self.expected:
            return AttemptResult(AttemptOutcome.SUCCEEDED)
        return None

    # --- checkpoints ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "logs": self.sink.flush(),
            "started": sorted(self.started),
            "exits": {str(k): list(v) for k, v in self.exits.items()},
            "stopped_nodes": sorted(self.stopped_nodes),
            "failure": self.failure.to_dict() if self.failure else None,
            "stopping": self.stopping,
            "stderr": {k: list(v) for k, v in self.sink.stderr.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.started = {(int(a), int(b)) for a, b in state.get("started", [])}
        self.exits = {int(k): (v[0], v[1]) for k, v in state.get("exits", {}).items()}
        self.stopped_nodes = set(state.get("stopped_nodes", []))
        self.failure = Failure.from_dict(state["failure"]) if state.get("failure") else None
        self.stopping = bool(state.get("stopping"))
        for label, lines in state.get("stderr", {}).items():
            self.sink.stderr[label] = deque(lines, maxlen=STDERR_TAIL)


def _error_file_message(content: str | None) -> str | None:
    """The first line of the message a worker wrote with torch's ``@record``."""
    if not content:
        return None
    try:
        data = json.loads(content)
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else str(message)
    except (ValueError, KeyError, TypeError):
        return None
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None
