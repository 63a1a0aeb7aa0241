"""The agent protocol: every message, typed and checked, in one place.

Stdlib only: the controller, ``preflight`` and the node agent all import this module, and
the transports ship it to nodes with the rest of the agent (``agents.MODULES``).

JSON lines both ways. A connection to an agent goes through a *relay* (a short-lived
process started over the channel: a local pipe, an SSH exec channel, a Slurm step) that
joins the channel to the agent's private Unix socket, so that the agent outlives every
channel::

    controller ── channel ── relay ── ~/private dir/agent.sock ── agent (detached) ── workers

The first line on a channel is for the relay (``connect``, or ``hold`` for a Slurm holder
step); every line after it is the agent's, starting with ``attach``.

What the controller says is in agents/commands.py, parsed at the agent's door as these
messages are at the controller's. Agent -> controller (``type``): the classes below, one a
message. *Sequenced* messages carry ``seq`` (1, 2, ...), are kept by the agent until
acknowledged (spooled to disk while no controller is attached) and replayed in order on the
next ``attach``; the others only matter live. A rank's ``exited`` follows all its output.

``parse`` is the door: a decoded line becomes one of these classes, or ProtocolError naming
the field. Nothing an agent sends reaches the controller's logic any other way.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from agents.fields import MAX_COUNT, MAX_RANK, Fields, finite, plain, unicode
from agents.fields import MAX_MESSAGE as MAX_MESSAGE  # part of this module's surface
from agents.fields import ProtocolError as ProtocolError
from agents.fields import decode as decode  # and so are these
from agents.fields import encode as encode

VERSION = 6  # 6: checkpoints (held, start.checkpoint); 5: commands typed at the door

# Relay -> controller.
RELAY = "relay"
HOLDING = "holding"
GONE = "gone"

# Agent -> controller.
HELLO = "hello"
HEARTBEAT = "heartbeat"
PROGRESS = "progress"
HELD = "held"
PORT = "port"
LISTENING = "listening"
PROBE_RESULT = "probe"
SYNC_MISSING = "sync_missing"
SYNC_PUT = "sync_put"
SYNC_BUILT = "sync_built"
SETUP_OUTPUT = "setup_output"
SETUP_DONE = "setup_done"
CHECKED = "checked"
NET_LISTENING = "net_listening"
NET_SENT = "net_sent"
FAILED = "failed"
STACKS = "stacks"
TRACE_CHUNK = "trace_chunk"
STARTED = "started"
SPAWN_FAILED = "spawn_failed"
OUTPUT = "output"
EXITED = "exited"
STOPPED = "stopped"
DROPPED = "dropped"
ERROR = "error"

#: Messages replayed after a dropped channel; the rest only matter while attached.
SEQUENCED = frozenset({STARTED, SPAWN_FAILED, OUTPUT, EXITED, STOPPED, DROPPED, ERROR})

MAX_LINE = 8192  # bytes of one worker output line; longer lines are split
BATCH_BYTES = 64 * 1024  # an output message holds up to this many bytes of lines
BATCH_DELAY = 0.005  # seconds a partial batch may wait for more lines
WINDOW_BYTES = 4 * 1024 * 1024  # unacknowledged bytes an agent may have in flight

# Bounds of what a node may plausibly say (beyond them: out of protocol).
MAX_LOCAL = 4096  # workers on one node
MAX_HELD_STEPS = 64  # steps per rank in one ``held``
MAX_PID = 1 << 31
MAX_GPUS = 64  # more than any node has: hello.gpus is capped here
MAX_TEXT = 1 << 20  # one text field (an error file, a stack)


def _seq(f: Fields) -> int | None:
    return f.integer("seq", 1, MAX_COUNT, optional=True)


def _rank(f: Fields) -> int | None:
    return f.integer("rank", 0, MAX_RANK, optional=True)


# --- relay and hello -----------------------------------------------------------------------

@dataclass(frozen=True)
class Relay:
    """The relay attached to the job's agent (``launched``: it started it)."""

    launched: bool


@dataclass(frozen=True)
class Gone:
    """No agent of the job on the node; ``outcome`` says why, when the agent wrote it."""

    outcome: dict[str, Any] | None

    @property
    def reason(self) -> str | None:
        reason = (self.outcome or {}).get("reason")
        return reason if isinstance(reason, str) else None


