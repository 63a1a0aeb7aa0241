"""The controller: one process per job, the only writer of the job's state.

Its owners (see docs/architecture.md): the :class:`~orchestrator.engine.Engine` turns
the one event loop (every channel, every check) and owns the node book, the node pool and
the preparer; an :class:`~orchestrator.attempt.Attempt` keeps what one attempt's ranks did;
:func:`orchestrator.policy.decide` says what comes after an attempt. This module is the
policy loop, and the launch, watch and stop of each attempt::

    connect agents ─> attempt n: pick port, plan, start ─> watch ─┬─> all ranks exit 0: SUCCEEDED
                                ▲                                 └─> failure / node lost / hang:
                                └── backoff <─ RESTARTING <─ policy.decide <─ stop every worker
                                                                 └─ Fail: FAILED (root cause kept)

A dropped channel makes a node UNREACHABLE while the attempt goes on; the pool reconnects,
and the agent replays what the controller has not kept. A controller that dies is replaced
(``resume``, orchestrator/supervisor.py): the new one truncates the logs to the last
checkpoint, reattaches to the same agents and the same attempt, and carries on. If the agents
gave up meanwhile (``controller_grace``), the attempt ends with cause CONTROLLER_LOST and the
job restarts without charging ``max_restarts``. Its process is started by
``python -m orchestrator.supervisor JOB_ID [--resume] [--supervise]``.
"""

from __future__ import annotations

import errno
import functools
import logging
import resource
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

from agents import commands as C
from orchestrator import bringup, healthcheck, pause, policy, reputation, takeover
from orchestrator.attempt import Attempt, AttemptResult, Failure, start_command
from orchestrator.checkpoints import attempt_config
from orchestrator.dispatch import assign_buddies, dispatch, spares_resume
from orchestrator.drain import Mover
from orchestrator.engine import Engine, Phase, Stop, judge, linger
from orchestrator.errors import StoreUnwritable
from orchestrator.logfiles import LogSink
from orchestrator.nodebook import Node
from orchestrator.notify import END_WAIT, Notifier
from orchestrator.participants import (
    Placed,
    choose_participants,
    pick_port,
    workers_per_node,
)
from orchestrator.plan import plan_attempt
from orchestrator.spec import JobSpec
from orchestrator.state import AttemptOutcome, FailureCause, JobState, NodeState
from orchestrator.store import Store
from orchestrator.transport import default_connect
from orchestrator.transport.base import ConnectionFactory

log = logging.getLogger("orchestrator.controller")

STOP_MARGIN = 10.0  # beyond the grace period, how long stopping may take before a node is LOST
SHUTDOWN_WAIT = 10.0  # seconds agents get to stop their workers and exit at the end
DRAIN_LIMIT = 60.0  # seconds a stop may go on reading what nodes sent before its deadline


