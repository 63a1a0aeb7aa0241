"""Controller -> relay, holder and agent: every command as a class, encoded and parsed here.

The other half of the protocol (agents/protocol.py has what nodes say; the base classes are
in agents/commandbase.py, the checkpoint store's in agents/checkpointcommands.py). Stdlib
only, and shipped to nodes with the agent. A command is a frozen dataclass whose class names its
``OP``; ``wire`` turns one into the JSON object sent on a channel, and ``parse`` is the
agent's door: a decoded line becomes one of these classes, or ProtocolError naming the
field, so that no handler reads a raw field. A *request* (``Request``) is answered by the
reply class its ``REPLY`` names (or ``Failed``): ``orchestrator.channel.ask`` returns that
type. The channel gives each request its ``req``, which travels beside the command.

Ops::

    connect, hold                 the first line on a channel, for the relay
    attach, ack, spool, ping      the agent's session (the reader thread takes these)
    start, warm, stop, shutdown   workers (agents/agent.py)
    replicate_to, retain          where a node's checkpoints go, which stay (checkpoints.py)
    free_port, listen, probe      ports and reachability (requests)
    sync_missing, sync_put, sync_build, setup, node_check      code, setup, health
    net_listen, net_send, net_close                            the network check
    stacks, read_trace            stacks and flight recorder dumps

and on a node's holder socket (Slurm, agents/holder.py) ``HolderStart`` and its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents import protocol as P
from agents.checkpointcommands import NO_CHECKPOINT as NO_CHECKPOINT
from agents.checkpointcommands import CheckpointConfig as CheckpointConfig
from agents.checkpointcommands import Copies as Copies
from agents.checkpointcommands import Pull as Pull
from agents.checkpointcommands import Release as Release
from agents.checkpointcommands import ReplicateTo as ReplicateTo
from agents.checkpointcommands import Resumed as Resumed
from agents.checkpointcommands import Retain as Retain
from agents.checkpointcommands import SaveAt as SaveAt
from agents.commandbase import Command as Command
from agents.commandbase import R as R
from agents.commandbase import Request as Request
from agents.fields import MAX_ARG, MAX_COUNT, MAX_PORT, MAX_RANK, ProtocolError, plain
from agents.fields import CommandFields as _Read

MAX_FILES = 1 << 22  # files of a synced tree


# --- the session ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """How to start the job's agent on a node (``connect.launch``)."""

    secret: str
    heartbeat_interval: float | None = None
    node_timeout: float | None = None
    controller_grace: float | None = None
    spool_max_bytes: int | None = None
    stop_grace: float | None = None
    holder: bool = False  # Slurm: the node's holder step starts it (agents/holder.py)
    preemption_check: str | None = None  # a script (agents/preemption.py)
    preemption_check_interval: float | None = None
    sigterm_to_workers: bool = False  # on_sigterm: worker (no notice: agents/agent.py)

    @classmethod
    def read(cls, f: _Read) -> Launch:
        return cls(f.text("secret", 256), f.seconds("heartbeat_interval", True),
                   f.seconds("node_timeout", True), f.seconds("controller_grace", True),
                   f.integer("spool_max_bytes", 0, MAX_COUNT, optional=True),
                   f.seconds("stop_grace", True), f.flag("holder", False),
                   f.text("preemption_check", MAX_ARG, True),
                   f.seconds("preemption_check_interval", True),
                   f.flag("sigterm_to_workers", False))


@dataclass(frozen=True)
class Connect(Command):
    """Attach to the job's agent on this node; with ``launch``, start it if none answers.
    The relay answers ``relay``, ``gone`` or ``error``."""

    OP = "connect"
    job_id: str
    node_index: int
    launch: Launch | None = None

    @classmethod
    def read(cls, f: _Read) -> Connect:
        launch = f.mapping("launch", optional=True)
        return cls(f.text("job_id", 128), f.integer("node_index", 0, MAX_RANK),
                   Launch.read(_Read(launch, "connect.launch")) if launch else None)