@dataclass(frozen=True)
class Holding:
    standby: bool


@dataclass(frozen=True)
class WorkerInfo:
    rank: int | None
    local_rank: int
    pid: int
    running: bool


@dataclass(frozen=True)
class Hello:
    """What an agent says when a controller attaches."""

    protocol: int
    pid: int
    attempt: int
    hostname: str | None = None
    python: str | None = None
    torch: str | None = None
    gpus: int = 0
    instance: str | None = None
    last_seq: int = 0
    workers: tuple[WorkerInfo, ...] = ()
    containment: str | None = None  # what keeps its workers' descendants (agents/containment)

    @property
    def running(self) -> bool:
        return any(w.running for w in self.workers)


def _hello(f: Fields) -> Hello:
    workers = []
    for item in f.array("workers"):
        if not isinstance(item, dict):
            raise f.bad("workers", item)
        w = Fields({**item, "type": "hello.workers"})
        workers.append(WorkerInfo(_rank(w), w.integer("local_rank", 0, MAX_LOCAL),
                                  w.integer("pid", 1, MAX_PID), w.flag("running", False)))
    gpus = f.integer("gpus", 0, MAX_COUNT, optional=True) or 0  # capped below, not refused
    return Hello(f.integer("protocol", 0, 1 << 20), f.integer("pid", 1, MAX_PID),
                 f.integer("attempt", 0, MAX_COUNT), f.text("hostname", 255, True),
                 f.text("python", 64, True), f.text("torch", 64, True), min(gpus, MAX_GPUS),
                 f.text("instance", 64, True), f.integer("last_seq", 0, MAX_COUNT, True) or 0,
                 tuple(workers), f.text("containment", 4096, True))


# --- live messages ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Notice:
    """The node was told it goes away (a SIGTERM to its agent: its host's shutdown, its
    scheduler's preemption; a cloud's notice, agents/preemption.py): ``source``, and the
    Unix time by which its workers stop."""

    source: str
    deadline: float


@dataclass(frozen=True)
class Heartbeat:
    attempt: int
    notice: Notice | None = None  # while one is pending (optional: older peers ignore it)


def _heartbeat(f: Fields) -> Heartbeat:
    if f.raw.get("notice") is None:
        return Heartbeat(f.integer("attempt"))
    n = Fields({**f.mapping("notice"), "type": "heartbeat.notice"})
    return Heartbeat(f.integer("attempt"), Notice(n.text("source", 200), n.timestamp("deadline")))


@dataclass(frozen=True)
class RankProgress:
    """One rank's news: its heartbeat() (``at``, with ``step``, ``total_steps`` and
    ``metrics`` when given) and its sampler's [samples, of them waiting in a collective]."""

    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    at: float | None = None
    waits: tuple[int, int] | None = None
    total_steps: int | None = None


@dataclass(frozen=True)
class Progress:
    attempt: int
    beat: bool  # some worker called heartbeat(): a sign of life (a sampler's report is not)
    ranks: dict[int, RankProgress]


def _progress(f: Fields) -> Progress:
    ranks = {}
    for key, record in f.mapping("ranks", optional=True).items():
        rank = f.rank_key(key, "ranks")
        if not isinstance(record, dict):
            raise f.bad("ranks", record)
        r = Fields({**record, "type": "progress.ranks"})
        metrics = record.get("metrics") or {}
        if not isinstance(metrics, dict) or len(metrics) > 256:
            raise r.bad("metrics", metrics)
        # Metrics are the user's: what is not a finite number is left out, not an offence.
        kept = {str(k)[:128]: v for k, v in
                ((k, finite(v)) for k, v in metrics.items()) if v is not None}
        if not all(map(unicode, kept)):
            raise r.bad("metrics", metrics)
        waits = record.get("waits")
        if waits is not None:
            if not (isinstance(waits, list) and len(waits) == 2):
                raise r.bad("waits", waits)
            waits = (r.integer("waits", value=waits[0]), r.integer("waits", value=waits[1]))
        step = record.get("step")
        total = r.integer("total_steps", low=1, high=MAX_COUNT - 1, optional=True)
        ranks[rank] = RankProgress(
            step if type(step) is int and abs(step) < MAX_COUNT else None, kept,
            r.timestamp("at", optional=True) if "at" in record else None, waits, total)
    return Progress(f.integer("attempt"), f.flag("beat", True), ranks)


