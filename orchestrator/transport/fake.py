"""A testing transport, public like httpx's MockTransport: in-process fake agents that speak
the real protocol over real sockets, for the policy tests and for running the real controller
against thousands of simulated nodes (``benchmarks/bench_scale.py``). Nothing in the product
imports it.

A :class:`FakeAgent` is a NodeConnection whose "agent" answers from a script, in the thread
that sends to it, writing encoded lines into a socketpair that the controller's event loop
reads like any channel; a :class:`FakeCluster` is a connection factory that keeps one agent
per host, which outlives each connection to it (:class:`FakeLink`) and replays what was not
acknowledged when one attaches again, and, on one driver thread for all of them, sends what
real agents send unprompted: heartbeats every ``min(heartbeat_interval, 0.5)`` s unless
something else was said within it (as ``agents/agent.py`` does) and numbered output lines at
a rate per rank. It can silence a node (a host that died: no message, no reply, no new
connection), starve one for a while (no message; a new connection slow to come up) and end
every running worker. What a fake agent says goes into a buffer first and into the socket
as far as it has room (the driver flushes the channels that have some left): a controller
that is behind never blocks the fakes.

Exits are scripted per attempt and rank: ``exits[attempt][rank]`` is an exit code, a
signal name, or None (runs until stopped, or until :meth:`FakeCluster.finish`). Missing
attempts exit 0 at once, unless the cluster says workers run (``FakeCluster(run=True)``).
"""

from __future__ import annotations

import heapq
import itertools
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from agents import commands as C
from agents import protocol as P
from agents.protocol import encode
from orchestrator.errors import ConnectError
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import Framer

_pids = itertools.count(10_000)


class Wire:
    """One channel: a socketpair whose far end the fake agent writes to (buffered, never
    blocking), and whose near end the controller reads (``fileno``, ``read``)."""

    def __init__(self, on_backlog: Callable[[Wire], None] | None = None) -> None:
        self.near, self.far = socket.socketpair()
        for s in (self.near, self.far):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
        self.far.setblocking(False)
        self._pending = bytearray()
        self._lock = threading.Lock()
        self._ending = False
        self.framer = Framer()
        # Told when bytes are left waiting for room (the cluster's driver flushes them later).
        self.on_backlog = on_backlog

    def put(self, message: dict[str, Any] | None) -> None:
        """A message to the controller; None: the agent's end closes (after what is queued)."""
        with self._lock:
            if message is None:
                self._ending = True
            elif not self._ending:
                self._pending += encode(message)
            self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            try:
                sent = self.far.send(self._pending)
            except BlockingIOError:
                if self.on_backlog is not None:
                    self.on_backlog(self)
                return
            except OSError:
                self._pending.clear()
                return
            del self._pending[:sent]
        if self._ending:
            try:
                self.far.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def fileno(self) -> int:
        return self.near.fileno()

    def read(self) -> bytes:
        try:
            return self.near.recv(65536)
        except OSError:
            return b""

    def close(self) -> None:
        for s in (self.near, self.far):
            try:
                s.close()
            except OSError:
                pass