@dataclass(frozen=True)
class Hold(Command):
    """Be this node's holder step (Slurm); answered ``holding``."""

    OP = "hold"
    job_id: str

    @classmethod
    def read(cls, f: _Read) -> Hold:
        return cls(f.text("job_id", 128))


@dataclass(frozen=True)
class Attach(Command):
    """The first line for the agent: the job's secret, and the last seq this job kept."""

    OP = "attach"
    secret: str
    ack: int = 0

    @classmethod
    def read(cls, f: _Read) -> Attach:
        return cls(f.text("secret", 256), f.integer("ack", 0, MAX_COUNT, optional=True) or 0)


@dataclass(frozen=True)
class Ack(Command):
    """Everything up to ``seq`` is kept: the agent may forget it."""

    OP = "ack"
    seq: int

    @classmethod
    def read(cls, f: _Read) -> Ack:
        return cls(f.integer("seq", 0, MAX_COUNT))


@dataclass(frozen=True)
class Spool(Command):
    """The controller cannot write (a full disk): keep every sequenced message in the spool,
    as while detached, until a controller attaches again."""

    OP = "spool"


@dataclass(frozen=True)
class Ping(Command):
    """The controller's heartbeat."""

    OP = "ping"


@dataclass(frozen=True)
class Shutdown(Command):
    """Stop the workers, remove the agent's state, exit."""

    OP = "shutdown"


# --- workers -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerStart:
    """One worker of a ``start``: its argv and its own variables."""

    rank: int | None
    local_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]

    @classmethod
    def read(cls, f: _Read) -> WorkerStart:
        argv = f.words("argv", optional=False)
        if not argv:
            raise f.bad("argv")
        return cls(f.integer("rank", 0, MAX_RANK, optional=True),
                   f.integer("local_rank", 0, P.MAX_LOCAL), argv, f.strings("env"))


@dataclass(frozen=True)
class WarmImports:
    imports: tuple[str, ...] = ()


@dataclass(frozen=True)
class Start(Command):
    """Start attempt ``attempt``'s workers here. Workers start from the agent's own
    environment (the node's: the login's over SSH, the step's on Slurm, the submitter's on a
    local node) and umask, plus ``env``, plus ``defaults`` where the node has none of them;
    with ``route_to`` (the master, when the attempt spans several nodes)
    GLOO/NCCL_SOCKET_IFNAME name the interface toward it, unless set. With ``warm``, workers
    start from standbys, which import ``warm.imports`` besides torch."""

    OP = "start"
    attempt: int
    workdir: str | None
    env: dict[str, str]
    defaults: dict[str, str]
    route_to: str | None
    workers: tuple[WorkerStart, ...]
    stop_grace: float = 5.0
    flight_recorder: int = 0
    warm: WarmImports | None = None
    checkpoint: CheckpointConfig = NO_CHECKPOINT
    # The ranks it runs (0: one a worker): c10d's torchrun and a per-node process, one
    # worker, run them all, and each rank's share of checkpoint.memory is of them all.
    ranks: int = 0

    @classmethod
    def read(cls, f: _Read) -> Start:
        workers = []
        for item in f.array("workers", limit=P.MAX_LOCAL):
            if not isinstance(item, dict):
                raise f.bad("workers", item)
            workers.append(WorkerStart.read(_Read(item, f"{f.kind}.workers")))
        warm = f.mapping("warm", optional=True)
        return cls(f.integer("attempt", 0, MAX_COUNT), f.text("workdir", MAX_ARG, True),
                   f.strings("env"), f.strings("defaults"), f.text("route_to", 255, True),
                   tuple(workers), f.seconds("stop_grace", True) or 5.0,
                   f.integer("flight_recorder", 0, MAX_COUNT, optional=True) or 0,
                   WarmImports(_Read(warm, f"{f.kind}.warm").words("imports"))
                   if "warm" in f.raw and f.raw["warm"] is not None else None,
                   CheckpointConfig.read(_Read(f.mapping("checkpoint"), f"{f.kind}.checkpoint"))
                   if f.raw.get("checkpoint") is not None else NO_CHECKPOINT,
                   f.integer("ranks", 0, P.MAX_LOCAL, optional=True) or 0)