@dataclass(frozen=True)
class Held:
    """A node's checkpoints (agents/checkpoints.py): steps per rank in memory, in its
    checkpoint.dir (``store``: its id), of its buddy's ranks (``replicas``, served on ``port``)
    and the memory they take; per rank its newest save (``saves``: step, bytes, seconds it held
    training), its last load (``restored``: attempt, step, source, seconds, copies skipped)."""

    attempt: int
    memory: dict[int, tuple[int, ...]]
    persisted: dict[int, tuple[int, ...]]
    bytes: int
    store: str | None
    replicas: dict[int, tuple[int, ...]] = field(default_factory=dict)
    port: int | None = None
    saves: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    restored: dict[int, tuple[int, int, str, float, int]] = field(default_factory=dict)


RESTORE_SOURCES = ("memory", "buddy", "persisted")


def _held(f: Fields) -> Held:
    def steps(name: str) -> dict[int, tuple[int, ...]]:
        return {f.rank_key(key, name): tuple(f.integer(name, value=v) for v in f.array(
            name, value=value, limit=MAX_HELD_STEPS)) for key, value in
            f.mapping(name, optional=True).items()}
    return Held(f.integer("attempt"), steps("memory"), steps("persisted"),
                f.integer("bytes", 0, MAX_COUNT), f.text("store", 64, True),
                steps("replicas"), f.integer("port", 1, 65535, optional=True),
                f.rank_tuples("saves", "iif"),
                f.rank_tuples("restored", "iiwfi", RESTORE_SOURCES))


@dataclass(frozen=True)
class SetupOutput:
    lines: tuple[str, ...]


# --- replies to requests ----------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """Every reply names its request."""

    req: int


@dataclass(frozen=True)
class Failed(Reply):
    """The request could not be carried out on the node."""

    error: str = ""


@dataclass(frozen=True)
class PortReply(Reply):
    port: int = 0
    ok: bool = False


@dataclass(frozen=True)
class Listening(Reply):
    ports: tuple[int, ...] = ()
    busy: tuple[int, ...] = ()
    ok: bool = False
    error: str | None = None


@dataclass(frozen=True)
class ProbeResult(Reply):
    interface: str | None = None
    reachable: bool = False
    unreachable: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class SyncMissing(Reply):
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class SyncPut(Reply):
    ok: bool = False
    error: str | None = None


@dataclass(frozen=True)
class SyncBuilt(Reply):
    path: str = ""


@dataclass(frozen=True)
class SetupDone(Reply):
    exit_code: int = 0
    cached: bool = False
    tail: tuple[str, ...] = ()
    timed_out: bool = False  # stopped past the job's setup_timeout


@dataclass(frozen=True)
class Checked(Reply):
    problems: tuple[str, ...] = ()  # none: the node is healthy
    tail: tuple[str, ...] = ()  # the last lines of health.node_check's output


@dataclass(frozen=True)
class NetListening(Reply):
    port: int = 0


@dataclass(frozen=True)
class NetSent(Reply):
    seconds: float | None = None  # the transfer's time; None: it failed (``error``)
    error: str | None = None


@dataclass(frozen=True)
class Stack:
    method: str
    text: str
    error: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Stacks(Reply):
    stacks: dict[int, Stack] = field(default_factory=dict)
    traces: dict[int, str] = field(default_factory=dict)  # rank -> its dump on the node
    refused: dict[int, str] = field(default_factory=dict)  # rank -> why its dump was not taken


@dataclass(frozen=True)
class TraceChunk(Reply):
    data: bytes = b""
    size: int = 0


def _ports(f: Fields, name: str) -> tuple[int, ...]:
    return tuple(f.integer(name, 0, 65535, value=p) for p in f.array(name, optional=True))


def _stacks(f: Fields, req: int) -> Stacks:
    stacks = {}
    for key, entry in f.mapping("stacks", optional=True).items():
        rank = f.rank_key(key, "stacks")
        if not isinstance(entry, dict):
            raise f.bad("stacks", entry)
        e = Fields({**entry, "type": "stacks.stacks"})
        stacks[rank] = Stack(e.text("method", 32), e.text("text", MAX_TEXT),
                             e.text("error", MAX_TEXT, True), e.text("note", MAX_TEXT, True))
    traces = {f.rank_key(k, "traces"): f.text("traces", 4096, value=v)
              for k, v in f.mapping("traces", optional=True).items()}
    refused = {f.rank_key(k, "refused"): f.text("refused", MAX_TEXT, value=v)
               for k, v in f.mapping("refused", optional=True).items()}
    return Stacks(req, stacks, traces, refused)


