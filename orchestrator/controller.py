"""The controller: one process per job, the only writer of the job's state.

It connects to every node's agent, plans each attempt, starts the workers, watches every
message, and applies the restart policy in one loop (:meth:`Controller.run`):

    connect agents ─> attempt n: pick port, plan, start ─> watch ─┬─> all ranks exit 0: SUCCEEDED
                                ▲                                 └─> failure / node lost / hang:
                                └── backoff <─ RESTARTING <─ budget left? <─ stop every worker
                                                                └─ no: FAILED (root cause kept)

Cancel is checked everywhere the loop waits, so it wins in every phase.
Run it as ``python -m orchestrator.controller JOB_ID`` (``submit`` does).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from orchestrator.errors import OrchestratorError, TransportError
from orchestrator.plan import TORCHRUN_LINE_RE, LaunchPlan, plan_attempt
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.state import FailureCause, JobState, NodeState
from orchestrator.store import Store
from orchestrator.transport import default_connect
from orchestrator.transport.base import ConnectionFactory, NodeConnection

log = logging.getLogger("orchestrator.controller")

STDERR_TAIL = 20  # lines of a failing rank's stderr kept for the failure message
POLL = 0.05  # seconds between checks of the cancel flag and timeouts when nothing arrives
STOP_MARGIN = 10.0  # beyond the grace period, how long stopping may take before a node is LOST
MAX_BATCH = 2000  # messages handled between two checks of cancel and health


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
        d = dict(self.__dict__)
        d["cause"] = self.cause.value
        return d


@dataclass
class Node:
    """The controller's live view of one spec node."""

    index: int
    spec: NodeSpec
    conn: NodeConnection | None = None
    state: NodeState = NodeState.PENDING
    last_heard: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    node_rank: int | None = None
    reconnecting: bool = False

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.state not in (NodeState.LOST, NodeState.FAILED)


class Cancelled(Exception):
    """Raised inside the loop when a cancel request is seen."""


class LogSink:
    """Writes each rank's output to its log files and keeps its last stderr lines."""

    def __init__(self, directory: Path):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        self._combined = open(directory / "combined.log", "a", encoding="utf-8", buffering=1)
        self._files: dict[str, IO[str]] = {}
        self.stderr: dict[str, deque[str]] = {}
        self.last_activity = time.monotonic()  # output, or a worker's heartbeat()

    def write(self, host: str, label: str, stream: str, line: str) -> None:
        f = self._files.get(label)
        if f is None:
            f = self._files[label] = open(self.directory / f"rank-{label}.log", "a",
                                          encoding="utf-8", buffering=1)
        f.write(line + "\n")
        self._combined.write(f"[{host}:{label}] {line}\n")
        if stream == "stderr":
            self.stderr.setdefault(label, deque(maxlen=STDERR_TAIL)).append(line)
        self.last_activity = time.monotonic()

    def close(self) -> None:
        for f in [*self._files.values(), self._combined]:
            f.close()


