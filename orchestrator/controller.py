"""The controller: one process per job, the only writer of the job's state.

Three owners (see DESIGN.md): the :class:`~orchestrator.nodepool.NodePool` keeps a channel
to every node's agent; an :class:`~orchestrator.attempt.Attempt` keeps what one attempt's
ranks did; and :meth:`Controller._supervise`, the restart policy, is one loop::

    connect agents ─> attempt n: pick port, plan, start ─> watch ─┬─> all ranks exit 0: SUCCEEDED
                                ▲                                 └─> failure / node lost / hang:
                                └── backoff <─ RESTARTING <─ budget left? <─ stop every worker
                                                                └─ no: FAILED (root cause kept)

A dropped channel makes a node UNREACHABLE while the attempt goes on; the pool reconnects,
and the agent replays what the controller has not kept. Only a node unheard for
``health.node_timeout`` is LOST. Output is written in batches and kept exactly once: every
``CHECKPOINT_EVERY`` the controller records the log sizes and each node's last handled
message in one transaction, and only then acknowledges them to the agents.

A controller that dies is replaced (``resume``): the new one truncates the logs to the last
checkpoint, reattaches to the same agents and the same attempt, and carries on. If the agents
gave up meanwhile (``controller_grace``), the attempt ends with cause CONTROLLER_LOST and the
job restarts without charging ``max_restarts``.

Run it as ``python -m orchestrator.controller JOB_ID [--resume] [--supervise]``; ``submit``
starts it with ``--supervise``: a small parent that starts the controller again (resuming)
if it crashes.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from agents import protocol as P
from orchestrator import slurm, sync
from orchestrator.attempt import Attempt, AttemptResult, Failure
from orchestrator.diagnosis import diagnose
from orchestrator.errors import LaunchError, OrchestratorError, SpecError
from orchestrator.logfiles import LogSink
from orchestrator.nodepool import Channel, Node, NodePool
from orchestrator.plan import plan_attempt
from orchestrator.spec import JobSpec
from orchestrator.state import AttemptOutcome, FailureCause, JobState, NodeState
from orchestrator.store import Store, pid_namespace
from orchestrator.transport import Connector, default_connect
from orchestrator.transport.base import ConnectionFactory
from orchestrator.transport.slurm import SlurmConnector
from orchestrator.world import UserWorld

log = logging.getLogger("orchestrator.controller")

POLL = 0.05  # seconds the loop waits for an event before its checks
PUMP_BUDGET = 0.05  # seconds of messages handled between two checks of cancel and health
CHECKPOINT_EVERY = 0.05  # seconds between checkpoints while messages arrive
# How often every node is looked at for silence: a scan of thousands of nodes costs
# milliseconds, not to be paid on every turn of the loop (20 a second).
SCAN_EVERY = 0.2
STOP_MARGIN = 10.0  # beyond the grace period, how long stopping may take before a node is LOST
SHUTDOWN_WAIT = 10.0  # seconds agents get to stop their workers and exit at the end
LIVE = (NodeState.CONNECTED, NodeState.RUNNING, NodeState.STOPPED)


class Cancelled(Exception):
    """Raised inside the loop when a cancel request is seen."""


class Detached(Exception):
    """Raised inside the loop when the controller was told to exit (SIGTERM, SIGINT) with no
    cancel request: a host shutting down, a logout. The job stays with its agents."""


class _TimedOut(Exception):
    """max_duration is over."""


class _LaunchFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


class Controller:
    """Runs one job to a terminal state. ``connect`` builds a transport per node;
    ``on_end`` runs once the agents are shut down, before the terminal state is written (a
    Slurm allocation is released there)."""

    def __init__(self, store: Store, job_id: str, spec: JobSpec, spec_dir: str,
                 connect: ConnectionFactory = default_connect, *, secret: str | None = None,
                 resume: bool = False, on_end: Callable[[], None] | None = None):
        self.store = store
        self.job_id = job_id
        self.spec = spec
        self.spec_dir = spec_dir
        self.pool = NodePool(job_id, spec, secret or secrets.token_hex(16), connect)
        self.nodes = self.pool.nodes
        self.hosts = {n.index: "local" if n.spec.is_local else n.spec.hostname
                      for n in self.nodes}
        self.resuming = resume
        self.cancel_requested = False
        self.exit_requested = False
        self.state = JobState.PENDING
        self.attempt = 0
        self.restarts = 0
        self.free_restarts = 0
        self.current: Attempt | None = None
        # The attempt before: its log stays open so that what an agent that was unreachable
        # while it was stopped replays later (the lines that explain a failure) still lands.
        self.previous: Attempt | None = None
        self._ended: set[int] = set()  # attempts already recorded as ended
        self._next_cancel_check = 0.0
        self._deadline: float | None = None  # wall clock: max_duration after the start
        self._last_checkpoint = 0.0
        self._scanned_at = 0.0  # the last look at every node for silence (_check_health)
        self._lingering = False
        self._manifest: sync.Manifest | None = None  # built once, by the first node's sync
        self._manifest_lock = threading.Lock()
        self._needs_prep = bool(spec.setup) or (spec.sync is not None and any(
            not n.is_local for n in spec.nodes))
        self._setup_sink: LogSink | None = None
        self._ending = False  # stopping for good: no launch failure may interrupt it
        self._on_end = on_end
        self._node_writes: list[tuple[int, NodeState, str | None, dict[str, Any]]] = []
        self._checkpoint_every = CHECKPOINT_EVERY

    # --- the restart policy: one loop ---------------------------------------------------
    def run(self) -> JobState:
        self.pool.start_pinger()
        try:
            final, fields = self._supervise()
        except Detached:
            log.warning("told to exit with no cancel request: leaving the job to its agents "
                        "(they keep the workers for controller_grace; `orchestrator resume "
                        "%s` carries on)", self.job_id)
            self.pool.close()
            if self.current:
                self._checkpoint(force=True)
            for attempt in (self.previous, self.current):
                if attempt is not None:
                    attempt.sink.close()
            self._flush_nodes()
            return self.state
        except Cancelled:
            self._ending = True
            self._stop_attempt()
            self._end_attempt(AttemptResult(AttemptOutcome.CANCELLED))
            final, fields = JobState.CANCELLED, {}
        except _TimedOut:
            self._ending = True
            failure = Failure(FailureCause.TIMEOUT, f"max_duration ({self.spec.max_duration:g}s) "
                                                    "reached: every worker was stopped")
            self._stop_attempt()
            self._end_attempt(AttemptResult(AttemptOutcome.FAILED, failure))
            final, fields = JobState.FAILED, {"failure": failure.to_dict()}
        except _LaunchFailed as exc:
            self._ending = True
            self._stop_attempt()
            self._end_attempt(AttemptResult(AttemptOutcome.FAILED, exc.failure))
            final, fields = JobState.FAILED, {"failure": exc.failure.to_dict()}
        except BaseException as exc:  # a bug or an unexpected OS error: never leave RUNNING
            log.exception("controller error")
            failure = Failure(FailureCause.LAUNCH_FAILED, f"controller error: {exc!r}")
            self._ending = True
            try:
                self._stop_attempt()
                self._end_attempt(AttemptResult(AttemptOutcome.FAILED, failure))
            finally:
                final, fields = JobState.FAILED, {"failure": failure.to_dict()}
        # Agents are shut down before the terminal state is written: whoever sees the job
        # ended also sees every reachable node done.
        self._ending = True
        self._shutdown()
        if self._on_end is not None:
            try:
                self._on_end()
            except Exception:  # the job's end must still be recorded
                log.exception("releasing the job's resources failed")
        self._set_state(final, **fields)
        self._linger()
        self._flush_nodes()
        self.pool.close()
        return self.state

    def _supervise(self) -> tuple[JobState, dict[str, Any]]:
        """The restart policy. Returns the terminal state to record, and its fields."""
        if self.resuming:
            result = self._resume()
        else:
            started = time.time()
            if self.spec.max_duration:
                self._deadline = started + self.spec.max_duration
            self._set_state(JobState.LAUNCHING, started_at=started)
            self._connect_all()
            result = None
        while True:
            if result is None:
                self._check_cancel()
                result = self._run_attempt(self._participants())
            if result.outcome == AttemptOutcome.SUCCEEDED:
                self._end_attempt(result)
                return JobState.SUCCEEDED, {}
            failure = result.failure
            assert failure is not None
            self._stop_attempt()
            self._end_attempt(result)
            if failure.cause == FailureCause.CONTROLLER_LOST:
                # Not the user's failure: restart without touching the budget.
                self.free_restarts += 1
                self._set_state(JobState.RESTARTING, free_restarts=self.free_restarts)
                delay = self.spec.restart_backoff.initial
            elif not self._may_restart(failure):
                return JobState.FAILED, {"failure": self._final_failure(failure)}
            else:
                self.restarts += 1
                # Persisted before acting, so a crash here never grants a free restart.
                self._set_state(JobState.RESTARTING, restarts=self.restarts)
                delay = self._backoff()
            self._reconnect_absent()
            self._sleep(delay)
            self._set_state(JobState.LAUNCHING)
            result = None

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
        self._flush_nodes()
        self.store.set_state(self.job_id, new, **fields)
        self.state = new
        log.info("job %s -> %s", self.job_id, new.value)

    def _set_node(self, node: Node, state: NodeState, message: str | None = None,
                  **fields: Any) -> None:
        if state != node.state:
            log.info("%s: %s -> %s%s", node.host, node.state.value, state.value,
                     f" ({message})" if message else "")
        node.state = state
        if "info" in fields:
            node.info = fields["info"]
        self._node_writes.append((node.index, state, message, fields))

    def _flush_nodes(self) -> None:
        """Write the node (and rank) changes made since the last flush, in one transaction
        each: at the end of each turn of the loop, and before any change of the job's state
        (whoever reads a job state also sees the node and rank states that led to it)."""
        writes, self._node_writes = self._node_writes, []
        self.store.set_nodes(self.job_id, writes)
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.flush_ranks()

    # --- connecting ----------------------------------------------------------------------
    def _connect_all(self) -> None:
        """Start (or find) every node's agent in parallel and wait for their hello. Fewer
        than ``min_nodes`` answering fails the launch, naming the first node that did not."""
        for node in self.nodes:
            self.pool.connect(node, launch=True)
        deadline = time.monotonic() + self.spec.launch_timeout
        while any(n.state == NodeState.PENDING for n in self.nodes):
            if time.monotonic() > deadline:
                for n in self.nodes:
                    if n.state == NodeState.PENDING:
                        self._set_node(n, NodeState.FAILED, info={
                            "error": f"{n.host}: agent did not answer within "
                                     f"{self.spec.launch_timeout:g}s"})
                break
            self._pump(POLL)
            self._check_cancel()
        self._require_min_nodes()

    def _require_min_nodes(self) -> None:
        failed = [n for n in self.nodes if n.state == NodeState.FAILED]
        if len(self.nodes) - len(failed) < self.spec.min_nodes:
            first = failed[0]
            raise _LaunchFailed(Failure(FailureCause.LAUNCH_FAILED,
                                        str(first.info.get("error")), node_index=first.index,
                                        host=first.host))

    def _reconnect_absent(self) -> None:
        """Keep trying, in the background, nodes that never came up or were lost: those
        that answer before an attempt starts take part in it."""
        for node in self.nodes:
            if node.state in (NodeState.FAILED, NodeState.LOST) and node.channel is None:
                self.pool.connect(node, launch=True, retry=True)

    def _participants(self) -> list[Node]:
        """The first ``max_nodes`` healthy nodes; waits up to launch_timeout for lost nodes
        to rejoin while fewer than ``min_nodes`` are healthy."""
        while any(n.preparing for n in self.nodes):  # sync and setup take what they take
            self._pump(POLL)
            self._check_cancel()
            self._check_health()
        deadline = time.monotonic() + self.spec.launch_timeout
        while (sum(n.usable for n in self.nodes) < self.spec.min_nodes
               and any(n.connecting or n.draining is not None or n.preparing
                       for n in self.nodes)
               and time.monotonic() < deadline):
            self._pump(POLL)
            self._check_cancel()
            self._checkpoint()  # acks: a draining agent's window must not fill up
        healthy = [n for n in self.nodes if n.usable]
        if len(healthy) < self.spec.min_nodes:
            raise _LaunchFailed(Failure(
                FailureCause.NODE_FAIL,
                f"only {len(healthy)} healthy node(s), fewer than the minimum "
                f"{self.spec.min_nodes}",
            ))
        return healthy[: self.spec.max_nodes]

    # --- one attempt ---------------------------------------------------------------------
    def _run_attempt(self, participants: list[Node]) -> AttemptResult:
        """Start attempt n+1 on ``participants`` and watch it to its end."""
        port = self._pick_port(participants[0])
        if port is None:  # node 0 went away while asked: a node failure, for the policy
            node = participants[0]
            return AttemptResult(AttemptOutcome.FAILED, Failure(
                FailureCause.NODE_FAIL, f"{node.host}: no answer while picking the master port",
                node_index=node.index, host=node.host))
        nprocs = self._nprocs(participants)
        self.attempt += 1
        plan = plan_attempt(
            self.spec, self.job_id, attempt=self.attempt, restart_count=self.attempt - 1,
            master_port=port, node_indices=[n.index for n in participants],
            spec_dir=self.spec_dir, nprocs=nprocs,
            sync_tree=self._tree().tree if self.spec.sync is not None else None,
        )
        self._flush_nodes()  # the attempt before the last is let go: its ranks first
        if self.previous is not None:
            self.previous.sink.close()
        self.previous = self.current
        attempt = Attempt(plan, self._sink(plan.world_size), self.hosts, self.store,
                          self.job_id, nprocs)
        self._prune_logs()
        self.current = attempt
        ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers
                 if w.rank is not None]
        self.store.start_attempt(self.job_id, self.attempt, plan.master_addr, port or 0,
                                 plan.world_size, ranks)
        self._checkpoint(force=True)  # a replaced controller finds the participants here
        for node in self.nodes:
            node.node_rank = None
        for node_plan in plan.nodes:
            node = self.nodes[node_plan.node_index]
            node.node_rank = node_plan.node_rank
            self._set_node(node, NodeState.RUNNING, node_rank=node_plan.node_rank)
            self._send_start(node)
        return self._watch(attempt)

    def _nprocs(self, participants: list[Node]) -> dict[int, int]:
        """Workers per node for ``nproc_per_node: gpu|auto``, from what each agent reported."""
        mode = self.spec.nproc_per_node
        counts = {}
        for node in participants:
            if node.spec.slots or isinstance(mode, int):
                counts[node.index] = node.spec.slots or int(mode)
                continue
            gpus = int(node.info.get("gpus") or 0)
            if mode == "gpu" and gpus == 0:
                raise _LaunchFailed(Failure(
                    FailureCause.LAUNCH_FAILED, f"nproc_per_node: gpu, but {node.host} has no "
                    "GPU (use a number, or auto)", node_index=node.index, host=node.host))
            counts[node.index] = gpus or 1
        return counts

    def _sink(self, ranks: int, sizes: dict[str, int] | None = None,
              state: dict[str, Any] | None = None) -> LogSink:
        logs = self.spec.logs
        return LogSink(self.store.log_dir(self.job_id, self.attempt), sizes,
                       cap=logs.max_bytes_per_rank, ranks=ranks, min_free=logs.min_free_bytes,
                       state=state)

    def _prune_logs(self) -> None:
        keep = self.spec.logs.keep_attempts
        if keep is not None:
            for old in range(1, self.attempt - keep + 1):
                shutil.rmtree(self.store.log_dir(self.job_id, old), ignore_errors=True)

    def _send_start(self, node: Node) -> None:
        assert self.current is not None
        plan = self.current.plan
        node_plan = self.current.node_plans[node.index]
        self.pool.send(node, {
            "op": P.START, "attempt": plan.attempt, "workdir": node_plan.workdir,
            "route_to": node_plan.route_to, "env": node_plan.env,
            "defaults": node_plan.defaults,
            "workers": [w.to_message() for w in node_plan.workers],
            "stop_grace": self.spec.stop_grace_period,
            "flight_recorder": self.spec.health.flight_recorder,
        })

    def _watch(self, attempt: Attempt) -> AttemptResult:
        launch_deadline = attempt.launched_at + self.spec.launch_timeout
        next_liveness = 0.0
        while True:
            self._pump(POLL)
            self._check_cancel()
            self._check_health()
            if time.monotonic() >= next_liveness:  # for `status --watch`: once a second
                next_liveness = time.monotonic() + 1.0
                offset = time.time() - time.monotonic()
                self.store.liveness(self.job_id, attempt.number,
                                    {n.index: n.last_heard + offset for n in self.nodes
                                     if n.last_heard}, dict(attempt.output_at))
            result = attempt.result()
            if self.state == JobState.LAUNCHING:
                if attempt.all_started or (result and result.failure is None):
                    self._set_state(JobState.RUNNING)
                elif result is None and time.monotonic() > launch_deadline:
                    attempt.fail(Failure(
                        FailureCause.LAUNCH_FAILED,
                        f"only {len(attempt.started)} of {attempt.expected} workers started "
                        f"within launch_timeout ({self.spec.launch_timeout:g}s)"))
                    result = attempt.result()
            self._checkpoint()
            if result is not None:
                return result

    def _pick_port(self, node: Node) -> int | None:
        """A master port that node 0 can bind now (the spec's own, if it fixed one); None
        when node 0 did not answer."""
        wanted = self.spec.rendezvous.port
        span = self.spec.rendezvous.port_range
        if span is not None and span[0] == span[1]:
            wanted = span[0]  # a range of one port is that port
        elif span is not None:
            reply = self.pool.request(node, P.FREE_PORT, self.spec.launch_timeout,
                                      check=self._check_cancel, range=list(span))
            if reply is None:
                return None
            if not reply.get("ok"):
                raise _LaunchFailed(Failure(
                    FailureCause.LAUNCH_FAILED, f"no free port in rendezvous.port {wanted} on "
                                                f"{node.host}", node_index=node.index,
                    host=node.host))
            return int(reply["port"])
        for _ in range(5):
            reply = self.pool.request(node, P.FREE_PORT, self.spec.launch_timeout,
                                      check=self._check_cancel,
                                      port=wanted if isinstance(wanted, int) else 0)
            if reply is None:
                return None
            if reply.get("ok"):
                return int(reply["port"])
            if isinstance(wanted, int):
                raise _LaunchFailed(Failure(
                    FailureCause.LAUNCH_FAILED,
                    f"rendezvous.port {wanted} is in use on {node.host}",
                    node_index=node.index, host=node.host))
        raise _LaunchFailed(Failure(FailureCause.LAUNCH_FAILED,
                                    f"{node.host}: could not find a free port"))

    def _stop_attempt(self) -> None:
        """Stop every worker of the current attempt on every node and wait until they are
        gone (or their node is lost)."""
        attempt = self.current
        if attempt is None or attempt.number in self._ended:
            return
        attempt.stopping = True
        grace = self.spec.stop_grace_period
        live = [self.nodes[i] for i in attempt.participants
                if self.nodes[i].state in (NodeState.RUNNING, NodeState.UNREACHABLE)]
        for node in live:
            self.pool.send(node, {"op": P.STOP, "attempt": attempt.number, "grace": grace})
        deadline = time.monotonic() + grace + STOP_MARGIN
        # At the deadline, what each node had sent by then (and waits in our queue when the
        # controller is behind) is still read: its `stopped` may be among it.
        sent_by_deadline: dict[int, tuple[Channel, int]] | None = None
        waiting = live
        while True:
            waiting = [n for n in waiting if n.index not in attempt.stopped_nodes
                       and n.state in (NodeState.RUNNING, NodeState.UNREACHABLE)]
            if not waiting:
                break
            if time.monotonic() >= deadline:
                if sent_by_deadline is None:
                    sent_by_deadline = {n.index: (n.channel, n.channel.queued)
                                        for n in waiting if n.channel is not None}
                if not any(self._still_reading(n, sent_by_deadline) for n in waiting):
                    break
            self._pump(POLL)
            self._check_health()
            self._checkpoint()
        for node in live:
            if node.state == NodeState.RUNNING:
                if node.index in attempt.stopped_nodes:
                    self._set_node(node, NodeState.STOPPED)
                else:
                    self._lose(node, f"{node.host}: workers did not stop in time")

    @staticmethod
    def _still_reading(node: Node, marks: dict[int, tuple[Channel, int]]) -> bool:
        """Whether messages the node sent before a mark (its channel, how many its reader had
        queued) wait in our queue still."""
        channel, queued = marks.get(node.index, (None, 0))
        return channel is not None and node.channel is channel and channel.handled < queued

    def _end_attempt(self, result: AttemptResult) -> None:
        attempt = self.current
        if attempt is None or attempt.number in self._ended:
            return
        self._flush_nodes()
        self._checkpoint(force=True)
        self._ended.add(attempt.number)
        self.store.end_attempt(self.job_id, attempt.number, result.outcome.value,
                               result.failure.to_dict() if result.failure else None)

    # --- resuming a job whose controller died -----------------------------------------------
    def _resume(self) -> AttemptResult | None:
        """Take over the job where the last controller left it. Returns the open attempt's
        result once it ends, or None when no attempt was open."""
        job = self.store.get_job(self.job_id)
        self.attempt, self.restarts, self.free_restarts = \
            job.attempt, job.restarts, job.free_restarts
        self.state = job.state
        for record in job.nodes:
            node = self.nodes[record.node_index]
            node.state, node.info, node.node_rank = record.state, record.info, record.node_rank
            node.received = node.acked = record.acked_seq
        log.info("resuming job %s in state %s, attempt %d", self.job_id, job.state.value,
                 job.attempt)
        if self.spec.max_duration:
            self._deadline = (job.started_at or time.time()) + self.spec.max_duration
        if job.state == JobState.PENDING:
            self._set_state(JobState.LAUNCHING, started_at=time.time())
        open_attempt = job.attempts[-1] if job.attempts and job.attempts[-1].ended_at is None \
            else None
        if open_attempt is not None and open_attempt.checkpoint:
            cp = open_attempt.checkpoint
            plan = plan_attempt(self.spec, self.job_id, attempt=open_attempt.attempt,
                                restart_count=open_attempt.attempt - 1,
                                master_port=cp.get("master_port"),
                                node_indices=list(cp["participants"]), spec_dir=self.spec_dir,
                                sync_tree=self._tree().tree if self.spec.sync else None,
                                nprocs=(plan_nprocs := {int(k): v for k, v in
                                                        cp.get("nprocs", {}).items()}))
            sink = self._sink(plan.world_size, cp["logs"], cp.get("log_state"))
            self.current = Attempt(plan, sink, self.hosts, self.store, self.job_id,
                                   plan_nprocs)
            self.current.restore(cp)
        # Reattach to every agent that may be alive; launch nothing yet.
        for node in self.nodes:
            node.last_heard = time.monotonic()
            if node.state not in (NodeState.PENDING, NodeState.FAILED, NodeState.DONE):
                self.pool.connect(node, launch=False)
        deadline = time.monotonic() + self.spec.launch_timeout
        while any(n.connecting for n in self.nodes) and time.monotonic() < deadline:
            self._pump(POLL)
            self._check_cancel()
        self.resuming = False
        attempt = self.current
        if attempt is None or open_attempt is None:
            if self.state == JobState.RESTARTING:
                self._set_state(JobState.LAUNCHING)
            for node in self.nodes:
                if node.channel is None:
                    self.pool.connect(node, launch=True, retry=node.state != NodeState.PENDING)
            if any(n.state == NodeState.PENDING for n in self.nodes):
                self._connect_all()
            return None
        gone = [self.nodes[i] for i in attempt.participants
                if self.nodes[i].state in (NodeState.LOST, NodeState.FAILED, NodeState.DONE)]
        if gone:
            node = gone[0]
            attempt.fail(Failure(
                FailureCause.CONTROLLER_LOST,
                f"the job's controller was gone and the agent on {node.host} "
                f"{node.info.get('gone_reason') or 'is gone'}; restarting (not charged to "
                "max_restarts)", node_index=node.index, node_rank=node.node_rank,
                host=node.host))
            return attempt.result()
        return self._watch(attempt)

    # --- messages --------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle the events that arrive within ``timeout``, for at most PUMP_BUDGET, so that
        a flood of output never keeps the loop from its cancel and health checks. Every
        event taken from the queue is handled."""
        self.pool.main_tick = time.monotonic()
        try:
            event = self.pool.events.get(timeout=timeout)
        except queue.Empty:
            return
        budget = time.monotonic() + PUMP_BUDGET
        try:
            while True:
                self._dispatch(event)
                if time.monotonic() > budget:
                    return
                try:
                    event = self.pool.events.get_nowait()
                except queue.Empty:
                    return
        finally:
            self._flush_nodes()

    def _dispatch(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "message":
            self._on_message(self.nodes[event[1]], event[2], event[3])
        elif kind == "attached":
            self._on_attached(self.nodes[event[1]], event[2])
        elif kind == "closed":
            self._on_closed(self.nodes[event[1]], event[2])
        elif kind == "unavailable":
            self._on_unavailable(self.nodes[event[1]], event[2], event[3], event[4])
        elif kind == "prepared":
            self._on_prepared(self.nodes[event[1]], event[2])
        elif kind == "progress":
            node = self.nodes[event[1]]
            node.info = {**node.info, "sync": event[2]}
            self._node_writes.append((node.index, node.state, None, {"info": node.info}))

    def _on_message(self, node: Node, generation: int, message: dict[str, Any]) -> None:
        if node.channel is None or node.channel.generation != generation:
            return  # a channel we already left
        node.channel.handled += 1
        problem = P.check(message)
        if problem is not None:
            self._reject(node, problem)
            return
        seq = message.get("seq")
        if isinstance(seq, int):
            if seq <= node.received:
                return  # replayed, and already handled
            if seq != node.received + 1:
                if node.gap_at != node.received:
                    # Never skip one: attach again, and the agent replays from the checkpoint.
                    log.warning("%s: messages %d..%d missing: reattaching", node.host,
                                node.received + 1, seq - 1)
                    node.gap_at = node.received
                    if node.state in LIVE:
                        self._unreachable(node, "a message went missing")
                    else:
                        self.pool.drop_channel(node)
                        self.pool.connect(node, launch=True, retry=True)
                    return
                # The agent no longer has them (a checkpoint lost with the controller's
                # host, after the agent had been told to forget): say so, and go on.
                log.error("%s: messages %d..%d are lost for good", node.host,
                          node.received + 1, seq - 1)
            node.gap_at = None
            node.received = seq
        kind = message.get("type")
        if kind == P.ERROR:
            log.warning("%s: agent error: %s", node.host, message.get("message"))
            return
        if kind == P.SETUP_OUTPUT:
            if self._setup_sink is None:
                self._setup_sink = LogSink(self.store.job_dir(self.job_id) / "logs" / "setup",
                                           cap=self.spec.logs.max_bytes_per_rank,
                                           min_free=self.spec.logs.min_free_bytes)
            self._setup_sink.write(self.hosts[node.index], "setup", "stdout",
                                   [str(ln) for ln in message["lines"]])
            self._setup_sink.flush()
            return
        if kind == P.STOPPED and node.draining is not None and \
                message.get("attempt") == node.draining:
            node.draining = None
            self._set_node(node, NodeState.CONNECTED, "rejoined: workers of attempt "
                                                      f"{message.get('attempt')} stopped first")
            attempt = self.current
            if (attempt is not None and attempt.number not in self._ended and not
                    attempt.stopping and node.index in attempt.participants and
                    message.get("attempt") != attempt.number):
                self._set_node(node, NodeState.RUNNING)
                self._send_start(node)  # a participant whose start waited for the drain
        if self.current is not None:
            self.current.handle(node.index, message)
        if self.previous is not None and message.get("attempt") == self.previous.number:
            self.previous.handle(node.index, message)

    def _reject(self, node: Node, problem: str) -> None:
        """An agent out of protocol is not trusted further: the node is lost (it is tried
        again only before a later attempt), and the controller carries on."""
        error = f"{node.host}: malformed message from the agent ({problem})"
        log.error(error)
        self.pool.drop_channel(node)
        node.retry = False
        was_running = node.state in (NodeState.RUNNING, NodeState.UNREACHABLE)
        new = NodeState.FAILED if node.state == NodeState.PENDING else NodeState.LOST
        self._set_node(node, new, error, info={**node.info, "error": error})
        if was_running:
            self._fail_if_participant(node, FailureCause.NODE_FAIL, error)

    def _on_attached(self, node: Node, channel: Channel) -> None:
        hello = channel.hello
        if self._lingering:
            node.channel = channel
            self.pool.send(node, {"op": P.SHUTDOWN})
            return
        if hello.get("protocol") != P.VERSION:
            threading.Thread(target=channel.conn.close, daemon=True).start()
            error = (f"{node.host}: the agent speaks protocol {hello.get('protocol')!r}, this "
                     f"controller speaks {P.VERSION} (an agent of another orchestrator version)")
            log.error(error)
            self._set_node(node, NodeState.FAILED if node.state == NodeState.PENDING
                           else NodeState.LOST, error, info={**node.info, "error": error})
            self._fail_if_participant(node, FailureCause.LAUNCH_FAILED, error)
            return
        problem = P.check(hello)
        if problem is not None:
            threading.Thread(target=channel.conn.close, daemon=True).start()
            self._reject(node, problem)
            return
        if node.channel is not None:
            self.pool.drop_channel(node)
        node.channel = channel
        node.last_heard = time.monotonic()
        if channel.launched or hello.get("instance") != node.info.get("instance"):
            node.received = node.acked = 0  # another agent: its messages are numbered from 1
        node.info = {k: hello.get(k)
                     for k in ("hostname", "python", "torch", "gpus", "pid", "instance")}
        attempt = self.current
        in_attempt = (attempt is not None and attempt.number not in self._ended
                      and node.index in attempt.participants)
        agent_attempt = int(hello.get("attempt") or 0)
        running = any(w.get("running") for w in hello.get("workers", []))
        # Its workers belong to the attempt we run (a LOST node's never do: the attempt
        # failed without it). Any others go before the node runs anything: split-brain guard.
        ours = in_attempt and attempt is not None and node.state != NodeState.LOST and \
            agent_attempt == attempt.number
        stale = running and not ours
        target: NodeState | None
        message: str | None = None
        if self.resuming and ours:
            target, message = NodeState.RUNNING, "reattached by a new controller"
        elif node.state == NodeState.UNREACHABLE:
            away = time.monotonic() - (node.unreachable_since or time.monotonic())
            target, message = (node.state_before or NodeState.CONNECTED,
                               f"reattached after {away:.1f}s unreachable")
            if target == NodeState.RUNNING and not in_attempt:
                target = NodeState.STOPPED
        elif node.state in LIVE:
            target = node.state
        elif stale:
            target = None  # CONNECTED once its old workers have stopped
        else:
            target, message = NodeState.CONNECTED, "agent attached"
        start = (in_attempt and attempt is not None and not stale and not attempt.stopping
                 and agent_attempt < attempt.number and node.state != NodeState.LOST
                 and node.state in (*LIVE, NodeState.UNREACHABLE))
        if start:
            target = NodeState.RUNNING  # it never got the start
        if target is None:
            self._node_writes.append((node.index, node.state, None, {"info": node.info}))
        else:
            self._set_node(node, target, message, info=node.info)
        if stale:
            node.draining = agent_attempt
            self.pool.send(node, {"op": P.STOP, "attempt": agent_attempt,
                                  "grace": self.spec.stop_grace_period})
            log.info("%s: stopping its leftover workers of attempt %d before it may run "
                     "again", node.host, agent_attempt)
        elif start:
            self._send_start(node)
        elif in_attempt and attempt is not None and attempt.stopping:
            self.pool.send(node, {"op": P.STOP, "attempt": attempt.number,
                                  "grace": self.spec.stop_grace_period})
        if ours or not self._needs_prep:
            node.prepared = True  # its workers run already, or there is nothing to prepare
        elif not node.preparing:
            node.prepared = False  # a new agent, maybe a new machine: sync and set up first
            node.preparing = True
            threading.Thread(target=self._prepare, args=(node, channel), daemon=True,
                             name=f"prepare-{node.index}").start()

    # --- code and setup on the nodes (a thread per node; results come back as events) ------
    def _prepare(self, node: Node, channel: Channel) -> None:
        """Ship the synced tree and run the setup commands on one node."""
        try:
            tree = None
            if self.spec.sync is not None:
                tree = self._tree().tree
                if not node.spec.is_local:
                    self._push(node, channel)
            if self.spec.setup:
                # The node's own env and workdir, as its workers will have them (per-rank
                # placeholders have no value here: those variables are left out).
                node_plan = plan_attempt(self.spec, self.job_id, node_indices=[node.index],
                                         spec_dir=self.spec_dir, sync_tree=tree).nodes[0]
                env = {k: node_plan.env[k] for k in self.spec.env if k in node_plan.env}
                # Once per node: its name is in the key (nodes may share a home, and with it
                # the agents' marker directory; the agent adds the machine).
                key = hashlib.sha256(json.dumps([self.spec.setup_script, tree,
                                                 node_plan.workdir, env, node.host]
                                                ).encode()).hexdigest()
                reply = channel.ask(P.SETUP, None,  # setups take what they take
                                    key=key[:32], script=self.spec.setup_script, env=env,
                                    workdir=node_plan.workdir)
                if reply is None:  # the channel dropped: prepared again once reattached
                    self.pool.events.put(("prepared", node.index, None))
                    return
                if reply.get("type") == P.FAILED:
                    raise LaunchError(f"{node.host}: setup: {reply.get('error')}")
                if reply.get("exit_code") != 0:
                    tail = [str(t) for t in reply.get("tail") or []]
                    self.pool.events.put(("prepared", node.index, Failure(
                        FailureCause.SETUP_FAILED,
                        f"setup failed on {node.host} with exit code {reply.get('exit_code')}",
                        node_index=node.index, host=node.host,
                        exit_code=reply.get("exit_code"), stderr_tail=tail)))
                    return
            self.pool.events.put(("prepared", node.index, "ok"))
        except OrchestratorError as exc:
            self.pool.events.put(("prepared", node.index, Failure(
                FailureCause.LAUNCH_FAILED, str(exc), node_index=node.index, host=node.host)))
        except Exception as exc:  # the channel broke under us, or a bug: say which node
            self.pool.events.put(("prepared", node.index, None if channel.mailbox.closed
                                  else Failure(FailureCause.LAUNCH_FAILED,
                                               f"{node.host}: preparing failed: {exc!r}",
                                               node_index=node.index, host=node.host)))

    def _tree(self) -> sync.Manifest:
        """The job's tree: hashed once, and kept with the job, so that a resumed controller
        ships the same tree as the one the running workers got."""
        with self._manifest_lock:
            if self._manifest is None:
                assert self.spec.sync is not None
                root = os.path.join(self.spec_dir, os.path.expanduser(self.spec.sync.path))
                saved = self.store.job_dir(self.job_id) / sync.MANIFEST_FILE
                if saved.exists():  # submit hashed it
                    self._manifest = sync.Manifest.load(saved, root)
                else:
                    self._manifest = sync.build_manifest(root, self.spec.sync.exclude,
                                                         self.spec.sync.max_bytes)
                    self._manifest.save(saved)
            return self._manifest

    def _push(self, node: Node, channel: Channel) -> None:
        """Send the blobs the node lacks (pipelined chunks), then have it build the tree."""
        manifest = self._tree()
        assert self.spec.sync is not None

        def ask(op: str, **fields: Any) -> dict[str, Any]:
            reply = channel.ask(op, 120.0, **fields)
            if reply is None:
                raise ConnectionError(f"{node.host}: no answer to {op}")
            if reply.get("type") == P.FAILED:
                raise LaunchError(f"{node.host}: sync: {reply.get('error')}")
            return reply

        by_sha = {e.sha256: e for e in manifest.entries}
        missing = ask(P.SYNC_MISSING, blobs=sorted(by_sha))["missing"]
        progress: dict[str, Any] = {"tree": manifest.tree, "files": len(manifest.entries),
                    "bytes": manifest.total_bytes, "blobs_sent": 0, "bytes_sent": 0,
                    "to_send": sum(by_sha[s].size for s in missing), "done": False}
        self.pool.events.put(("progress", node.index, dict(progress)))
        last_report = time.monotonic()
        for sha in missing:
            entry = by_sha[sha]
            pending: list[int] = []
            with open(manifest.root / entry.path, "rb") as f:
                offset = 0
                while True:
                    data = f.read(sync.CHUNK)
                    if not data and offset < entry.size:
                        raise LaunchError(f"sync: {entry.path} changed since the tree was "
                                          "hashed (submit again to ship the new version)")
                    last = offset + len(data) >= entry.size
                    req, message = channel.mailbox.request(
                        P.SYNC_PUT, sha=sha, offset=offset, last=last,
                        data=base64.b64encode(data).decode())
                    channel.conn.send(message)
                    pending.append(req)
                    offset += len(data)
                    progress["bytes_sent"] += len(data)
                    if len(pending) >= 8 or last:  # a few chunks in flight, not a whole file
                        for r in pending:
                            reply = channel.mailbox.wait(r, 120.0)
                            if reply is None:
                                raise ConnectionError(f"{node.host}: sync interrupted")
                            if reply.get("type") == P.FAILED or not reply.get("ok"):
                                raise LaunchError(f"{node.host}: sync: {reply.get('error')}")
                        pending = []
                    if last:
                        break
            progress["blobs_sent"] += 1
            if time.monotonic() - last_report > 0.2:
                last_report = time.monotonic()
                self.pool.events.put(("progress", node.index, dict(progress)))
        ask(P.SYNC_BUILD, tree=manifest.tree, files=manifest.to_message(),
            keep=self.spec.sync.keep)
        progress["done"] = True
        self.pool.events.put(("progress", node.index, dict(progress)))

    def _on_prepared(self, node: Node, outcome: Any) -> None:
        node.preparing = False
        if outcome == "ok":
            node.prepared = True
            log.info("%s: prepared (sync, setup)", node.host)
        elif isinstance(outcome, Failure):
            if self.current is None and not self._ending:
                raise _LaunchFailed(outcome)  # the job's own setup: it would fail again
            # Later (a node rejoining while the job runs): that node stays out, the job goes on.
            log.error("%s: %s", node.host, outcome.message)
            self.pool.drop_channel(node)
            node.retry = False
            new = NodeState.FAILED if node.state == NodeState.PENDING else NodeState.LOST
            self._set_node(node, new, outcome.message, info={**node.info,
                                                             "error": outcome.message})
        elif node.channel is not None and not node.prepared and self._needs_prep:
            # The channel it ran on dropped, and a newer one is already attached.
            node.preparing = True
            threading.Thread(target=self._prepare, args=(node, node.channel), daemon=True,
                             name=f"prepare-{node.index}").start()

    def _on_closed(self, node: Node, generation: int) -> None:
        if node.channel is None or node.channel.generation != generation:
            return
        self.pool.drop_channel(node)
        if self._lingering:
            return
        if node.state in LIVE:
            self._unreachable(node, "agent channel closed")
        elif node.state in (NodeState.LOST, NodeState.FAILED):
            self.pool.connect(node, launch=True, retry=True)

    def _on_unavailable(self, node: Node, error: str, gone: bool,
                        outcome: dict[str, Any] | None) -> None:
        if self._lingering:
            node.retry = node.retry and not gone
            return
        if gone:
            node.info = {**node.info, "gone_reason": (outcome or {}).get("reason")}
            if self.resuming and node.state != NodeState.PENDING:
                # Its workers died with it while no controller was there: _resume decides.
                self._set_node(node, NodeState.LOST, error, info={**node.info, "error": error})
                return
        if node.state == NodeState.PENDING:
            self._set_node(node, NodeState.FAILED, error, info={"error": error})
        elif node.state in LIVE or node.state == NodeState.UNREACHABLE:
            if gone:
                self._lose(node, error)
            else:  # a resumed controller could not reach it yet
                self._unreachable(node, error)
        elif node.state in (NodeState.LOST, NodeState.FAILED, NodeState.DONE):
            if not self.resuming:  # gone for good: a fresh agent may rejoin later
                self.pool.connect(node, launch=True, retry=True)

    # --- health, cancel, waiting -------------------------------------------------------------
    def _unreachable(self, node: Node, why: str) -> None:
        """The channel is gone but the agent may be fine: reconnect, the attempt goes on."""
        self.pool.drop_channel(node)
        if node.state != NodeState.UNREACHABLE:
            node.state_before = node.state
            node.unreachable_since = time.monotonic()
            self._set_node(node, NodeState.UNREACHABLE, f"{node.host}: {why}")
        self.pool.connect(node, launch=False, retry=True)

    def _lose(self, node: Node, message: str) -> None:
        was_running = node.state == NodeState.RUNNING or (
            node.state == NodeState.UNREACHABLE and node.state_before == NodeState.RUNNING)
        self.pool.drop_channel(node)
        self._set_node(node, NodeState.LOST, message, info={**node.info, "error": message})
        # In the background: it may come back (its old workers are stopped first) and rejoin.
        self.pool.connect(node, launch=True, retry=True)
        if was_running:
            self._fail_if_participant(node, FailureCause.NODE_FAIL, message)

    def _fail_if_participant(self, node: Node, cause: FailureCause, message: str) -> None:
        attempt = self.current
        if attempt is not None and attempt.number not in self._ended and \
                node.index in attempt.participants:
            attempt.fail(Failure(cause, message, node_index=node.index,
                                 node_rank=node.node_rank, host=node.host))

    def _check_health(self) -> None:
        now = time.monotonic()
        if now - self._scanned_at >= SCAN_EVERY:
            self._scanned_at = now
            self._check_silence(now)
        hang = self.spec.health.hang_timeout
        attempt = self.current
        if (hang and attempt is not None and self.state == JobState.RUNNING
                and attempt.failure is None and now - attempt.last_activity > hang):
            # Where every rank is, and what collectives each had issued, taken before anything
            # is stopped: that is the why.
            traces: dict[str, tuple[Node, str]] = {}
            found = self._collect_stacks(traces=traces)
            texts = {r: s.get("text", "") for r, s in found.items() if s.get("text")}
            diagnosis = diagnose({int(r): t for r, t in texts.items()}) if texts else None
            attempt.fail(Failure(
                FailureCause.HUNG, f"no output or heartbeat from any rank for {hang:g}s "
                f"(health.hang_timeout)" + (f": {diagnosis}" if diagnosis else ""),
                stacks=texts, diagnosis=diagnosis,
                flight_recorder=self._fetch_traces(attempt.number, traces)))

    def _check_silence(self, now: float) -> None:
        health = self.spec.health
        # Silence first makes a node UNREACHABLE (and we reconnect); node_timeout makes it LOST.
        silence = max(min(health.node_timeout / 2, 3 * health.heartbeat_interval),
                      health.heartbeat_interval * 1.5)
        for node in self.nodes:
            quiet = now - node.last_heard
            channel = node.channel
            if channel is not None and channel.queued > channel.handled:
                continue  # its messages wait for us: not silent, we are behind
            if channel is not None and node.state in LIVE and quiet > silence:
                self._unreachable(node, f"no message for {quiet:.1f}s")
            if node.state == NodeState.UNREACHABLE and quiet > health.node_timeout:
                self._lose(node, f"{node.host}: no heartbeat for {health.node_timeout:g}s "
                                 "(health.node_timeout)")

    def _fetch_traces(self, number: int, traces: dict[str, tuple[Node, str]],
                      budget: float = 20.0, max_bytes: int = 256 * 1024 * 1024,
                      ) -> dict[str, Any] | None:
        """Flight recorder dumps from the nodes into the attempt's log directory (what torch's
        analyzer reads: ``python -m torch.distributed.flight_recorder.fr_trace DIR``). Those
        not fetched within ``budget`` seconds or ``max_bytes`` stay on their nodes."""
        if not traces:
            return None
        directory = self.store.log_dir(self.job_id, number) / "flight_recorder"
        directory.mkdir(parents=True, exist_ok=True)
        deadline, total = time.monotonic() + budget, 0
        fetched, left = list[int](), dict[str, str]()
        for rank, (node, path) in sorted(traces.items(), key=lambda kv: int(kv[0])):
            data, size = bytearray(), None
            while (size is None or len(data) < size) and node.channel is not None:
                if time.monotonic() > deadline or total + len(data) > max_bytes:
                    break
                self.pool.main_tick = time.monotonic()  # busy, not wedged
                reply = node.channel.ask(P.READ_TRACE, timeout=10.0, path=path,
                                         offset=len(data))
                if reply is None or reply.get("type") != P.TRACE_CHUNK:
                    break
                try:
                    chunk = base64.b64decode(reply["data"], validate=True)
                except ValueError:
                    break
                size = int(reply["size"])
                if not chunk:
                    break
                data += chunk
            if size is not None and len(data) == size:
                (directory / f"nccl_trace_rank_{rank}").write_bytes(bytes(data))
                fetched.append(int(rank))
                total += size
            else:
                left[rank] = f"{node.host}:{path}"
        return {"dir": str(directory), "ranks": fetched, "left_on_nodes": left}

    def _collect_stacks(self, timeout: float = 20.0,
                        traces: dict[str, tuple[Node, str]] | None = None,
                        ) -> dict[str, dict[str, Any]]:
        """Every live rank's stack from every reachable node (py-spy, else faulthandler).
        With ``traces``, the ranks' flight recorders are dumped too, and where each dump
        lies on its node goes there."""
        asked = []
        for node in self.nodes:
            channel = node.channel
            if channel is not None and node.state in LIVE:
                req, message = channel.mailbox.request(
                    P.STACKS_OP, timeout=timeout - 5, flight_recorder=traces is not None)
                try:
                    channel.conn.send(message)
                except OrchestratorError:
                    continue
                asked.append((node, channel, req))
        found: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        for node, channel, req in asked:
            reply = None
            while reply is None and time.monotonic() < deadline and not channel.mailbox.closed:
                self.pool.main_tick = time.monotonic()  # busy, not wedged: keep pinging
                reply = channel.mailbox.wait(req, 0.2)
            for rank, entry in ((reply or {}).get("stacks") or {}).items():
                if isinstance(entry, dict):
                    found[str(rank)] = {**entry, "host": node.host}
            if traces is not None:
                for rank, path in ((reply or {}).get("traces") or {}).items():
                    if str(rank).isdigit() and isinstance(path, str):
                        traces[str(rank)] = (node, path)
        return found

    def _answer_stacks(self) -> None:
        """A reader asked (``orchestrator stacks``): collect, and record the answer."""
        found = self._collect_stacks()
        texts = {int(r): s["text"] for r, s in found.items() if s.get("text")}
        self.store.update_job(self.job_id, stacks_at=time.time(), stacks_json=json.dumps({
            "stacks": found, "diagnosis": diagnose(texts) if texts else None}))

    def _checkpoint(self, force: bool = False) -> None:
        """Record log sizes and handled messages together, then let the agents forget them."""
        attempt = self.current
        if attempt is None:
            return
        now = time.monotonic()
        dirty = any(n.received > n.acked for n in self.nodes)
        if not force and (not dirty or now - self._last_checkpoint < self._checkpoint_every):
            return
        state = {**attempt.snapshot(), "participants": attempt.participants,
                 "master_port": attempt.plan.master_port,
                 "nprocs": attempt.nprocs,
                 "sync_tree": self._manifest.tree if self._manifest else None}
        if self.previous is not None:  # late lines of the attempt before: on disk first
            self.previous.sink.flush()
        self.store.checkpoint(self.job_id, attempt.number, state,
                              {n.index: n.received for n in self.nodes})
        self._last_checkpoint = time.monotonic()
        # A checkpoint fsyncs every log written since the last one: with thousands of ranks
        # that is most of them, so checkpoints may take at most a fifth of the loop's time.
        self._checkpoint_every = max(CHECKPOINT_EVERY, 4 * (self._last_checkpoint - now))
        for node in self.nodes:
            if node.received > node.acked:
                node.acked = node.received
                self.pool.send(node, {"op": P.ACK, "seq": node.acked})

    def _check_cancel(self) -> None:
        now = time.monotonic()
        if now >= self._next_cancel_check or self.exit_requested:
            self._next_cancel_check = now + 0.25
            cancel, stacks_wanted = self.store.requests(self.job_id)
            self.cancel_requested = self.cancel_requested or cancel
            if stacks_wanted and not self.cancel_requested:
                self._answer_stacks()
        if self.cancel_requested:
            raise Cancelled()
        if self.exit_requested:
            raise Detached()
        if self._deadline is not None and time.time() > self._deadline:
            raise _TimedOut()

    def _sleep(self, seconds: float) -> None:
        """Wait, still answering agents and watching for cancel and lost nodes."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(min(POLL, max(0.0, deadline - time.monotonic())))
            self._check_cancel()
            self._check_health()
            self._checkpoint()

    def _shutdown(self) -> None:
        """Tell every attached agent to stop its workers and exit, and wait until it has."""
        self._checkpoint(force=True)
        attached = [n for n in self.nodes if n.channel is not None]
        for node in attached:
            self.pool.send(node, {"op": P.SHUTDOWN})
        deadline = time.monotonic() + SHUTDOWN_WAIT
        self._lingering = True  # from here on, attaching means shutting down
        while any(n.channel is not None for n in attached) and time.monotonic() < deadline:
            self._pump(POLL)
        for node in attached:
            self.pool.drop_channel(node)
            if node.state not in (NodeState.LOST, NodeState.FAILED, NodeState.UNREACHABLE):
                self._set_node(node, NodeState.DONE)
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.sink.close()
        if self._setup_sink is not None:
            self._setup_sink.close()

    def _linger(self) -> None:
        """After the end: agents we could not reach may still hold workers. Keep trying to
        reach them (never launching one) and shut them down; they give up by themselves
        after controller_grace, so trying longer than that is pointless."""
        grace = self.spec.health.controller_grace
        # With no grace the agents keep the workers forever: then so must we keep trying.
        deadline = time.monotonic() + (grace + 5 if grace is not None else float("inf"))
        # Also nodes whose connector is still out: what it reaches is shut down on arrival.
        targets = [n for n in self.nodes if n.state in (NodeState.UNREACHABLE, NodeState.LOST)
                   or n.connecting]
        for node in targets:
            self.pool.connect(node, launch=False, retry=node.state != NodeState.PENDING)
        while time.monotonic() < deadline and any(
                n.connecting or n.channel is not None for n in targets):
            self._pump(POLL)
        for node in targets:
            node.retry = False
            self.pool.drop_channel(node)

    def request_cancel(self) -> None:
        """Cancel from another thread."""
        self.cancel_requested = True
        self.pool.events.put(("wake",))

    def request_exit(self) -> None:
        """From a signal handler: cancel if ``cancel`` asked for it (it sets the flag in the
        store first), else exit and leave the job running on its agents."""
        self.exit_requested = True
        self.pool.events.put(("wake",))


# --- the process ----------------------------------------------------------------------------------

ANOTHER_CONTROLLER = 75  # exit code: the job has a live controller already


def _controller_main(job_id: str, resume: bool) -> int:
    store = Store(durable=True)
    # One controller per job, whoever started it (the supervisor, resume, a reader): two would
    # take the agents from each other.
    lock = open(store.job_dir(job_id) / "controller.lock", "a")  # noqa: SIM115 (held until exit)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("job %s already has a live controller", job_id)
        return ANOTHER_CONTROLLER
    job = store.get_job(job_id)
    if job.state.is_terminal():
        log.info("job %s already ended (%s)", job_id, job.state.value)
        return 0
    store.claim_controller(job_id, os.getpid(), socket.gethostname(), pid_namespace())
    secret = job.secret
    if not secret:  # a job recorded before secrets existed
        secret = secrets.token_hex(16)
        store.update_job(job_id, secret=secret)
    spec = JobSpec.model_validate_json(job.spec_json)
    saved = store.world(job_id)
    # Local relays and Slurm steps start in the submitter's world, never in ours (a job of
    # an older version kept none: then this process's, as before).
    world = UserWorld.from_dict(saved) if saved is not None else UserWorld.capture()
    connect: ConnectionFactory = Connector(world)
    on_end = None
    if spec.slurm is not None:
        allocation = _slurm_allocation(store, job_id, spec)
        if allocation is None:
            return 1  # the job ended (or waits for a resume): recorded already
        spec = slurm.spec_with_nodes(spec, allocation)
        connect = SlurmConnector(allocation.job_id, world)
        on_end = lambda: _release(store, job_id, allocation)  # noqa: E731
    controller = Controller(store, job_id, spec, job.spec_dir, connect, secret=secret,
                            resume=resume or job.state != JobState.PENDING, on_end=on_end)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.request_exit())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    state = controller.run()
    return 0 if state == JobState.SUCCEEDED else 1


def _slurm_allocation(store: Store, job_id: str, spec: JobSpec) -> slurm.Allocation | None:
    """The job's Slurm allocation (recorded, or requested now). A cancel or a SIGTERM while
    it is pending cancels the request; an allocation that cannot be had fails the job with
    one line naming why. None when the job does not go on."""
    told: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # the controller's own handlers come later
        signal.signal(sig, lambda signum, _: told.append(signum))

    def record(allocation: slurm.Allocation) -> None:
        hosts = [n.host for n in slurm.spec_with_nodes(spec, allocation).nodes]
        store.set_slurm(job_id, allocation.to_dict(), hosts if allocation.nodes else None)
        log.info("slurm allocation %s %s", allocation.job_id,
                 f"granted: {','.join(allocation.nodes)}" if allocation.nodes else "requested")

    try:
        return slurm.acquire(spec, f"orchestrator-{job_id}", store.get_job(job_id).slurm,
                             record=record,
                             stop=lambda: bool(told) or store.job_state(job_id)[1])
    except slurm.Interrupted:
        if store.job_state(job_id)[1]:
            store.set_state(job_id, JobState.CANCELLED)
        return None
    except (LaunchError, SpecError) as exc:
        log.error("%s", exc)
        store.set_state(job_id, JobState.FAILED, failure={
            "cause": FailureCause.LAUNCH_FAILED.value, "message": str(exc)})
        return None


def _release(store: Store, job_id: str, allocation: slurm.Allocation) -> None:
    """Give the allocation back to Slurm if the orchestrator requested it."""
    if allocation.owned and slurm.release(allocation):
        allocation.released = True
        store.set_slurm(job_id, allocation.to_dict())
        log.info("slurm allocation %s released", allocation.job_id)


MAX_RESPAWNS = 5  # within RESPAWN_WINDOW seconds: a controller that keeps dying is a bug
RESPAWN_WINDOW = 600.0


def _supervise(job_id: str, resume: bool) -> int:
    """Run the controller as a child and start it again, resuming, whenever it dies before
    the job has ended (a crash, the OOM killer, a stray kill)."""
    store = Store()
    store.update_job(job_id, supervisor_pid=os.getpid())
    child: _Forked | None = None
    told_to_exit = False

    def forward(signum: int, _frame: Any) -> None:  # the controller decides: cancel, or exit
        nonlocal told_to_exit
        told_to_exit = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    deaths: deque[float] = deque()
    store.close()
    while True:
        child = _Forked(job_id, resume)
        code = child.wait()
        store = Store()
        state, _ = store.job_state(job_id)
        if state.is_terminal() or told_to_exit or code == ANOTHER_CONTROLLER:
            return 0
        now = time.monotonic()
        deaths.append(now)
        while deaths and now - deaths[0] > RESPAWN_WINDOW:
            deaths.popleft()
        how = f"code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        if len(deaths) > MAX_RESPAWNS:
            log.error("controller died %d times in %gs (last: %s); giving up: run "
                      "`orchestrator resume %s`", len(deaths), RESPAWN_WINDOW, how, job_id)
            saved = store.get_job(job_id).slurm
            if saved and not saved.get("released"):  # nobody will use it: give it back
                _release(store, job_id, slurm.Allocation.from_dict(saved))
            return 1
        log.warning("controller exited with %s while the job was %s: resuming", how,
                    state.value)
        store.close()
        time.sleep(1.0)
        resume = True


class _Forked:
    """The controller as a forked child of the supervisor, which has imported everything it
    needs already: a fresh ``python -m`` would spend ~0.3 s importing it again, on the path
    of every submit. The supervisor has no threads and no open database when it forks."""

    def __init__(self, job_id: str, resume: bool):
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)  # the controller sets its own
                for handler in logging.getLogger().handlers:
                    handler.setFormatter(logging.Formatter(
                        f"%(asctime)s {os.getpid()} %(levelname)s %(message)s"))
                code = _run_controller(job_id, resume)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("controller failed")
            finally:
                logging.shutdown()
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(code)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except InterruptedError:
                continue
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m orchestrator.controller JOB_ID [--resume] [--supervise]``."""
    parser = argparse.ArgumentParser(prog="orchestrator.controller")
    parser.add_argument("job_id")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--supervise", action="store_true")
    args = parser.parse_args(argv)
    os.umask(0o077)  # logs hold whatever the workers print: the user's alone
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {'supervisor' if args.supervise else os.getpid()} "
                               "%(levelname)s %(message)s")
    if args.supervise:
        return _supervise(args.job_id, args.resume)
    return _run_controller(args.job_id, args.resume)


def _run_controller(job_id: str, resume: bool) -> int:
    try:
        return _controller_main(job_id, resume)
    except OrchestratorError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