def _trace_chunk(f: Fields, req: int) -> TraceChunk:
    try:
        data = base64.b64decode(f.text("data", 2 * MAX_TEXT), validate=True)
    except (ValueError, binascii.Error):
        raise f.bad("data") from None
    return TraceChunk(req, data, f.integer("size", 0, MAX_COUNT))


def _net_sent(f: Fields, req: int) -> NetSent:
    seconds = f.number("seconds", optional=True)
    if seconds is not None and not 0 <= seconds < MAX_COUNT:
        raise f.bad("seconds")
    error = f.text("error", MAX_TEXT, True)
    if (seconds is None) == (error is None):
        raise f.bad("seconds")  # one or the other
    return NetSent(req, seconds, error)


_REPLIES: dict[str, Callable[[Fields, int], Reply]] = {
    FAILED: lambda f, req: Failed(req, f.text("error", MAX_TEXT)),
    PORT: lambda f, req: PortReply(req, f.integer("port", 0, 65535), f.flag("ok")),
    LISTENING: lambda f, req: Listening(req, _ports(f, "ports"), _ports(f, "busy"),
                                        f.flag("ok"), f.text("error", MAX_TEXT, True)),
    PROBE_RESULT: lambda f, req: ProbeResult(
        req, f.text("interface", 64, True), f.flag("reachable"), _ports(f, "unreachable"),
        f.text("error", MAX_TEXT, True)),
    SYNC_MISSING: lambda f, req: SyncMissing(req, tuple(
        f.text("missing", 64, value=s) for s in f.array("missing"))),
    SYNC_PUT: lambda f, req: SyncPut(req, f.flag("ok"), f.text("error", MAX_TEXT, True)),
    SYNC_BUILT: lambda f, req: SyncBuilt(req, f.text("path")),
    SETUP_DONE: lambda f, req: SetupDone(
        req, f.integer("exit_code", -255, 255), f.flag("cached"),
        tuple(f.text("tail", MAX_TEXT, value=t) for t in f.array("tail", optional=True)),
        f.flag("timed_out", False)),
    CHECKED: lambda f, req: Checked(
        req, tuple(f.text("problems", MAX_TEXT, value=t) for t in f.array("problems")),
        tuple(f.text("tail", MAX_TEXT, value=t) for t in f.array("tail", optional=True))),
    NET_LISTENING: lambda f, req: NetListening(req, f.integer("port", 1, 65535)),
    NET_SENT: _net_sent,
    STACKS: _stacks,
    TRACE_CHUNK: _trace_chunk,
}


# --- sequenced messages -----------------------------------------------------------------------

@dataclass(frozen=True)
class Sequenced:
    """A message the agent numbers, keeps until acknowledged, and replays."""

    seq: int | None
    attempt: int


@dataclass(frozen=True)
class Started(Sequenced):
    rank: int | None
    local_rank: int
    pid: int
    warm: bool = False  # a standby became this worker (agents/standby.py)


@dataclass(frozen=True)
class SpawnFailed(Sequenced):
    rank: int | None
    local_rank: int
    error: str


@dataclass(frozen=True)
class Output(Sequenced):
    rank: int | None
    stream: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Exited(Sequenced):
    rank: int | None
    local_rank: int
    exit_code: int | None
    signal: str | None
    error_file: str | None
    at: float | None = None  # the node's clock when the agent saw the exit


@dataclass(frozen=True)
class Stopped(Sequenced):
    pass


@dataclass(frozen=True)
class Dropped(Sequenced):
    rank: int | None
    stream: str
    lines: int


@dataclass(frozen=True)
class ErrorReport(Sequenced):
    """The agent reports an error of its own (a command it refused or that failed without
    a request to answer): ``type: error``. Not orchestrator.errors.AgentError, the
    controller's exception for an agent that did not start."""

    message: str