class Controller:
    """Runs one job to a terminal state. ``connect`` builds a transport per node."""

    def __init__(self, store: Store, job_id: str, spec: JobSpec, spec_dir: str,
                 connect: ConnectionFactory = default_connect):
        self.store = store
        self.job_id = job_id
        self.spec = spec
        self.spec_dir = spec_dir
        self.connect = connect
        self.nodes = [Node(i, n) for i, n in enumerate(spec.nodes)]
        # (node index, the connection it came on, message or None at EOF); index -1 wakes up.
        # SimpleQueue, because request_cancel() puts from a signal handler.
        self.events: queue.SimpleQueue[tuple[int, Any, dict[str, Any] | None]] = \
            queue.SimpleQueue()
        self.cancel_requested = False
        self._last_tick = time.monotonic()
        self.state = JobState.PENDING
        self.attempt = 0
        self.restarts = 0
        self._next_cancel_check = 0.0
        # Per-attempt bookkeeping, reset by _run_attempt.
        self.plan: LaunchPlan | None = None
        self.sink: LogSink | None = None
        self.failure: Failure | None = None
        self.stopping = False
        self.attempt_open = False
        self.rank_exits: dict[int, tuple[int | None, str | None]] = {}
        self.started: set[tuple[int, int]] = set()  # (node_index, local_rank)
        self.stopped_nodes: set[int] = set()
        self.port_reply: dict[str, Any] | None = None

    # --- the restart policy: one loop ---------------------------------------------------
    def run(self) -> JobState:
        threading.Thread(target=self._ping_agents, daemon=True).start()
        try:
            final, fields = self._supervise()
        except Cancelled:
            self._stop_workers()
            self._end_attempt("CANCELLED", None)
            final, fields = JobState.CANCELLED, {}
        except _LaunchFailed as exc:
            self._stop_workers()
            self._end_attempt("FAILED", exc.failure)
            final, fields = JobState.FAILED, {"failure": exc.failure.to_dict()}
        except BaseException as exc:  # a bug or an unexpected OS error: never leave RUNNING
            log.exception("controller error")
            failure = Failure(FailureCause.LAUNCH_FAILED, f"controller error: {exc!r}")
            try:
                self._stop_workers()
            finally:
                final, fields = JobState.FAILED, {"failure": failure.to_dict()}
        # Agents are shut down before the terminal state is written: whoever sees the job
        # ended also sees every node done.
        self._shutdown()
        self._set_state(final, **fields)
        return self.state

    def _supervise(self) -> tuple[JobState, dict[str, Any]]:
        """The restart policy. Returns the terminal state to record, and its fields."""
        self._set_state(JobState.LAUNCHING, started_at=time.time())
        self._connect_nodes()
        while True:
            self._check_cancel()
            outcome = self._run_attempt(self._participants())
            if outcome is None:
                self._end_attempt("SUCCEEDED", None)
                return JobState.SUCCEEDED, {}
            self._stop_workers()
            self._end_attempt("FAILED", outcome)
            if not self._may_restart(outcome):
                return JobState.FAILED, {"failure": self._final_failure(outcome)}
            self.restarts += 1
            # Persisted before acting, so a crash here never grants a free restart.
            self._set_state(JobState.RESTARTING, restarts=self.restarts)
            self._reconnect_lost()
            self._sleep(self._backoff())
            self._set_state(JobState.LAUNCHING)

    def _end_attempt(self, outcome: str, failure: Failure | None) -> None:
        if self.attempt_open:
            self.attempt_open = False
            self.store.end_attempt(self.job_id, self.attempt, outcome,
                                   failure.to_dict() if failure else None)

    def _may_restart(self, failure: Failure) -> bool:
        if failure.exit_code is not None and failure.exit_code in self.spec.fail_on_exit_codes:
            return False
        if failure.cause == FailureCause.LAUNCH_FAILED:
            return False
        return self.restarts < self.spec.max_restarts

    def _final_failure(self, failure: Failure) -> dict[str, Any]:
        """The job's failure: the last attempt's first failure, as ``root_cause``; the cause
        is RESTARTS_EXHAUSTED when a restart budget was spent on it."""
        d = failure.to_dict()
        d["root_cause"] = d["cause"]
        d["restarts_exhausted"] = (
            self.spec.max_restarts > 0 and self.restarts >= self.spec.max_restarts
        )
        if d["restarts_exhausted"]:
            d["cause"] = FailureCause.RESTARTS_EXHAUSTED.value
            d["message"] += f" (after {self.restarts} restart(s), max_restarts reached)"
        return d

    def _backoff(self) -> float:
        b = self.spec.restart_backoff
        return float(min(b.max, b.initial * 2 ** (self.restarts - 1)))

    # --- state -----------------------------------------------------------------------------
    def _set_state(self, new: JobState, **fields: Any) -> None:
        self.store.set_state(self.job_id, new, **fields)
        self.state = new
        log.info("job %s -> %s", self.job_id, new.value)

    def _set_node(self, node: Node, state: NodeState, **fields: Any) -> None:
        node.state = state
        self.store.set_node(self.job_id, node.index, state, **fields)

    # --- connecting ----------------------------------------------------------------------
    def _open_node(self, node: Node) -> None:
        """Start a node's agent and send it init; its hello arrives through the event queue."""
        conn = self.connect(node.spec, self.spec)
        conn.open()
        node.last_heard = time.monotonic()
        node.conn = conn
        threading.Thread(target=self._read, args=(node.index, conn), daemon=True).start()
        conn.send({"op": "init", "job_id": self.job_id, "node_index": node.index,
                   "heartbeat_interval": self.spec.health.heartbeat_interval,
                   "peer_timeout": self.spec.health.node_timeout})

    def _connect_nodes(self) -> None:
        """Start every agent in parallel and wait for their hello. Fewer than ``min_nodes``
        answering fails the launch, naming the first node that did not."""
        errors: dict[int, str] = {}
        pool = ThreadPoolExecutor(max_workers=min(32, len(self.nodes)))
        futures = {pool.submit(self._open_node, n): n for n in self.nodes}
        try:
            pending = set(futures)
            while pending:  # connecting can take connect_timeout: cancel must still win
                _, pending = futures_wait(pending, timeout=POLL)
                self._last_tick = time.monotonic()
                self._check_cancel()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        for fut, node in futures.items():
            exc = fut.exception()
            if isinstance(exc, OrchestratorError):
                errors[node.index] = str(exc)
            elif exc is not None:
                errors[node.index] = f"{node.spec.host}: {exc!r}"

        waiting = {n.index for n in self.nodes if n.index not in errors}
        deadline = time.monotonic() + self.spec.launch_timeout
        while waiting:
            if time.monotonic() > deadline:
                for i in waiting:
                    errors[i] = f"{self.nodes[i].spec.host}: agent did not answer within " \
                                f"{self.spec.launch_timeout:g}s"
                break
            self._pump(POLL)
            self._check_cancel()
            for i in list(waiting):
                node = self.nodes[i]
                if node.state == NodeState.CONNECTED:
                    waiting.discard(i)
                elif node.state == NodeState.LOST:
                    tail = list(getattr(node.conn, "stderr_tail", []) or [])[-3:]
                    errors[i] = f"{node.spec.host}: agent exited before saying hello" + (
                        ": " + " | ".join(tail) if tail else "")
                    waiting.discard(i)
        for i, message in errors.items():
            node = self.nodes[i]
            if node.conn is not None:
                node.conn.close()
                node.conn = None
            self._set_node(node, NodeState.FAILED, info={"error": message})
        if len(self.nodes) - len(errors) < self.spec.min_nodes:
            first = min(errors)
            raise _LaunchFailed(Failure(FailureCause.LAUNCH_FAILED, errors[first], node_index=first,
                                        host=self.nodes[first].spec.host))

    def _reconnect_lost(self) -> None:
        """Try again, in the background, nodes that were lost or never came up: those whose
        agent says hello before an attempt starts take part in it (they rejoin)."""
        for node in self.nodes:
            if not node.connected and not node.reconnecting:
                node.reconnecting = True
                threading.Thread(target=self._reopen, args=(node,), daemon=True).start()

    def _reopen(self, node: Node) -> None:
        old, node.conn = node.conn, None
        if old is not None:
            old.close()
        try:
            self._open_node(node)
        except Exception as exc:  # still unreachable: it may answer at a later attempt
            log.info("%s: not back yet: %s", node.spec.host, exc)
        finally:
            node.reconnecting = False

    def _participants(self) -> list[Node]:
        """The first ``max_nodes`` healthy nodes; waits up to launch_timeout for lost nodes
        to rejoin while fewer than ``min_nodes`` are healthy."""
        deadline = time.monotonic() + self.spec.launch_timeout
        while (sum(n.connected for n in self.nodes) < self.spec.min_nodes
               and any(n.reconnecting for n in self.nodes) and time.monotonic() < deadline):
            self._pump(POLL)
            self._check_cancel()
        healthy = [n for n in self.nodes if n.connected]
        if len(healthy) < self.spec.min_nodes:
            raise _LaunchFailed(Failure(
                FailureCause.NODE_FAIL,
                f"only {len(healthy)} healthy node(s), fewer than the minimum "
                f"{self.spec.min_nodes}",
            ))
        return healthy[: self.spec.max_nodes]

    def _read(self, index: int, conn: NodeConnection) -> None:
        while True:
            try:
                message = conn.receive()
            except Exception:
                message = None
            self.events.put((index, conn, message))
            if message is None:
                return

    # --- one attempt ---------------------------------------------------------------------
    def _run_attempt(self, participants: list[Node]) -> Failure | None:
        """Start attempt n+1 on ``participants`` and watch it; None means every rank succeeded."""
        self.attempt += 1
        self.failure = None
        self.stopping = False
        self.rank_exits = {}
        self.started = set()
        self.stopped_nodes = set()
        for node in self.nodes:
            node.node_rank = None
        if self.sink:
            self.sink.close()
        self.sink = LogSink(self.store.log_dir(self.job_id, self.attempt))

        port = self._pick_port(participants[0])
        plan = plan_attempt(
            self.spec, self.job_id, attempt=self.attempt, restart_count=self.restarts,
            master_port=port, node_indices=[n.index for n in participants],
            spec_dir=self.spec_dir,
        )
        self.plan = plan
        ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers
                 if w.rank is not None]
        self.store.start_attempt(self.job_id, self.attempt, plan.master_addr, port or 0,
                                 plan.world_size, ranks)
        self.attempt_open = True
        for node_plan in plan.nodes:
            node = self.nodes[node_plan.node_index]
            node.node_rank = node_plan.node_rank
            self._set_node(node, NodeState.RUNNING, node_rank=node_plan.node_rank)
            self._send(node, {
                "op": "start", "attempt": self.attempt, "workdir": node_plan.workdir,
                "master_addr": plan.master_addr, "env": node_plan.env,
                "workers": [w.to_message() for w in node_plan.workers],
                "stop_grace": self.spec.stop_grace_period,
            })

        expected = sum(len(n.workers) for n in plan.nodes)
        launch_deadline = time.monotonic() + self.spec.launch_timeout
        while self.failure is None:
            self._pump(POLL)
            self._check_cancel()
            self._check_health()
            if self.state == JobState.LAUNCHING and time.monotonic() > launch_deadline:
                self._fail(Failure(FailureCause.LAUNCH_FAILED,
                                   f"only {len(self.started)} of {expected} workers started "
                                   f"within launch_timeout ({self.spec.launch_timeout:g}s)"))
            if self.state == JobState.LAUNCHING and len(self.started) == expected:
                self._set_state(JobState.RUNNING)
            if len(self.rank_exits) == expected and self.failure is None:
                if self.state == JobState.LAUNCHING:
                    self._set_state(JobState.RUNNING)
                return None
        return self.failure

    def _pick_port(self, node: Node) -> int:
        """A master port that node 0 can bind now (the spec's own, if it fixed one)."""
        wanted = self.spec.rendezvous.port
        for _ in range(5):
            self.port_reply = None
            self._send(node, {"op": "free_port", "port": wanted if isinstance(wanted, int) else 0})
            deadline = time.monotonic() + self.spec.launch_timeout
            while self.port_reply is None:
                if time.monotonic() > deadline or not node.connected:
                    raise _LaunchFailed(Failure(FailureCause.LAUNCH_FAILED,
                                                f"{node.spec.host}: no free port reported",
                                                node_index=node.index, host=node.spec.host))
                self._pump(POLL)
                self._check_cancel()
            if self.port_reply.get("ok"):
                return int(self.port_reply["port"])
            if isinstance(wanted, int):
                raise _LaunchFailed(Failure(
                    FailureCause.LAUNCH_FAILED,
                    f"rendezvous.port {wanted} is in use on {node.spec.host}",
                    node_index=node.index, host=node.spec.host))
        raise _LaunchFailed(Failure(FailureCause.LAUNCH_FAILED,
                                    f"{node.spec.host}: could not find a free port"))

    # --- messages --------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle the messages that arrive within ``timeout``: a bounded batch, so that a
        flood of output never keeps the loop from its cancel and health checks."""
        self._last_tick = time.monotonic()
        try:
            index, conn, message = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        for _ in range(MAX_BATCH):
            if index >= 0 and conn is self.nodes[index].conn:  # else: a wake-up, or a stale channel
                self._handle(self.nodes[index], message)
            try:
                index, conn, message = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, node: Node, message: dict[str, Any] | None) -> None:
        index = node.index
        if message is None:
            if node.state not in (NodeState.LOST, NodeState.FAILED, NodeState.DONE):
                self._lose(node, f"{node.spec.host}: agent connection closed")
            return
        node.last_heard = time.monotonic()
        kind = message.get("type")
        if kind == "hello":
            node.info = {k: message.get(k) for k in ("hostname", "python", "torch", "gpus", "pid")}
            self._set_node(node, NodeState.CONNECTED, info=node.info)
            return
        if kind == "port":
            self.port_reply = message
            return
        if kind == "error":
            log.warning("%s: agent error: %s", node.spec.host, message.get("message"))
            return
        if message.get("attempt") != self.attempt:
            return  # a late message of an earlier attempt
        if kind == "output":
            self._on_output(node, message)
        elif kind == "started":
            self._on_started(node, message)
        elif kind == "exited":
            self._on_exited(node, message)
        elif kind == "spawn_failed":
            self._fail(Failure(
                FailureCause.LAUNCH_FAILED if self.attempt == 1 else FailureCause.WORKER_FAILED,
                f"rank {message.get('rank')} on {node.spec.host} could not start: "
                f"{message.get('error')}",
                node_index=index, node_rank=node.node_rank, host=node.spec.host,
                rank=message.get("rank"), local_rank=message.get("local_rank")))
        elif kind == "stopped":
            self.stopped_nodes.add(index)
        elif kind == "progress" and self.sink is not None:
            self.sink.last_activity = time.monotonic()

    def _label(self, node: Node, rank: int | None) -> str:
        return str(rank) if rank is not None else f"node{node.node_rank}"

    def _on_output(self, node: Node, message: dict[str, Any]) -> None:
        assert self.sink is not None
        host = "local" if node.spec.is_local else node.spec.hostname
        rank, line = message.get("rank"), str(message.get("line"))
        if rank is None and (m := TORCHRUN_LINE_RE.match(line)):
            rank, line = int(m.group(1)), line[m.end():]  # a c10d worker's line, via torchrun
        self.sink.write(host, self._label(node, rank), str(message.get("stream")), line)

    def _on_started(self, node: Node, message: dict[str, Any]) -> None:
        self.started.add((node.index, int(message.get("local_rank") or 0)))
        if message.get("rank") is not None:
            self.store.update_rank(self.job_id, self.attempt, int(message["rank"]),
                                   pid=message.get("pid"), state="RUNNING")

    def _on_exited(self, node: Node, message: dict[str, Any]) -> None:
        rank, code, sig = message.get("rank"), message.get("exit_code"), message.get("signal")
        key = rank if rank is not None else -1 - node.index
        self.rank_exits[key] = (code, sig)
        stopping = self.stopping or self.failure is not None
        ok = code == 0
        state = "SUCCEEDED" if ok else ("STOPPED" if stopping else "FAILED")
        if rank is not None:
            self.store.update_rank(self.job_id, self.attempt, int(rank), state=state,
                                   exit_code=code, signal=sig)
        if ok or stopping:
            return
        label = self._label(node, rank)
        who = f"rank {rank}" if rank is not None else f"torchrun on node {node.node_rank}"
        how = f"exited with code {code}" if code is not None else f"was killed by {sig}"
        error_file = message.get("error_file")
        detail = _error_file_message(error_file)
        assert self.sink is not None
        self._fail(Failure(
            FailureCause.WORKER_FAILED,
            f"{who} (local rank {message.get('local_rank')} on node {node.node_rank}, "
            f"{node.spec.host}) {how}" + (f": {detail}" if detail else ""),
            node_index=node.index, node_rank=node.node_rank, host=node.spec.host, rank=rank,
            local_rank=message.get("local_rank"), exit_code=code, signal=sig,
            stderr_tail=list(self.sink.stderr.get(label, [])), error_file=error_file))

    def _fail(self, failure: Failure) -> None:
        """Keep the first failure of the attempt; later ones are its consequences."""
        if self.failure is None:
            log.info("attempt %d failed: %s", self.attempt, failure.message)
            self.failure = failure

    def _lose(self, node: Node, message: str) -> None:
        was_running = node.state == NodeState.RUNNING
        self._set_node(node, NodeState.LOST, info={**node.info, "error": message})
        if node.conn is not None:
            threading.Thread(target=node.conn.close, daemon=True).start()
        node.conn = None
        if was_running and self.failure is None:
            self._fail(Failure(FailureCause.NODE_FAIL, message, node_index=node.index,
                               node_rank=node.node_rank, host=node.spec.host))

    def _send(self, node: Node, message: dict[str, Any]) -> None:
        if node.conn is None:
            return
        try:
            node.conn.send(message)
        except TransportError as exc:
            self._lose(node, str(exc))

    # --- health, cancel, waiting -------------------------------------------------------------
    def _ping_agents(self) -> None:
        """The controller's heartbeat, on its own thread so that no slow step delays it:
        an agent that stops hearing it stops its workers."""
        while not self.state.is_terminal():
            # A wedged main loop must not be kept alive by this thread: then the agents'
            # own timeout stops the workers.
            if time.monotonic() - self._last_tick < self.spec.health.node_timeout:
                for node in self.nodes:
                    conn = node.conn
                    if conn is not None:
                        try:
                            conn.send({"op": "ping"})
                        except Exception:
                            pass  # the reader thread reports the closed channel
            time.sleep(self.spec.health.heartbeat_interval)

    def _check_health(self) -> None:
        now = time.monotonic()
        for node in self.nodes:
            if node.connected and now - node.last_heard > self.spec.health.node_timeout:
                self._lose(node, f"{node.spec.host}: no heartbeat for "
                                 f"{self.spec.health.node_timeout:g}s")
        hang = self.spec.health.hang_timeout
        if (hang and self.sink and self.state == JobState.RUNNING
                and now - self.sink.last_activity > hang and self.failure is None):
            self._fail(Failure(FailureCause.HUNG, f"no output or heartbeat from any rank for "
                                                  f"{hang:g}s (health.hang_timeout)"))

    def _check_cancel(self) -> None:
        now = time.monotonic()
        if now >= self._next_cancel_check:
            self._next_cancel_check = now + 0.25
            if self.store.job_state(self.job_id)[1]:
                self.cancel_requested = True
        if self.cancel_requested:
            raise Cancelled()

    def _sleep(self, seconds: float) -> None:
        """Wait, still answering agents and watching for cancel and lost nodes."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(min(POLL, max(0.0, deadline - time.monotonic())))
            self._check_cancel()
            self._check_health()

    def _stop_workers(self) -> None:
        """Stop every worker of the current attempt on every node and wait until they are gone."""
        live = [n for n in self.nodes if n.connected and n.state == NodeState.RUNNING]
        if not live or self.plan is None:
            return
        self.stopping = True  # exits from here on are our doing, not failures
        grace = self.spec.stop_grace_period
        for node in live:
            self._send(node, {"op": "stop", "attempt": self.attempt, "grace": grace})
        deadline = time.monotonic() + grace + STOP_MARGIN
        while time.monotonic() < deadline:
            waiting = [n for n in live if n.connected and n.index not in self.stopped_nodes]
            if not waiting:
                break
            self._pump(POLL)
            self._check_health()
        for node in live:
            if node.connected and node.index not in self.stopped_nodes:
                self._lose(node, f"{node.spec.host}: workers did not stop in time")
            elif node.connected:
                self._set_node(node, NodeState.STOPPED)

    def _shutdown(self) -> None:
        """Tell every agent to exit and close its channel; in parallel, since closing an SSH
        session waits for the remote exit status."""
        open_nodes = [n for n in self.nodes if n.conn is not None]

        def close(node: Node) -> None:
            assert node.conn is not None
            try:
                node.conn.send({"op": "shutdown"})
            except TransportError:
                pass
            node.conn.close()

        if open_nodes:
            with ThreadPoolExecutor(max_workers=min(32, len(open_nodes))) as pool:
                list(pool.map(close, open_nodes))
        for node in open_nodes:
            node.conn = None
            if node.state not in (NodeState.LOST, NodeState.FAILED):
                self._set_node(node, NodeState.DONE)
        if self.sink:
            self.sink.close()

    def request_cancel(self) -> None:
        """Cancel from a signal handler or another thread."""
        self.cancel_requested = True
        self.events.put((-1, None, None))


class _LaunchFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached controller process: ``python -m orchestrator.controller ID``."""
    argv = sys.argv[1:] if argv is None else argv
    job_id = argv[0]
    user_path = json.loads(os.environ.pop("ORCHESTRATOR_USER_PYTHONPATH", "null"))
    if user_path is None:  # the submitting shell had none
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = user_path
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    store = Store()
    job = store.get_job(job_id)
    store.update_job(job_id, controller_pid=os.getpid())
    spec = JobSpec.model_validate_json(job.spec_json)
    controller = Controller(store, job_id, spec, job.spec_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.request_cancel())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    state = controller.run()
    return 0 if state == JobState.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
