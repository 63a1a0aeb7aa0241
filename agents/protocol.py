"""The agent protocol: names, framing, version and the request/reply helper, in one place.

Stdlib only: the controller, ``preflight`` and the node agent all import this module, and
the transports ship its source to nodes together with the agent's (see
``orchestrator.transport.base.BOOTSTRAP``).

JSON lines both ways. A connection to an agent goes through a *relay* (a short-lived
process started over the channel: a local pipe or an SSH exec channel) that joins the
channel to the agent's private Unix socket, so that the agent outlives every channel::

    controller ── channel ── relay ── ~/private dir/agent.sock ── agent (detached) ── workers

The first line on a channel is for the relay (``connect``); every line after it is the
agent's, starting with ``attach``.

Controller -> relay::

    connect   {job_id, node_index, launch: null | {secret, heartbeat_interval, node_timeout,
               controller_grace, spool_max_bytes}}
              attach to the job's agent on this node; with ``launch``, start it when there
              is none. The relay answers ``relay {launched}``, or ``gone`` (no agent, and
              no launch asked) and exits.

Controller -> agent (``op``)::

    attach    {secret, ack}         the first line; ``ack`` is the last seq this job has kept
    ack       {seq}                 everything up to seq is kept: the agent may forget it
    ping      {}                    the controller's heartbeat
    start     {attempt, workdir, env, defaults, route_to, workers: [{rank, local_rank, argv,
               env}], stop_grace, flight_recorder}
              workers start from the agent's own environment (the node's: the login's over
              SSH, the step's on Slurm, the submitter's on a local node) and umask, plus
              ``env``, plus ``defaults`` where the node has none of them; with ``route_to``
              (the master, when the attempt spans several nodes) GLOO/NCCL_SOCKET_IFNAME
              name the interface toward it, unless set
    stop      {attempt, grace}
    free_port {req, port, range}    (0: pick one; a port: check it; range [lo, hi]: the
                                     first free one of it)
    listen    {req, port}           (preflight: hold a listening socket)
    probe     {req, address, port}  (preflight: route and TCP reachability toward the master)
    shutdown  {}                    stop the workers, remove the agent's state, exit
    sync_missing {req, blobs}       which of these sha256 blobs the node's cache lacks
    sync_put  {req, sha, offset, data (base64), last}   one chunk of a blob
    sync_build {req, tree, files: [[path, sha, executable]], keep}   build the tree, prune
    setup     {req, key, script, workdir, env}   run once per key (cached when it succeeds)
    stacks    {req, timeout}        every live rank's stack (py-spy, else faulthandler)

Agent -> controller (``type``). *Sequenced* messages carry ``seq`` (1, 2, ...) and are kept
by the agent until acknowledged, spooled to disk while no controller is attached, and
replayed in order on the next ``attach``. The others are only meaningful live::

    hello        {protocol, hostname, python, torch, gpus, pid, attempt, last_seq,
                  workers: [{rank, local_rank, pid, running}], spooled_bytes}   (live)
    heartbeat    {attempt}                                                      (live)
    progress     {attempt, ranks: {rank: {step, metrics, at}}}   workers called
                 heartbeat() (ORCHESTRATOR_HEARTBEAT_FILE); step/metrics when given    (live)
    port / listening / probe / sync_missing / sync_put / sync_built / setup_done
                 {req, ...}   replies to requests                                    (live)
    setup_output {lines}      the setup script's output while it runs                (live)
    failed       {req, error} the reply to a request that could not be carried out  (live)
    started      {seq, attempt, rank, local_rank, pid}
    spawn_failed {seq, attempt, rank, local_rank, error}
    output       {seq, attempt, rank, stream, lines: [...]}   many lines of one rank
    exited       {seq, attempt, rank, local_rank, exit_code, signal, error_file, at}
    stopped      {seq, attempt}
    dropped      {seq, attempt, rank, stream, lines}   lines the full spool could not keep
    error        {seq, attempt, message}
    detached / gave_up are never sent: they are what the agent writes in its spool.

An agent's ``exited`` for a rank always comes after every output line of that rank.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

VERSION = 3

# Controller -> relay / agent.
CONNECT = "connect"
HOLD = "hold"  # Slurm: be this node's holder step (agents/holder.py)
ATTACH = "attach"
ACK = "ack"
PING = "ping"
START = "start"
STOP = "stop"
FREE_PORT = "free_port"
LISTEN = "listen"
PROBE = "probe"
SHUTDOWN = "shutdown"
SYNC_MISSING = "sync_missing"
SYNC_PUT = "sync_put"
SYNC_BUILD = "sync_build"
SETUP = "setup"
STACKS_OP = "stacks"  # {timeout, flight_recorder?: bool}: also dump the flight recorders
READ_TRACE = "read_trace"  # {path, offset}: a piece of a flight recorder dump

# Relay -> controller.
RELAY = "relay"
HOLDING = "holding"  # a holder step serves (or waits on standby) on its node
GONE = "gone"

# Agent -> controller.
HELLO = "hello"
HEARTBEAT = "heartbeat"
PROGRESS = "progress"
PORT = "port"
LISTENING = "listening"
PROBE_RESULT = "probe"
SYNC_BUILT = "sync_built"
SETUP_OUTPUT = "setup_output"
SETUP_DONE = "setup_done"
FAILED = "failed"  # the reply to a request whose op raised: {req, error}
STACKS = "stacks"  # {req, stacks: {rank: {method, text, error?}}, traces: {rank: path}}
TRACE_CHUNK = "trace_chunk"  # {req, data (base64), size}
STARTED = "started"
SPAWN_FAILED = "spawn_failed"
OUTPUT = "output"
EXITED = "exited"
STOPPED = "stopped"
DROPPED = "dropped"
ERROR = "error"

#: Messages replayed after a dropped channel; the rest only matter while attached.
SEQUENCED = frozenset({STARTED, SPAWN_FAILED, OUTPUT, EXITED, STOPPED, DROPPED, ERROR})

MAX_MESSAGE = 4 * 1024 * 1024  # one JSON line; an output batch is cut well below this
MAX_LINE = 8192  # bytes of one worker output line; longer lines are split
BATCH_BYTES = 64 * 1024  # an output message holds up to this many bytes of lines
BATCH_DELAY = 0.005  # seconds a partial batch may wait for more lines
WINDOW_BYTES = 4 * 1024 * 1024  # unacknowledged bytes an agent may have in flight


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line. Non-ASCII stays UTF-8 (fewer bytes than \\u escapes)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any] | None:
    """A JSON line as a message, or None for anything that is not a JSON object (e.g. a
    login banner printed on an SSH channel)."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