_SEQUENCED: dict[str, Callable[[Fields], Sequenced]] = {
    STARTED: lambda f: Started(_seq(f), f.integer("attempt"), _rank(f),
                               f.integer("local_rank", 0, MAX_LOCAL),
                               f.integer("pid", 1, MAX_PID), f.flag("warm", False)),
    SPAWN_FAILED: lambda f: SpawnFailed(_seq(f), f.integer("attempt"), _rank(f),
                                        f.integer("local_rank", 0, MAX_LOCAL),
                                        f.text("error", MAX_TEXT)),
    OUTPUT: lambda f: Output(_seq(f), f.integer("attempt"), _rank(f), f.stream(), f.lines()),
    EXITED: lambda f: Exited(_seq(f), f.integer("attempt"), _rank(f),
                             f.integer("local_rank", 0, MAX_LOCAL),
                             f.integer("exit_code", 0, 255, optional=True), f.signal(),
                             f.text("error_file", MAX_TEXT, True),
                             f.timestamp("at", optional=True)),
    STOPPED: lambda f: Stopped(_seq(f), f.integer("attempt")),
    DROPPED: lambda f: Dropped(_seq(f), f.integer("attempt"), _rank(f), f.stream(),
                               f.integer("lines", 0, MAX_COUNT)),
    ERROR: lambda f: ErrorReport(_seq(f), f.integer("attempt", optional=True) or 0,
                                f.text("message", MAX_TEXT)),
}

# typing.Union, not "|": this module runs on the nodes' Python too, which may be 3.9.
Message = Union[Relay, Gone, Holding, Hello, Heartbeat, Progress, Held,  # noqa: UP007
                SetupOutput, Reply, Sequenced]


def parse(raw: dict[str, Any]) -> Message:
    """The door: a decoded line as its message class, or ProtocolError naming the field."""
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("message", "type", kind)
    f = Fields(raw)
    if kind in _SEQUENCED:
        return _SEQUENCED[kind](f)
    if "req" in raw and kind in _REPLIES:
        return _REPLIES[kind](f, f.integer("req", 0, MAX_COUNT))
    if kind == HEARTBEAT:
        return _heartbeat(f)
    if kind == PROGRESS:
        return _progress(f)
    if kind == HELD:
        return _held(f)
    if kind == SETUP_OUTPUT:
        return SetupOutput(f.lines())
    if kind == HELLO:
        return _hello(f)
    if kind == RELAY:
        return Relay(f.flag("launched", False))
    if kind == GONE:
        outcome = raw.get("outcome")
        return Gone(outcome if isinstance(outcome, dict) else None)
    if kind == HOLDING:
        return Holding(f.flag("standby", False))
    raise ProtocolError(kind, "type", kind)


def check(raw: dict[str, Any]) -> str | None:
    """What is wrong with a raw message, or None when ``parse`` takes it."""
    try:
        parse(raw)
    except ProtocolError as exc:
        return "no message type" if exc.kind == "message" else str(exc)
    return None


_REPLY_TYPES = {Failed: FAILED, PortReply: PORT, Listening: LISTENING,
                ProbeResult: PROBE_RESULT, SyncMissing: SYNC_MISSING, SyncPut: SYNC_PUT,
                SyncBuilt: SYNC_BUILT, SetupDone: SETUP_DONE, Checked: CHECKED,
                NetListening: NET_LISTENING, NetSent: NET_SENT, Stacks: STACKS,
                TraceChunk: TRACE_CHUNK}


def reply_wire(reply: Reply, attempt: int) -> dict[str, Any]:
    """A reply as the agent sends it (the door's ``parse`` reads it back)."""
    return {"type": _REPLY_TYPES[type(reply)], "attempt": attempt, **plain(reply)}


class OtherVersion(Exception):
    """An agent that speaks another protocol version (``theirs``)."""

    def __init__(self, theirs: Any):
        super().__init__(f"protocol {theirs!r}")
        self.theirs = theirs


def parse_hello(raw: dict[str, Any] | None) -> Hello | None:
    """The answer to ``attach``: its Hello; None when it is not one (the agent refused);
    OtherVersion before any field is read when it speaks another version (whose fields may
    differ); ProtocolError for a bad field."""
    if raw is None or raw.get("type") != HELLO:
        return None
    if raw.get("protocol") != VERSION:
        raise OtherVersion(raw.get("protocol"))
    return _hello(Fields(raw))