class Controller:
    """Runs one job to a terminal state. ``connect`` builds a transport per node;
    ``on_end`` runs once the agents are shut down, before the terminal state is written (a
    Slurm allocation is released there)."""

    def __init__(self, store: Store, job_id: str, spec: JobSpec, spec_dir: str,
                 connect: ConnectionFactory = default_connect, *, secret: str | None = None,
                 resume: bool = False, on_end: Callable[[], None] | None = None):
        self.store, self.job_id, self.spec, self.spec_dir = store, job_id, spec, spec_dir
        self.engine = Engine(store, job_id, spec, spec_dir, connect,
                             secret or secrets.token_hex(16), dispatch, resuming=resume)
        self.nodes = self.engine.nodes
        self.mover = Mover(job_id, store, self.engine.hosts, taken_over=resume)  # drains
        self.engine.on_requests.append(self.mover.look)
        self.resuming = resume
        self.attempt = 0
        self.restarts = 0
        self.free_restarts = 0
        self.infra_restarts = 0  # charged to restart_policy.max_infra_restarts
        self.previous_failure: Failure | None = None  # the attempt before's, for stop_on_repeat
        # The last attempt, where it ended before this controller took over (a resume
        # between attempts): who runs the next one depends on it (a spare in a failed place).
        self.placed: Placed | None = None
        self._on_end = on_end
        self.hand_over = False  # paused, and the home can be written again: a fresh one goes on
        self.notifier = Notifier(spec.notify, job_id, spec.name)
        self.engine.book.on_lost = self._node_lost

    @property
    def state(self) -> JobState:
        return self.engine.state

    @property
    def current(self) -> Attempt | None:
        return self.engine.current

    @property
    def previous(self) -> Attempt | None:
        return self.engine.previous

    # --- the job, start to end ----------------------------------------------------------------
    def run(self) -> JobState:
        """Run the job to its end; its state. **Crash-only**: an exception of ours leaves
        the workers exactly as a SIGKILL of this process would (the agents keep them, and
        the supervisor starts a controller that resumes) and propagates. A home that cannot
        be written pauses the job instead (orchestrator/pause.py); once it can, ``hand_over``
        is set and a fresh controller carries on. Told to exit, the job stays with its
        agents."""
        engine = self.engine
        engine.timeline.mark("controller")
        engine.pool.start_pinger()
        engine.ticker.start()
        try:
            outcome = self._supervise()
            if outcome is None:  # told to exit: the job stays with its agents
                self._detach()
                return engine.state
            final, fields = outcome
            engine.enter(Phase.ENDING)
            engine.checkpoint(force=True)  # every line kept before the agents are let go
        except BaseException as exc:
            floor = self.spec.logs.min_free_bytes
            reason = None if not isinstance(exc, Exception) else \
                pause.problem(exc, self.store, self.job_id, floor)
            if reason is None:
                self._guarded(engine.pool.close)  # as a SIGKILL: the workers untouched
                log.error("controller error: %s (the workers go on; the supervisor starts "
                          "a new controller)", _describe(exc))
                raise
            self.hand_over = pause.hold(engine, self.notifier, reason, floor)
            self._guarded(engine.close)
            self.notifier.close(END_WAIT)
            return engine.state
        # Agents are shut down before the terminal state is written: whoever sees the job
        # ended also sees every reachable node done.
        self._guarded(lambda: engine.shutdown(SHUTDOWN_WAIT))
        engine.timeline.mark("teardown")
        if self._on_end is not None:
            self._guarded(self._on_end)  # the job's end must still be recorded
        record_end(self.engine, final, fields)
        self._guarded(lambda: self.notifier.ended(final.value, fields.get("failure")))
        self._guarded(lambda: self.notifier.close(END_WAIT))
        self._guarded(functools.partial(linger, engine))
        self._guarded(engine.flush)
        engine.close()
        return engine.state

    def abandon(self, final: JobState, fields: dict[str, Any]) -> None:
        """End the job without running it, for a supervisor whose controllers keep failing:
        every agent that answers is told to stop its workers and exit (none is started),
        then the end is recorded."""
        engine = self.engine
        # As the last controller left them (from nothing, an agent's messages were a gap).
        engine.book.restore(self.store.get_job(self.job_id).nodes)
        engine.enter(Phase.LINGERING)  # whatever attaches is shut down
        for node in self.nodes:
            engine.pool.connect(node, launch=False)
        engine.wait(lambda: not any(n.connecting or n.channel is not None for n in self.nodes),
                    self.spec.launch_timeout + SHUTDOWN_WAIT, interruptible=False)
        if self._on_end is not None:
            self._guarded(self._on_end)
        self.store.end_open_attempt(self.job_id, final, fields.get("failure"))
        record_end(self.engine, final, fields)
        self._guarded(lambda: self.notifier.ended(final.value, fields.get("failure")))
        self._guarded(lambda: self.notifier.close(END_WAIT))
        engine.close()

    def _guarded(self, step: Callable[[], Any]) -> None:
        """A step of the end that must not keep the job from being recorded as ended (the
        end is written once, whatever went wrong before: never a crash loop)."""
        try:
            step()
        except Exception:
            log.exception("while ending the job")

    def _supervise(self) -> tuple[JobState, dict[str, Any]] | None:
        """The restart policy. Returns the terminal state to record and its fields, or None
        when the controller was told to exit."""
        engine = self.engine
        result: AttemptResult | None
        if self.resuming:
            resumed = self._resume()
            if isinstance(resumed, tuple):
                return resumed
            if isinstance(resumed, Failure):
                return self._end_launch(resumed)
            result = resumed
        else:
            started = time.time()
            engine.start_clock(started)
            engine.set_state(JobState.LAUNCHING, started_at=started)
            failure = bringup.connect_all(self.engine)
            if failure is not None:
                return self._end_launch(failure)
            result = None
        while True:
            if engine.stop is not None:
                return self._stopped()
            if result is None:
                participants = self._participants()
                if engine.stop is not None:
                    return self._stopped()
                if isinstance(participants, Failure):
                    return self._end_launch(participants)
                result = self._run_attempt(participants)
                if result is None:
                    return self._stopped()
            result = judge(engine, result, STOP_MARGIN, DRAIN_LIMIT)
            decision = policy.decide(result, self.restarts, self.spec, self.previous_failure,
                                     self.infra_restarts, engine.holdings.fell_back)
            self.previous_failure = result.failure
            if result.failure is not None:
                self._guarded(functools.partial(self._keep_reputation, result.failure))
            if isinstance(decision, policy.Succeed):
                return self._ending(result, JobState.SUCCEEDED, {})
            self._stop_attempt()
            stopped = time.monotonic()
            if isinstance(decision, policy.Fail | policy.Preempted):
                return self._ending(result, decision.state, {"failure": decision.failure})
            engine.holdings.fall_back(decision.below)
            if result.failure is not None:  # queued: never waits for a receiver
                self.notifier.restarted(result.failure.to_dict(), self.attempt)
            # The count it is charged to (not the user's failure: the budget is untouched),
            # written with the attempt's end: a crash after it never grants a free restart.
            count = "restarts" if decision.charged else \
                "infra_restarts" if decision.infra else "free_restarts"
            setattr(self, count, getattr(self, count) + 1)
            self._end_attempt(result, {"restart": count}, {count: getattr(self, count)})
            engine.set_state(JobState.RESTARTING, **{count: getattr(self, count)})
            bringup.reconnect_absent(self.engine)
            # The backoff counts from the stop: the end's record (0.66 s of a 4,000-node
            # restart, docs/benchmarks.md) is no reason to wait longer.
            engine.wait(lambda: False, max(0.0, decision.delay - (time.monotonic() - stopped)))
            if engine.stop is not None:
                return self._stopped()
            engine.set_state(JobState.LAUNCHING)
            result = None

    def _node_lost(self, node: Node, message: str | None) -> None:
        number = self.current.number if self.current else self.attempt
        self.notifier.node_lost(node.index, node.host, message, number)

    def _stopped(self) -> tuple[JobState, dict[str, Any]] | None:
        """What a stop reason ends in (None: told to exit, the job goes on without us)."""
        stop = self.engine.stop
        if stop == Stop.DETACH:
            return None
        self.engine.enter(Phase.ENDING)
        if stop == Stop.CANCEL:
            self._stop_attempt()
            return self._ending(AttemptResult(AttemptOutcome.CANCELLED), JobState.CANCELLED, {})
        return self._end_launch(Failure(
            FailureCause.TIMEOUT, f"max_duration ({self.spec.max_duration:g}s) reached: "
            "every worker was stopped"))

    def _end_launch(self, failure: Failure) -> tuple[JobState, dict[str, Any]]:
        self.engine.enter(Phase.ENDING)
        self._stop_attempt()
        return self._ending(AttemptResult(AttemptOutcome.FAILED, failure), JobState.FAILED,
                            {"failure": failure.to_dict()})

    def _detach(self) -> None:
        log.warning("told to exit with no cancel request: leaving the job to its agents (they "
                    "keep the workers for controller_grace; `orchestrator resume %s` carries "
                    "on)", self.job_id)
        engine = self.engine
        engine.pool.close()
        if engine.current:
            engine.checkpoint(force=True)
        for attempt in (engine.previous, engine.current):
            if attempt is not None:
                attempt.sink.close()
        engine.flush()
        engine.close()
        self.notifier.close(END_WAIT)

    # --- nodes ------------------------------------------------------------------------------
    def _participants(self) -> list[Node] | Failure:
        """The first ``max_nodes`` healthy nodes; waits up to launch_timeout for lost nodes
        to rejoin while fewer than ``min_nodes`` are healthy."""
        engine = self.engine
        engine.wait(lambda: not any(n.preparing for n in self.nodes))  # sync and setup
        if engine.launch_failure is not None:
            return engine.launch_failure
        engine.timeline.mark("prepared", self.attempt + 1)
        engine.wait(lambda: (sum(n.usable for n in self.nodes) >= self.spec.min_nodes
                             or not any(n.connecting or n.draining is not None or n.preparing
                                        for n in self.nodes)), self.spec.launch_timeout)
        healthy = [n for n in self.nodes if n.usable]
        if len(healthy) < self.spec.min_nodes:
            return Failure(FailureCause.NODE_FAIL, f"only {len(healthy)} healthy node(s), "
                                                   f"fewer than the minimum {self.spec.min_nodes}")
        if healthcheck.wanted(engine, healthy):
            checked = healthcheck.leave_out_unhealthy(engine, healthy)
            if isinstance(checked, Failure):
                return checked
            healthy = checked
        healthy = self.mover.leave_out(healthcheck.leave_out_quarantined(engine, healthy),
                                       self.spec.min_nodes)
        engine.timeline.mark("checked", self.attempt + 1)
        return choose_participants(healthy, self.engine.current or self.placed,
                                   self.spec.max_nodes)

    def _keep_reputation(self, failure: Failure) -> None:
        """An infrastructure failure counts against the node it happened on, across jobs."""
        host = None if failure.node_index is None else self.nodes[failure.node_index].host
        held = reputation.count_failure(self.store, self.job_id, host, failure)
        if held is not None and host is not None:
            log.warning("node %s quarantined until %s: %s", host,
                        time.strftime("%H:%M:%S", time.localtime(held["until"])), held["reason"])
            self.notifier.event("quarantined", f"node {host} quarantined: {held['reason']}",
                                host, host=host, until=held["until"], reason=held["reason"])

    # --- one attempt ---------------------------------------------------------------------------
    def _run_attempt(self, participants: list[Node]) -> AttemptResult | None:
        """Start attempt n+1 on ``participants`` and watch it to its end (None: a stop
        reason came first)."""
        engine = self.engine
        port = pick_port(engine, self.spec, participants[0])
        if isinstance(port, Failure) or engine.stop is not None:
            return AttemptResult(AttemptOutcome.FAILED, port) if isinstance(port, Failure) \
                else None
        nprocs = workers_per_node(self.spec, participants)
        if isinstance(nprocs, Failure):
            return AttemptResult(AttemptOutcome.FAILED, nprocs)
        self.attempt += 1
        plan = plan_attempt(
            self.spec, self.job_id, attempt=self.attempt, restart_count=self.attempt - 1,
            master_port=port, node_indices=[n.index for n in participants],
            spec_dir=self.spec_dir, nprocs=nprocs,
            sync_tree=engine.preparer.tree().tree if self.spec.sync is not None else None)
        checkpoint, per_node = attempt_config(self.spec, engine.holdings, plan, nprocs)
        attempt = Attempt(plan, self._sink(plan.world_size), engine.hosts, self.store,
                          self.job_id, nprocs, checkpoint, per_node)
        engine.begin_attempt(attempt)
        prune_logs(self)
        ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers
                 if w.rank is not None]
        self.store.start_attempt(self.job_id, self.attempt, plan.master_addr, port or 0,
                                 plan.world_size, ranks, checkpoint.restore_step)
        engine.checkpoint(force=True)  # a replaced controller finds the participants here
        for node in self.nodes:  # spares, and nodes out of the job, have no place in it
            engine.book.place(node, None)
        for node_plan in plan.nodes:
            node = self.nodes[node_plan.node_index]
            engine.book.place(node, node_plan.node_rank, NodeState.RUNNING)
            engine.send_start(node)
        engine.holdings.new_attempt()
        assign_buddies(engine)
        spares_resume(engine)
        engine.timeline.mark("start", self.attempt)
        warm_spares(self, participants, port)
        return self._watch(attempt)

    def _sink(self, ranks: int, sizes: dict[str, int] | None = None,
              state: dict[str, Any] | None = None) -> LogSink:
        logs = self.spec.logs
        return LogSink(self.store.log_dir(self.job_id, self.attempt), sizes,
                       cap=logs.max_bytes_per_rank, ranks=ranks, min_free=logs.min_free_bytes,
                       state=state, max_open=log_files_budget(len(self.nodes)))

    def _watch(self, attempt: Attempt) -> AttemptResult | None:
        """Until the attempt ends (None: a stop reason came first)."""
        engine = self.engine
        launch_deadline = attempt.launched_at + self.spec.launch_timeout
        while True:
            engine.wait(lambda: attempt.result() is not None or (
                engine.state == JobState.LAUNCHING and attempt.all_started), 0.5)
            result = attempt.result()
            if engine.state == JobState.LAUNCHING:
                if attempt.all_started or (result and result.failure is None):
                    engine.set_state(JobState.RUNNING)
                elif result is None and time.monotonic() > launch_deadline:
                    attempt.fail(Failure(
                        FailureCause.LAUNCH_FAILED,
                        f"only {len(attempt.started)} of {attempt.expected} workers started "
                        f"within launch_timeout ({self.spec.launch_timeout:g}s)"))
                    result = attempt.result()
            if result is not None:
                engine.timeline.mark("exit", attempt.number)
                return result
            if engine.stop is not None:
                return None

    def _stop_attempt(self) -> None:
        self.engine.stop_attempt(STOP_MARGIN, DRAIN_LIMIT)

    def _end_attempt(self, result: AttemptResult, after: dict[str, Any],
                     counts: dict[str, int] | None = None) -> None:
        """Record the attempt's end with what comes ``after`` it (AttemptRecord.next) and the
        restart ``counts`` that charges, together."""
        self.engine.end_attempt(result.outcome.value,
                                result.failure.to_dict() if result.failure else None,
                                after, counts)

    def _ending(self, result: AttemptResult, final: JobState,
                fields: dict[str, Any]) -> tuple[JobState, dict[str, Any]]:
        """The attempt's end, and that the job ends ``final``: a controller that takes over
        before that is written ends it so (it ran the job again: takeover.Counts.ending)."""
        self._end_attempt(result, {"state": final.value, "from": self.engine.state.value,
                                   **fields})
        return final, fields

    # --- resuming a job whose controller died -----------------------------------------------
    def _resume(self) -> AttemptResult | Failure | tuple[JobState, dict[str, Any]] | None:
        """Take over the job where the last controller left it (orchestrator/takeover.py).
        Returns the open attempt's result once it ends, None when no attempt was open (or a
        stop reason came), the launch's failure when nodes that never came up still do
        not, or the job's end the last controller decided on and did not write."""
        engine = self.engine
        job = self.store.get_job(self.job_id)
        was = takeover.counts(engine, job)
        self.attempt, self.restarts, self.free_restarts = \
            was.attempt, was.restarts, was.free_restarts
        self.infra_restarts, self.previous_failure = was.infra_restarts, was.previous_failure
        self.placed = was.placed
        engine.book.restore(job.nodes)
        log.info("resuming job %s in state %s, attempt %d", self.job_id, job.state.value,
                 job.attempt)
        attempt = takeover.open_attempt(engine, job, self.spec_dir, self._sink)
        engine.restore(job.state, attempt or takeover.open_attempt(
            engine, job, self.spec_dir, self._sink, ended=True), job.started_at)
        if job.state == JobState.PENDING:
            engine.set_state(JobState.LAUNCHING, started_at=time.time())
        takeover.reattach(engine)
        engine.enter(Phase.RUNNING)
        if engine.stop is not None:
            return None
        if attempt is None and was.ending is not None:
            log.warning("the last controller ended attempt %d, and the job %s, before it "
                        "died: the job ends so", job.attempt, was.ending[0].value)
            return was.ending
        if attempt is None:
            if engine.state == JobState.RUNNING:  # it died before recording the restart
                engine.set_state(JobState.RESTARTING)
            if engine.state == JobState.RESTARTING:
                engine.set_state(JobState.LAUNCHING)
            for node in self.nodes:
                if node.channel is None:
                    engine.pool.connect(node, launch=True,
                                        retry=node.state != NodeState.PENDING)
            if any(n.state == NodeState.PENDING for n in self.nodes):
                return bringup.connect_all(self.engine)
            return None
        lost = takeover.lost_participant(engine, attempt)
        if lost is not None:
            attempt.fail(lost)
            return attempt.result()
        return self._watch(attempt)

    # --- from other threads ------------------------------------------------------------------
    def request_cancel(self) -> None:
        """Cancel from another thread."""
        self.engine.request_cancel()

    def request_exit(self) -> None:
        """From a signal handler: cancel if ``cancel`` asked for it (it sets the flag in the
        store first), else exit and leave the job running on its agents."""
        self.engine.request_exit()