_OPT_INT = (int, None)
_OPT_STR = (str, None)
# The fields a controller relies on, per message type: an agent (or anything pretending to
# be one) that sends something else is out of protocol, and is not trusted any further.
_FIELDS: dict[str, dict[str, Any]] = {
    HELLO: {"protocol": int, "pid": int, "attempt": int, "workers": list},
    STARTED: {"attempt": int, "rank": _OPT_INT, "local_rank": int, "pid": int},
    SPAWN_FAILED: {"attempt": int, "rank": _OPT_INT, "local_rank": int, "error": str},
    OUTPUT: {"attempt": int, "rank": _OPT_INT, "stream": str, "lines": list},
    EXITED: {"attempt": int, "rank": _OPT_INT, "local_rank": int, "exit_code": _OPT_INT,
             "signal": _OPT_STR, "error_file": _OPT_STR},
    STOPPED: {"attempt": int},
    DROPPED: {"attempt": int, "rank": _OPT_INT, "stream": str, "lines": int},
    ERROR: {"message": str},
    SETUP_OUTPUT: {"lines": list},
    TRACE_CHUNK: {"data": str, "size": int},
}


def _is(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is None and value is None:
            return True
        if k is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k in (str, list) and isinstance(value, k):
            return True
    return False


def check(message: dict[str, Any]) -> str | None:
    """What is wrong with an agent's message, or None when it has the fields its type needs
    with the right types (``seq`` too, when present)."""
    kind = message.get("type")
    if not isinstance(kind, str):
        return "no message type"
    if "seq" in message and not _is(message["seq"], int):
        return f"{kind}: seq is not an integer"
    for name, expected in _FIELDS.get(kind, {}).items():
        if not _is(message.get(name), expected):
            return f"{kind}: bad {name} {str(message.get(name))[:40]!r}"
    if kind in (OUTPUT, SETUP_OUTPUT):
        try:
            "".join(message["lines"])  # every line is text (checked at C speed: floods)
        except TypeError:
            return "output: lines must be text"
    return None


def connect(job_id: str, node_index: int, launch: dict[str, Any] | None) -> dict[str, Any]:
    return {"op": CONNECT, "job_id": job_id, "node_index": node_index, "launch": launch}


def attach(secret: str, ack: int) -> dict[str, Any]:
    return {"op": ATTACH, "secret": secret, "ack": ack}


class Mailbox:
    """Request/reply over a message stream: requests get an id (``req``), and the one reader
    of the stream hands every message to :meth:`deliver`, which keeps replies aside for the
    thread waiting in :meth:`ask`. Replies therefore never wait behind other messages."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._next = 0
        self.closed = False

    def request(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        """A new request message and its id."""
        with self._cond:
            self._next += 1
            return self._next, {"op": op, "req": self._next, **fields}

    def deliver(self, message: dict[str, Any] | None) -> bool:
        """Keep ``message`` if it is a reply; None (the stream ended) wakes every waiter.
        Returns True when the message was taken."""
        with self._cond:
            if message is None:
                self.closed = True
                self._cond.notify_all()
                return False
            req = message.get("req")
            if not isinstance(req, int) or isinstance(req, bool):
                return False
            self._replies[req] = message
            self._cond.notify_all()
            return True

    def wait(self, req: int, timeout: float | None) -> dict[str, Any] | None:
        """The reply to ``req``, or None on timeout (None: no timeout) or when the stream
        ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while req not in self._replies:
                left = 60.0 if deadline is None else deadline - time.monotonic()
                if self.closed or left <= 0:
                    return None
                self._cond.wait(left)
            return self._replies.pop(req)