@dataclass(frozen=True)
class Warm(Start):
    """A spare node (it runs no worker): standbys, at once, for the workers this start
    would run here, so that taking over a lost node's place is warm too."""

    OP = "warm"


@dataclass(frozen=True)
class Stop(Command):
    """Stop attempt ``attempt``'s workers (SIGTERM, ``grace`` seconds, SIGKILL); answered,
    in sequence, by ``stopped``."""

    OP = "stop"
    attempt: int | None = None  # None: the current one
    grace: float = 5.0

    @classmethod
    def read(cls, f: _Read) -> Stop:
        grace = f.seconds("grace", True)
        return cls(f.integer("attempt", 0, MAX_COUNT, optional=True),
                   5.0 if grace is None else grace)


# --- ports and reachability -------------------------------------------------------------

@dataclass(frozen=True)
class FreePort(Request[P.PortReply]):
    """A port free now: ``port`` (0: any; else check that one), or the first free one of
    ``range`` [lo, hi]."""

    OP = "free_port"
    REPLY = P.PortReply
    port: int = 0
    range: tuple[int, int] | None = None

    @classmethod
    def read(cls, f: _Read) -> FreePort:
        span = f.ports("range") if f.raw.get("range") is not None else None
        if span is not None and (len(span) != 2 or span[0] > span[1]):
            raise f.bad("range")
        return cls(f.integer("port", 0, MAX_PORT, optional=True) or 0,
                   None if span is None else (span[0], span[1]))


@dataclass(frozen=True)
class Listen(Request[P.Listening]):
    """Hold listening sockets on ``port`` (0: any), or on every free port of ``ports``
    (preflight: peers test that they reach them)."""

    OP = "listen"
    REPLY = P.Listening
    port: int = 0
    ports: tuple[int, ...] = ()

    @classmethod
    def read(cls, f: _Read) -> Listen:
        return cls(f.integer("port", 0, MAX_PORT, optional=True) or 0, f.ports("ports"))


@dataclass(frozen=True)
class Probe(Request[P.ProbeResult]):
    """The interface toward ``address``, and whether each of ``ports`` there accepts TCP."""

    OP = "probe"
    REPLY = P.ProbeResult
    address: str
    ports: tuple[int, ...]
    timeout: float = 3.0

    @classmethod
    def read(cls, f: _Read) -> Probe:
        return cls(f.text("address", 255), f.ports("ports"), f.seconds("timeout", True) or 3.0)


# --- code, setup and health (orchestrator/prepare.py, orchestrator/healthcheck.py) -----------

@dataclass(frozen=True)
class MissingBlobs(Request[P.SyncMissing]):
    """Which of these sha256 blobs the node's cache lacks."""

    OP = "sync_missing"
    REPLY = P.SyncMissing
    blobs: tuple[str, ...]

    @classmethod
    def read(cls, f: _Read) -> MissingBlobs:
        return cls(f.words("blobs", optional=False, limit=64, items=MAX_FILES))


@dataclass(frozen=True)
class PutChunk(Request[P.SyncPut]):
    """One chunk of a blob (``data`` in base64)."""

    OP = "sync_put"
    REPLY = P.SyncPut
    sha: str
    offset: int
    data: str
    last: bool

    @classmethod
    def read(cls, f: _Read) -> PutChunk:
        return cls(f.text("sha", 64), f.integer("offset", 0, MAX_COUNT),
                   f.text("data", P.MAX_MESSAGE), f.flag("last", False))