class Nowhere(Wire):
    """No channel attached: what the agent says is dropped (its unacknowledged messages are
    kept by the agent itself, and replayed on the next attach)."""

    def __init__(self) -> None:  # no sockets
        self.framer = Framer()

    def put(self, message: dict[str, Any] | None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class FakeWorker:
    rank: int
    local_rank: int
    attempt: int
    pid: int
    lines: int = 0  # output lines sent so far (numbered from 0)


class FakeAgent:
    """One node's agent, answering on its channel from a script (see the module doc)."""

    def __init__(self, host: str, exits: dict[int, dict[int, Any]] | None = None,
                 log: list[Any] | None = None, cluster: FakeCluster | None = None):
        self.host = host
        self.exits = exits or {}
        self.log = log
        self.cluster = cluster
        # Its channel; a FakeCluster's agent has none until a link opens (the last one wins).
        self.wire: Wire = Nowhere() if cluster is not None else Wire()
        # Sequenced messages the controller has not acknowledged: replayed on the next attach,
        # as a real agent replays its spool.
        self.unacked: deque[dict[str, Any]] = deque()
        self.running: dict[int, FakeWorker] = {}  # rank -> worker of the current attempt
        self.attempt = 0
        self.seq = 0
        self.lock = threading.Lock()  # the driver thread and the controller's both send
        self.attached = False
        self.launched = False  # a relay started this agent once (a later one finds it)
        self.dead = False  # a silenced node: says nothing, answers nothing
        # A busy node (starved of CPU) until then, monotonic: says nothing meanwhile, and a
        # connection opened to it is up ``relay_s`` after it (a relay started on a loaded
        # node), while the one it has keeps working.
        self.busy_until = 0.0
        self.relay_s = 0.0
        self.said_at = 0.0  # monotonic: when it last said anything
        self.instance = f"fake-{next(_pids)}"
        self.pid = next(_pids)
        # Faults for the policy tests.
        self.fail_open = False
        self.protocol = P.VERSION
        self.gpus = 0
        self.check_problems: list[str] = []  # what its health checks find (none: healthy)
        self.malformed = False
        self.drop_port = False
        # Rewrites (or drops: None) what it says, as a broken or hostile agent would.
        self.tamper: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
        self.stacks: dict[str, Any] = {}  # what a stacks request is answered

    # --- NodeConnection --------------------------------------------------------------------
    @property
    def framer(self) -> Framer:
        return self.wire.framer

    def open(self) -> None:
        if self.fail_open or self.dead:
            raise ConnectError(self.host, "connection refused")
        wait = self.busy_until - time.monotonic()
        if wait > 0:
            time.sleep(wait + self.relay_s)

    @property
    def quiet(self) -> bool:
        """Says nothing now: dead, or busy."""
        return self.dead or time.monotonic() < self.busy_until

    def fileno(self) -> int:
        return self.wire.fileno()

    def read(self) -> bytes:
        return self.wire.read()

    def close(self) -> None:
        self.attached = False
        self.wire.close()

    def send(self, message: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.append((self.host, message))
        if self.dead:
            return
        command, req = C.parse(message)  # through the agent's own door
        with self.lock:
            handler = getattr(self, f"_op_{command.OP}", None)
            if handler is not None:
                handler(command, req)
            self.wire.flush()

    # --- what the agent says ------------------------------------------------------------------
    def _emit(self, message: dict[str, Any]) -> None:
        """Put a message on the channel (the caller holds ``lock``); sequenced ones are
        numbered like a real agent's, so the controller's acks and gap checks run."""
        if message["type"] in P.SEQUENCED:
            self.seq += 1
            message["seq"] = self.seq
            self.unacked.append(message)
        self._say(message)

    def _op_connect(self, command: C.Connect, req: None) -> None:
        self._say({"type": P.RELAY, "launched": not self.launched})
        self.launched = True

    def _op_attach(self, command: C.Attach, req: None) -> None:
        self.attached = True
        workers = [{"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid, "running": True}
                   for w in self.running.values()]
        self._say({"type": P.HELLO, "attempt": self.attempt, "hostname": self.host,
                   "protocol": self.protocol, "workers": workers, "pid": self.pid,
                   "instance": self.instance, "last_seq": self.seq, "gpus": self.gpus})
        for old in self.unacked:
            if old["seq"] > command.ack:
                self._say(old)

    def _op_ack(self, command: C.Ack, req: None) -> None:
        while self.unacked and self.unacked[0]["seq"] <= command.seq:
            self.unacked.popleft()

    def _op_free_port(self, command: C.FreePort, req: int) -> None:
        if self.drop_port:
            self.wire.put(None)  # the channel breaks before the reply
        else:
            self._say({"type": P.PORT, "req": req, "port": 29500, "ok": True})

    def _op_node_check(self, command: C.CheckNode, req: int) -> None:
        # The script's verdict (healthy unless told): a fake node runs no command.
        self._say({"type": P.CHECKED, "req": req, "problems": list(self.check_problems),
                   "tail": []})

    def _op_stacks(self, command: C.GetStacks, req: int) -> None:
        self._say({"type": P.STACKS, "req": req, "stacks": self.stacks, "traces": {}})

    def _say(self, message: dict[str, Any]) -> None:
        if self.tamper is not None:
            changed = self.tamper(dict(message))
            if changed is None:
                return
            message = changed
        self.wire.put(message)
        self.said_at = time.monotonic()

    def _op_start(self, command: C.Start, req: None) -> None:
        self.attempt = a = command.attempt
        self.running = {}
        if self.malformed:  # fields of the wrong type, as a broken or hostile agent might
            self._emit({"type": P.STARTED, "attempt": a, "rank": "zero", "local_rank": 0,
                        "pid": "1234; rm -rf /"})
            return
        workers = command.workers
        pids = {w.rank: next(_pids) for w in workers}
        for w in workers:
            self._emit({"type": P.STARTED, "attempt": a, "rank": w.rank,
                        "local_rank": w.local_rank, "pid": pids[w.rank]})
        runs = self.cluster is not None and self.cluster.run
        for w in workers:
            rank = cast(int, w.rank)  # fakes give every worker its rank
            outcome = self.exits.get(a, {}).get(rank, None if runs else 0)
            if outcome is None:
                self.running[rank] = FakeWorker(rank, w.local_rank, a, pids[rank])
                continue
            code, sig = (outcome, None) if isinstance(outcome, int) else (None, outcome)
            self._emit({"type": P.OUTPUT, "attempt": a, "rank": w.rank,
                        "stream": "stderr", "lines": [f"boom {w.rank}"]})
            self._emit({"type": P.EXITED, "attempt": a, "rank": w.rank,
                        "local_rank": w.local_rank, "exit_code": code, "signal": sig,
                        "error_file": None})

    def _op_stop(self, command: C.Stop, req: None) -> None:
        a = self.attempt if command.attempt is None else command.attempt
        if a == self.attempt:
            for w in self.running.values():
                self._emit({"type": P.EXITED, "attempt": a, "rank": w.rank,
                            "local_rank": w.local_rank, "exit_code": None,
                            "signal": "SIGTERM", "error_file": None})
            self.running = {}
        self._emit({"type": P.STOPPED, "attempt": a})

    def _op_shutdown(self, command: C.Shutdown, req: None) -> None:
        self.running = {}
        self.attached = False
        self.wire.put(None)  # the agent exits: its channel closes

    # --- driven by FakeCluster (under ``lock``) -----------------------------------------------
    def beat(self, every: float) -> None:
        """A heartbeat, unless it said something else within ``every`` (agents/agent.py,
        at the cluster's ticks: a real agent's is due ``every`` after its last message)."""
        if self.attached and not self.quiet and time.monotonic() - self.said_at >= every:
            self._say({"type": P.HEARTBEAT, "attempt": self.attempt})

    def print_lines(self, worker: FakeWorker, upto: int) -> None:
        """Numbered lines up to ``upto`` (exclusive), one output message."""
        if self.quiet or upto <= worker.lines or self.running.get(worker.rank) is not worker:
            return
        lines = [f"line {i}" for i in range(worker.lines, upto)]
        worker.lines = upto
        self._emit({"type": P.OUTPUT, "attempt": worker.attempt, "rank": worker.rank,
                    "stream": "stdout", "lines": lines})

    def finish(self) -> None:
        """Every running worker exits 0."""
        if self.dead:
            return
        for w in self.running.values():
            self._emit({"type": P.EXITED, "attempt": w.attempt, "rank": w.rank,
                        "local_rank": w.local_rank, "exit_code": 0, "signal": None,
                        "error_file": None})
        self.running = {}


class FakeLink:
    """One connection to a FakeCluster's agent, which outlives it as a real agent daemon
    outlives its SSH session: the agent speaks on the link last opened; what it says while
    none is attached is replayed from its unacknowledged messages on the next attach."""

    def __init__(self, agent: FakeAgent):
        self.agent = agent
        self.host = agent.host
        self.wire = Wire(agent.cluster.backlog if agent.cluster is not None else None)
        self.framer = self.wire.framer

    def open(self) -> None:
        agent = self.agent
        agent.open()
        with agent.lock:
            agent.wire = self.wire

    def fileno(self) -> int:
        return self.wire.fileno()

    def read(self) -> bytes:
        return self.wire.read()

    def send(self, message: dict[str, Any]) -> None:
        if self.agent.wire is self.wire:  # a link left behind says nothing more
            self.agent.send(message)

    def close(self) -> None:
        agent = self.agent
        with agent.lock:
            if agent.wire is self.wire:
                agent.attached = False
                agent.wire = Nowhere()  # nobody listens: its unacked messages are kept
        self.wire.close()


class FakeCluster:
    """A connection factory of FakeAgents (one per host) and the driver thread that sends
    their heartbeats and their workers' output.

    ``lines_per_s``: output lines per second per running rank, each its own message (lines
    printed that far apart travel apart in a real agent too). ``run``: workers run until
    stopped or :meth:`finish`, instead of exiting 0 at once.
    """

    def __init__(self, *, heartbeat_interval: float = 1.0, lines_per_s: float = 0.0,
                 run: bool = False, exits: dict[str, dict[int, dict[int, Any]]] | None = None,
                 log: list[Any] | None = None, seed: int = 0):
        self.beat_every = min(heartbeat_interval, 0.5)
        self.lines_per_s = lines_per_s
        self.run = run
        self.exits = exits or {}
        self.log = log
        self.agents: dict[str, FakeAgent] = {}
        self.sent_lines: dict[tuple[int, int], int] = {}  # (attempt, rank) -> lines printed
        self._random = random.Random(seed)
        # (when, order, "beat" or "print", host): plain tuples, compared in C (thousands of
        # pushes a second with thousands of nodes).
        self._heap: list[tuple[float, int, str, str]] = []
        self._backlog: set[Wire] = set()  # channels with bytes waiting for room
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.cpu_s = 0.0  # CPU time of the driver thread (not the controller's)
        self._thread = threading.Thread(target=self._drive, daemon=True, name="fake-cluster")
        self._thread.start()

    def __call__(self, node: NodeSpec, spec: JobSpec) -> FakeLink:
        with self._lock:
            agent = self.agents.get(node.host)
            if agent is None:  # one agent per host, for the whole job
                agent = FakeAgent(node.host, self.exits.get(node.host, {}), self.log, self)
                self.agents[node.host] = agent
                # Heartbeats spread over the interval, as independent agents' are.
                self._push(time.monotonic() + self._random.random() * self.beat_every,
                           "beat", node.host)
                if self.lines_per_s > 0:
                    self._push(time.monotonic() + self._random.random() / self.lines_per_s,
                               "print", node.host)
        return FakeLink(agent)

    def _push(self, at: float, kind: str, host: str) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, host))

    def backlog(self, wire: Wire) -> None:
        """``wire`` has bytes waiting for room in its socket: the driver flushes it."""
        with self._lock:
            self._backlog.add(wire)

    def _drive(self) -> None:
        start_cpu = time.thread_time()
        while not self._stop.is_set():
            now = time.monotonic()
            due: list[tuple[float, int, str, str]] = []
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap))
                wait = (self._heap[0][0] - now) if self._heap else 0.05
                waiting, self._backlog = self._backlog, set()
            for wire in waiting:  # what waited for room in a socket (still full: told again)
                wire.flush()
            for at, _, kind, host in due:
                agent = self.agents[host]
                with agent.lock:
                    if kind == "beat":
                        agent.beat(self.beat_every)
                        nxt = at + self.beat_every
                    else:
                        for w in list(agent.running.values()):
                            agent.print_lines(w, w.lines + 1)
                            self.sent_lines[(w.attempt, w.rank)] = w.lines
                        nxt = at + 1.0 / self.lines_per_s
                with self._lock:
                    self._push(max(nxt, now), kind, host)
            self.cpu_s = time.thread_time() - start_cpu
            self._stop.wait(min(max(wait, 0.001), 0.05))

    # --- faults and the end ----------------------------------------------------------------
    def kill(self, host: str) -> None:
        """The host dies: its agent goes silent, and no connection to it opens again."""
        agent = self.agents[host]
        with agent.lock:
            agent.dead = True

    def stall(self, host: str, seconds: float, relay_s: float) -> None:
        """The host is starved for ``seconds``: its agent says nothing, and a new connection
        to it is up ``relay_s`` after that (see FakeAgent.busy_until)."""
        agent = self.agents[host]
        with agent.lock:
            agent.busy_until, agent.relay_s = time.monotonic() + seconds, relay_s

    def finish(self) -> None:
        """Every running worker of every live agent exits 0 (after its lines so far)."""
        for agent in list(self.agents.values()):
            with agent.lock:
                for w in agent.running.values():
                    self.sent_lines[(w.attempt, w.rank)] = w.lines
                agent.finish()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