def warm_spares(c: Controller, participants: list[Node], port: int | None) -> None:
    """Healthy nodes beyond nnodes MAX are hot spares: each gets standbys for the place of
    the last participant (the start it would get there), so that one taking over a lost
    node's place starts warm as well."""
    imports = c.spec.standby_imports
    chosen = {n.index for n in participants}
    for node in c.nodes if imports is not None else ():
        if node.index in chosen or not node.usable:
            continue
        stand_in = [*participants[:-1], node]
        nprocs = workers_per_node(c.spec, stand_in)
        if isinstance(nprocs, Failure):
            continue
        plan = plan_attempt(
            c.spec, c.job_id, attempt=c.attempt, restart_count=c.attempt - 1,
            master_port=port, node_indices=[n.index for n in stand_in], spec_dir=c.spec_dir,
            nprocs=nprocs, sync_tree=c.engine.preparer.tree().tree if c.spec.sync else None)
        node_plan = next(p for p in plan.nodes if p.node_index == node.index)
        current = c.engine.current
        c.engine.pool.send(node, start_command(
            c.attempt, node_plan, 0.0, c.spec.health.flight_recorder, imports, C.Warm,
            current.checkpoint if current is not None else C.NO_CHECKPOINT))


def raise_open_files_limit() -> None:
    """Every rank's log, every channel and every node's connection is a descriptor: take
    the hard limit (1,024 soft is common; a 128-node x 8-GPU job needs more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20),
                                hard))
        except (ValueError, OSError):
            pass


def log_files_budget(nodes: int) -> int:
    """Log files an attempt may hold open: what the descriptor limit leaves after every
    node's channel (up to 4 descriptors: a socket or pipes, paramiko's event pipe), the
    store, the pools and a margin, shared by the two attempts whose logs may be open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(16, (soft - 4 * nodes - 256) // 2)


def record_end(engine: Engine, final: JobState, fields: dict[str, Any]) -> None:
    """Write the end, once; while the home cannot be written (the agents are gone and
    nothing else waits) it is tried again every second."""
    said = False
    engine.timeline.mark("state_written")
    while True:
        try:
            engine.set_state(final, **fields)
            return
        except StoreUnwritable as exc:
            if not said:
                log.error("the job ended %s but %s: trying again every second",
                          final.value, exc)
                said = True
            time.sleep(1.0)


def _describe(exc: BaseException) -> str:
    """A controller error as one line; running out of descriptors names the limit."""
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"too many open files: the controller reached its limit of {soft} "
                f"descriptors (RLIMIT_NOFILE, hard limit {hard}); raise it (ulimit -n) "
                f"and resume or submit again ({exc!r})")
    return repr(exc)


def prune_logs(c: Controller) -> None:
    """Only the last ``logs.keep_attempts`` attempts' logs are kept."""
    keep = c.spec.logs.keep_attempts
    if keep is not None:
        for old in range(1, c.attempt - keep + 1):
            shutil.rmtree(c.store.log_dir(c.job_id, old), ignore_errors=True)