@dataclass(frozen=True)
class BuildTree(Request[P.SyncBuilt]):
    """Build the synced tree from cached blobs (``files``: [path, sha, executable]), and
    prune all but the last ``keep`` trees."""

    OP = "sync_build"
    REPLY = P.SyncBuilt
    tree: str
    files: tuple[tuple[str, str, bool], ...]
    keep: int = 5

    @classmethod
    def read(cls, f: _Read) -> BuildTree:
        files = []
        for item in f.array("files", limit=MAX_FILES):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], bool)):
                raise f.bad("files", item)
            files.append((f.text("files", 4096, value=item[0]),
                          f.text("files", 64, value=item[1]), item[2]))
        return cls(f.text("tree", 64), tuple(files), f.integer("keep", 1, 1 << 20, True) or 5)


@dataclass(frozen=True)
class RunSetup(Request[P.SetupDone]):
    """Run the job's setup script once per ``key`` (cached when it succeeds), stopped past
    ``timeout`` seconds; its output streams as ``setup_output``."""

    OP = "setup"
    REPLY = P.SetupDone
    key: str
    script: str
    workdir: str | None
    env: dict[str, str]
    timeout: float | None = None

    @classmethod
    def read(cls, f: _Read) -> RunSetup:
        return cls(f.text("key", 128), f.text("script", MAX_ARG),
                   f.text("workdir", MAX_ARG, True), f.strings("env"),
                   f.seconds("timeout", True))


@dataclass(frozen=True)
class CheckNode(Request[P.Checked]):
    """The health check before an attempt: free space, the GPUs through nvidia-smi (``gpus``:
    how many there must be), the job's own command."""

    OP = "node_check"
    REPLY = P.Checked
    argv: tuple[str, ...]
    workdir: str | None
    env: dict[str, str]
    timeout: float
    min_free_bytes: int | None = None
    gpu_check: bool = False
    gpus: int | None = None

    @classmethod
    def read(cls, f: _Read) -> CheckNode:
        return cls(f.words("argv"), f.text("workdir", MAX_ARG, True), f.strings("env"),
                   f.seconds("timeout"), f.integer("min_free_bytes", 0, MAX_COUNT, True),
                   f.flag("gpu_check", False), f.integer("gpus", 0, P.MAX_GPUS, True))


# --- the network check (orchestrator/netcheck.py) -------------------------------------------

@dataclass(frozen=True)
class NetListen(Request[P.NetListening]):
    """The receiving end: takes ``bytes`` from each connection that first sends ``token``
    (hex), for ``timeout`` seconds; a new one replaces the last."""

    OP = "net_listen"
    REPLY = P.NetListening
    token: str
    bytes: int
    timeout: float

    @classmethod
    def read(cls, f: _Read) -> NetListen:
        return cls(_hex(f, "token"), f.integer("bytes", 0, MAX_COUNT), f.seconds("timeout"))


@dataclass(frozen=True)
class NetSend(Request[P.NetSent]):
    """One timed transfer to a peer's receiver."""

    OP = "net_send"
    REPLY = P.NetSent
    address: str
    port: int
    token: str
    bytes: int
    timeout: float

    @classmethod
    def read(cls, f: _Read) -> NetSend:
        return cls(f.text("address", 255), f.integer("port", 1, MAX_PORT), _hex(f, "token"),
                   f.integer("bytes", 0, MAX_COUNT), f.seconds("timeout"))


@dataclass(frozen=True)
class NetClose(Command):
    """The network check is over: close the receiver."""

    OP = "net_close"


def _hex(f: _Read, name: str) -> str:
    token = f.text(name, 1024)
    try:
        bytes.fromhex(token)
    except ValueError:
        raise f.bad(name) from None
    return token


# --- stacks and flight recorder dumps (orchestrator/hang.py) -------------------------------

@dataclass(frozen=True)
class GetStacks(Request[P.Stacks]):
    """Every live rank's stack (within ``timeout`` s), and with ``flight_recorder`` their
    dumps."""

    OP = "stacks"
    REPLY = P.Stacks
    timeout: float = 15.0
    flight_recorder: bool = False

    @classmethod
    def read(cls, f: _Read) -> GetStacks:
        return cls(f.seconds("timeout", True) or 15.0, f.flag("flight_recorder", False))


@dataclass(frozen=True)
class ReadTrace(Request[P.TraceChunk]):
    """A piece of a flight recorder dump."""

    OP = "read_trace"
    REPLY = P.TraceChunk
    path: str
    offset: int = 0

    @classmethod
    def read(cls, f: _Read) -> ReadTrace:
        return cls(f.text("path", 4096), f.integer("offset", 0, MAX_COUNT, True) or 0)


# --- the holder socket (Slurm) ----------------------------------------------------------------

@dataclass(frozen=True)
class HolderStart(Command):
    """A relay asks the node's holder step to start the job's agent."""

    OP = "start"
    node_index: int
    launch: Launch

    @classmethod
    def read(cls, f: _Read) -> HolderStart:
        return cls(f.integer("node_index", 0, MAX_RANK),
                   Launch.read(_Read(f.mapping("launch"), "start.launch")))


@dataclass(frozen=True)
class HolderStarted:
    """The holder's answer: the agent listens, or why not."""

    ok: bool
    error: str | None = None


# --- encoding and the door ----------------------------------------------------------------------

def wire(command: Command, req: int | None = None) -> dict[str, Any]:
    """The JSON object of ``command`` (a request's with its ``req``); None fields are left
    out, which the door reads as their defaults."""
    out: dict[str, Any] = {"op": command.OP}
    if req is not None:
        out["req"] = req
    out.update(plain(command))
    return out


_SESSION = (Connect, Hold, Attach, Ack, Spool, Ping)
_AGENT = (Start, Warm, Stop, ReplicateTo, Retain, SaveAt, Release, Resumed, Shutdown,
          FreePort, Listen, Probe, MissingBlobs, PutChunk, BuildTree, RunSetup, CheckNode,
          NetListen, NetSend, NetClose, GetStacks, ReadTrace)
#: Every op a controller may send, by name.
COMMANDS: dict[str, type[Command]] = {c.OP: c for c in _SESSION + _AGENT}


def parse(raw: dict[str, Any], table: dict[str, type[Command]] | None = None
          ) -> tuple[Command, int | None]:
    """The door: a decoded line as (its command, its ``req`` or None), or ProtocolError
    naming the field. ``table``: the ops taken here (default: every command)."""
    op = raw.get("op")
    known = COMMANDS if table is None else table
    if not isinstance(op, str) or op not in known:
        raise ProtocolError("command", "op", op)
    cls = known[op]
    f = _Read(raw, op)
    req = f.integer("req", 0, MAX_COUNT) if issubclass(cls, Request) else None
    return cls.read(f), req


def request_id(raw: dict[str, Any]) -> int | None:
    """The ``req`` of a line the door refused, when it has a usable one: its asker must
    still hear (``failed``)."""
    req = raw.get("req")
    return req if type(req) is int and 0 <= req <= MAX_COUNT else None


def op_name(raw: dict[str, Any]) -> str:
    """The op a refused line named, for the agent's error message."""
    return repr(raw.get("op"))[:40]


def parse_holder_start(raw: dict[str, Any] | None) -> HolderStart:
    if raw is None:
        raise ProtocolError("start", "op", None)
    command, _ = parse(raw, {HolderStart.OP: HolderStart})
    assert isinstance(command, HolderStart)
    return command


def holder_started(started: HolderStarted) -> dict[str, Any]:
    return plain(started)


def parse_holder_started(raw: dict[str, Any] | None) -> HolderStarted:
    f = _Read(raw or {}, "started")
    try:
        return HolderStarted(f.flag("ok", False), f.text("error", P.MAX_TEXT, True))
    except ProtocolError as exc:
        return HolderStarted(False, str(exc))


def via_holder(message: dict[str, Any]) -> dict[str, Any] | None:
    """A ``connect`` line that launches an agent, changed so that the node's holder step
    starts it (the Slurm transport's); None for any other line."""
    if message.get("op") != Connect.OP or not isinstance(message.get("launch"), dict):
        return None
    return {**message, "launch": {**message["launch"], "holder": True}}


def job_of(message: dict[str, Any]) -> str:
    return str(message.get("job_id"))

