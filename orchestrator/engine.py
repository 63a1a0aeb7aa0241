"""The controller's machinery: the event loop and everything one turn of it does.

:meth:`Engine.wait` is the controller's one wait: it turns the loop until a condition holds,
and every turn runs the same checks, in this order: the events of the turn, handled
(orchestrator/dispatch.py: node news to the node book, agents' messages to the attempt,
connects, preparations); the node and rank writes of the turn, in one transaction each;
readers' requests (cancel, stacks) and the controller's looks (drains: drain.py); the stop
reasons (cancel, a signal, ``max_duration``); silent nodes; a hang; the home's free space; a
checkpoint; the liveness ``status --watch`` shows. Nothing here raises for a node's fault: a
node that says something out of protocol loses its channel and the attempt fails for it,
naming the field. What raises is ours (a bug, a store or a disk that cannot be written): the
controller is crash-only (orchestrator/controller.py). A wait returns early when a stop
reason is set (unless it must not be interrupted) and the caller decides.

The engine's mode is one :class:`Phase`, which only moves forward. What to do with each
event is handed in (``handle``: orchestrator/dispatch.py), so that the machinery does not
depend on the rules; the controller changes the engine's state only through its methods.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from agents import commands as C
from agents import protocol as P
from orchestrator import failpoints, hang
from orchestrator.attempt import Attempt, AttemptResult, Failure
from orchestrator.channel import Answer, Channel, ask_all
from orchestrator.checkpoints import Holdings
from orchestrator.events import Event, Wake
from orchestrator.logfiles import LogSink
from orchestrator.loop import EventLoop
from orchestrator.nodebook import LIVE, Node, NodeBook
from orchestrator.nodepool import NodePool
from orchestrator.prepare import Preparer
from orchestrator.spec import JobSpec
from orchestrator.state import FailureCause, JobState, NodeState
from orchestrator.store import Store
from orchestrator.timeline import Timeline
from orchestrator.transport.base import ConnectionFactory

K = TypeVar("K")
R = TypeVar("R", bound=P.Reply)
log = logging.getLogger("orchestrator.controller")

POLL = 0.05  # seconds a turn waits for an event before its checks
CHECKPOINT_EVERY = 0.05  # seconds between checkpoints while messages arrive
# How often every node is looked at for silence: a scan of thousands of nodes costs
# milliseconds, not to be paid on every turn of the loop (20 a second).
SCAN_EVERY = 0.2
REQUESTS_EVERY = 0.25  # seconds between two looks at readers' requests (cancel, stacks)
ROOM_EVERY = 1.0  # seconds between two looks at the home's free space (orchestrator/pause.py)
# Two turns further apart than this: the controller itself was stalled (SIGSTOP, swap, a
# paused VM), and nobody's silence counts the time it was not looking. A turn waits POLL.
STALLED = 2.0
COMPACT_EVERY = 300.0  # seconds between two thinnings of the job's aged samples


class Stop(enum.Enum):
    """Why the job stops going on (set by a turn's checks; the controller acts on it)."""

    CANCEL = "cancel"  # `orchestrator cancel`
    DETACH = "detach"  # told to exit with no cancel (a logout, a host shutting down)
    TIMEOUT = "timeout"  # max_duration is over


class Phase(enum.Enum):
    """The engine's mode, in the order it moves through them (never back)."""

    RESUMING = "resuming"  # a new controller reattaches to the last one's agents
    RUNNING = "running"  # launching and running attempts
    ENDING = "ending"  # stopping for good: nothing interrupts it, no pause for room
    LINGERING = "lingering"  # the job ended: an agent that attaches is shut down


_PHASES = list(Phase)


class Engine:
    def __init__(self, store: Store, job_id: str, spec: JobSpec, spec_dir: str,
                 connect: ConnectionFactory, secret: str,
                 handle: Callable[[Engine, Event], None], *, resuming: bool = False):
        self.store, self.job_id, self.spec = store, job_id, spec
        self.loop = EventLoop()
        self.pool = NodePool(job_id, spec, secret, connect, self.loop)
        self.book = NodeBook(job_id, spec, store, self.pool)
        self.nodes = self.book.nodes
        self.preparer = Preparer(job_id, spec, spec_dir, store, self.loop)
        self.holdings = Holdings()  # the nodes' checkpoints, from their ``held`` reports
        self.book.on_gone = self.holdings.forget
        self.hosts = {n.index: "local" if n.spec.is_local else n.spec.hostname
                      for n in self.nodes}
        # Looks of the controller's, as often as readers' requests (the drains: drain.py).
        self.on_requests: list[Callable[[Engine], None]] = []
        self.state = JobState.PENDING
        self.current: Attempt | None = None
        # The attempt before: its log stays open so that what an agent that was unreachable
        # while it was stopped replays later (the lines that explain a failure) still lands.
        self.previous: Attempt | None = None
        self.stop: Stop | None = None
        self.cancel_requested = False
        self.exit_requested = False
        self.deadline: float | None = None  # wall clock: max_duration after the start
        self.launch_failure: Failure | None = None  # the job's own setup failed
        self.phase = Phase.RESUMING if resuming else Phase.RUNNING
        submitted, marks = store.timeline(job_id)  # a resumed controller carries them on
        self.timeline = Timeline.from_json(marks, submitted)
        self._handle = handle
        self._setup_sink: LogSink | None = None
        self.on_attached: Callable[[Node, Channel], None] | None = None  # for benchmarks
        # Collecting stacks (a guard, not a mode): the turns inside do not start another.
        self._collecting = False
        self._next_requests = self._scanned = self._liveness = self._checkpointed = 0.0
        self._room_checked = self._turned = self._compacted = 0.0
        self._compacted_wall: float | None = None  # when this controller last thinned them
        self.ticker = Ticker()  # was the process stopped, or only the loop busy?
        self._checkpoint_every = CHECKPOINT_EVERY
        self._until: Callable[[], bool] | None = None  # what the innermost wait waits for

    # --- the one wait ---------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], timeout: float | None = None, *,
             interruptible: bool = True) -> bool:
        """Turn the loop until ``done()`` (True), ``timeout`` seconds (False), or, when
        ``interruptible``, a stop reason or a launch failure (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outer, self._until = self._until, done  # (a wait inside a turn has its own)
        try:
            while True:
                if done():
                    return True
                if interruptible and (self.stop is not None or self.launch_failure is not None):
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.turn(POLL if left is None else min(POLL, left))
        finally:
            self._until = outer

    def turn(self, timeout: float) -> None:
        """Wait up to ``timeout`` for events, handle them, record what they changed, then
        the periodic checks. The checks wait for the next turn when the events made true
        what the current wait waits for: its waiter acts first (with thousands of nodes a
        turn's checkpoint takes seconds, and the turn that saw the last worker start kept
        the job LAUNCHING in `status` that much longer)."""
        self.pool.main_tick = self._awake()
        failpoints.hit("turn")
        for event in self.loop.poll(timeout):
            self._handle(self, event)
        self.flush()
        if self._until is not None and self._until():
            return
        self._checks()

    def ask_all(self, channels: Mapping[K, Channel], request: C.Request[R],
                within: float | None) -> dict[K, Answer[R]]:
        """A request to many nodes at once; the loop turns while their replies come (up to
        ``within`` seconds)."""
        return ask_all(channels, request, within, lambda d, t: self.wait(d, t))

    def flush(self) -> None:
        """The node and rank changes of this turn, in one transaction each."""
        self.book.flush()
        if self.timeline.dirty:
            self.store.update_job(self.job_id, timeline_json=self.timeline.to_json())
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.flush_ranks()

    # --- what the controller changes (nothing else writes the engine's fields) --------------
    @property
    def resuming(self) -> bool:
        return self.phase == Phase.RESUMING

    @property
    def ending(self) -> bool:
        return self.phase in (Phase.ENDING, Phase.LINGERING)

    @property
    def lingering(self) -> bool:
        return self.phase == Phase.LINGERING

    def enter(self, phase: Phase) -> None:
        """Move on to ``phase`` (staying where it is if it is there already or beyond)."""
        if _PHASES.index(phase) > _PHASES.index(self.phase):
            log.info("engine: %s -> %s", self.phase.value, phase.value)
            self.phase = phase

    def begin_attempt(self, attempt: Attempt) -> None:
        """``attempt`` is the current one; the one before stays open for its late lines,
        and the one before that is let go."""
        self.flush()  # its ranks first
        if self.previous is not None:
            self.previous.sink.close()
        self.previous, self.current = self.current, attempt

    def restore(self, state: JobState, attempt: Attempt | None,
                started_at: float | None) -> None:
        """A replaced controller takes the job's state and its open attempt as recorded."""
        self.state, self.current = state, attempt
        self.start_clock(started_at or time.time())

    def start_clock(self, started_at: float) -> None:
        """``max_duration`` counts from ``started_at``."""
        if self.spec.max_duration:
            self.deadline = started_at + self.spec.max_duration

    def request_cancel(self) -> None:
        """Cancel (from any thread)."""
        self.cancel_requested = True
        self.loop.post(Wake())

    def request_exit(self) -> None:
        """Exit and leave the job to its agents, unless a cancel is asked for (from a signal
        handler)."""
        self.exit_requested = True
        self.loop.post(Wake())

    def fail_launch(self, failure: Failure) -> None:
        """The job's own preparation failed: it would fail again anywhere."""
        self.launch_failure = failure

    def setup_log(self) -> LogSink:
        """Where the setup scripts' output goes (opened on first use)."""
        if self._setup_sink is None:
            self._setup_sink = LogSink(self.store.job_dir(self.job_id) / "logs" / "setup",
                                       cap=self.spec.logs.max_bytes_per_rank,
                                       min_free=self.spec.logs.min_free_bytes)
        return self._setup_sink

    def set_state(self, new: JobState, **fields: Any) -> None:
        self.flush()  # whoever reads a job state also sees the node states that led to it
        if self.timeline.dirty:
            fields["timeline_json"] = self.timeline.to_json()
        self.store.set_state(self.job_id, new, **fields)
        self.state = new
        log.info("job %s -> %s", self.job_id, new.value)

    def _awake(self) -> float:
        """Now; and, when the controller was not running for more than STALLED seconds
        since it last looked (at a turn's start, or before judging silence: a SIGSTOP can
        land anywhere in a turn), its time stopped (Ticker) is nobody's silence."""
        now = time.monotonic()
        if self._turned and now - self._turned > STALLED and \
                (stopped := self.ticker.stopped(self._turned, now)) > 0:
            self._forgive(stopped, now)
        self._turned = now
        return now

    def _forgive(self, stalled: float, now: float) -> None:
        log.warning("the controller was stalled for %.1fs (stopped, swapped out, starved): "
                    "no node's silence counts that time", stalled)
        self.book.forgive(stalled, now)
        for attempt in (self.current, self.previous):
            if attempt is not None:  # nor a hang's
                attempt.forgive(stalled, now)

    # --- the checks of every turn ----------------------------------------------------------
    def _checks(self) -> None:
        now = self._awake()
        if now >= self._next_requests or self.exit_requested:
            self._next_requests = now + REQUESTS_EVERY
            cancel, stacks_wanted = self.store.requests(self.job_id)
            self.cancel_requested = self.cancel_requested or cancel
            if stacks_wanted and not self.cancel_requested and not self._collecting:
                self._answer_stacks()
            for look in self.on_requests:
                look(self)
        if self.stop is None:
            if self.cancel_requested:
                self.stop = Stop.CANCEL
            elif self.exit_requested:
                self.stop = Stop.DETACH
            elif self.deadline is not None and time.time() > self.deadline:
                self.stop = Stop.TIMEOUT
        if now - self._scanned >= SCAN_EVERY:
            self._scanned = now
            silent = self.book.silent(now)
            # A node whose news waits to be read is not silent: the controller is behind
            # (a long turn), not the node.
            talking = set(self.loop.readable([n.channel for n, _ in silent if n.channel],
                                             now=True))
            for node, why in silent:
                if node.channel in talking:
                    continue
                if node.state == NodeState.UNREACHABLE:
                    self.lose(node, why)
                else:
                    self.book.unreachable(node, why, keep_channel=True)
        self._check_hang(now)
        if not self.ending and now - self._room_checked >= ROOM_EVERY:  # a pause, not a loss
            self._room_checked = now
            self.store.check_room(self.spec.logs.min_free_bytes)
        if self.current is not None and now - self._compacted >= COMPACT_EVERY:
            wall = time.time()  # bounded in time: the job's samples thin out as they age
            self.store.compact_samples(self.job_id, wall, self._compacted_wall)
            self._compacted, self._compacted_wall = now, wall
        self.checkpoint()
        attempt = self.current
        if attempt is not None and not attempt.ended and now - self._liveness >= 1.0:
            self._liveness = now  # for `status --watch`: once a second
            offset = time.time() - now
            self.store.liveness(self.job_id, attempt.number,
                                {n.index: n.last_heard + offset for n in self.nodes
                                 if n.last_heard}, dict(attempt.output_at),
                                {n.index: n.longest_silence for n in self.nodes})

    def _check_hang(self, now: float) -> None:
        attempt = self.current
        limit, why = hang.silence_allowed(self.spec.health, attempt is not None and attempt.heard)
        if not (limit and attempt is not None and self.state == JobState.RUNNING
                and attempt.failure is None and not attempt.stopping and not self._collecting
                and now - attempt.last_activity > limit):
            return
        # Where every rank is, and what collectives each had issued, taken before anything
        # is stopped: that is the why. (The turns inside start no second collection.)
        found = self.stacks(flight_recorder=True)
        diagnosis = found.diagnosis
        self._collecting = True
        try:
            dumps = hang.fetch_dumps(found, self.store.log_dir(self.job_id, attempt.number) /
                                     "flight_recorder", self.ask_all)
        finally:
            self._collecting = False
        attempt.fail(Failure(
            FailureCause.HUNG, f"no output or heartbeat from any rank for {limit:g}s {why}"
            + (f": {diagnosis}" if diagnosis else ""),
            stacks=found.texts, diagnosis=diagnosis, flight_recorder=dumps,
            at=time.time() - limit))

    def stacks(self, flight_recorder: bool = False) -> hang.Stacks:
        """Every live rank's stack, from every reachable node."""
        channels = {n.index: n.channel for n in self.nodes
                    if n.channel is not None and n.state in LIVE}
        self._collecting = True
        try:
            attempt = self.current
            return hang.collect(channels, self.hosts, self.ask_all,  # type: ignore[arg-type]
                                flight_recorder=flight_recorder,
                                owns=attempt.speaks_for if attempt is not None else None)
        finally:
            self._collecting = False

    def _answer_stacks(self) -> None:
        """A reader asked (``orchestrator stacks``): collect, and record the answer."""
        found = self.stacks()
        self.store.update_job(self.job_id, stacks_at=time.time(), stacks_json=json.dumps({
            "stacks": found.found, "diagnosis": found.diagnosis}))

    def checkpoint(self, force: bool = False) -> None:
        """Record log sizes and handled messages together, then let the agents forget them."""
        attempt = self.current
        if attempt is None:
            return
        now = time.monotonic()
        dirty = any(n.received > n.acked for n in self.nodes)
        if not force and (not dirty or now - self._checkpointed < self._checkpoint_every):
            return
        state = {**attempt.snapshot(), "participants": attempt.participants,
                 "master_port": attempt.plan.master_port, "nprocs": attempt.nprocs,
                 "sync_tree": self.preparer.tree_name}
        if self.previous is not None:  # late lines of the attempt before: on disk first
            self.previous.sink.flush()
        self.store.checkpoint(self.job_id, attempt.number, state,
                              {n.index: n.received for n in self.nodes},
                              len(attempt.warm_started))
        self._checkpointed = time.monotonic()
        # A checkpoint fsyncs every log written since the last one: with thousands of ranks
        # that is most of them, so checkpoints may take at most a fifth of the loop's time.
        self._checkpoint_every = max(CHECKPOINT_EVERY, 4 * (self._checkpointed - now))
        for node in self.book.kept():  # what the checkpoint holds, the agents may forget
            self.pool.send(node, C.Ack(node.acked))

    def stop_attempt(self, margin: float, drain_limit: float) -> None:
        """Stop every worker of the current attempt on every node and wait until they are
        gone (or their node is lost): up to the stop grace plus ``margin``, then up to
        ``drain_limit`` for what the nodes sent meanwhile."""
        attempt = self.current
        if attempt is None or attempt.ended:
            return
        attempt.stop()
        grace = self.spec.stop_grace_period
        live = [self.nodes[i] for i in attempt.participants
                if self.nodes[i].state in (NodeState.RUNNING, NodeState.UNREACHABLE)]
        for node in live:
            self.pool.send(node, C.Stop(attempt.number, grace))

        def waiting() -> list[Node]:
            return [n for n in live if n.index not in attempt.stopped_nodes
                    and n.state in (NodeState.RUNNING, NodeState.UNREACHABLE)]

        self.wait(lambda: not waiting(), grace + margin, interruptible=False)
        # At the deadline, what the nodes had sent (and waits unread, when the controller is
        # behind) is still read: a node's `stopped` may be among it. An agent sends at most
        # its window of output unacknowledged, so this ends; the limit is for a node that
        # would never stop talking.
        self.wait(lambda: not self.loop.readable(
            [n.channel for n in waiting() if n.channel is not None]), drain_limit,
            interruptible=False)
        for node in live:
            if node.state == NodeState.RUNNING:
                if node.index in attempt.stopped_nodes:
                    self.book.set(node, NodeState.STOPPED)
                else:
                    self.lose(node, f"{node.host}: workers did not stop in time")

    def end_attempt(self, outcome: str, failure: dict[str, Any] | None,
                    after: dict[str, Any] | None = None,
                    counts: dict[str, int] | None = None) -> None:
        """Record the current attempt's end (once), with what comes after it and the
        restart counts that charges (Store.end_attempt)."""
        attempt = self.current
        if attempt is None or attempt.ended:
            return
        self.flush()
        self.checkpoint(force=True)
        attempt.end()
        self.store.end_attempt(self.job_id, attempt.number, outcome, failure,
                               len(attempt.warm_started), after, counts)

    def send_start(self, node: Node) -> None:
        attempt = self.current
        assert attempt is not None
        self.pool.send(node, attempt.start_command(
            node.index, self.spec.stop_grace_period, self.spec.health.flight_recorder,
            self.spec.standby_imports))

    # --- losing nodes -----------------------------------------------------------------------
    def lose(self, node: Node, message: str) -> None:
        """The node is LOST (see NodeBook.lose); the attempt fails for it if it ran there."""
        if self.book.lose(node, message):
            self.fail_participant(node, FailureCause.NODE_FAIL, message)

    def reject(self, node: Node, problem: str) -> None:
        """An agent out of protocol is not trusted further: the node is lost (tried again
        only before a later attempt), and the controller carries on."""
        error = f"{node.host}: malformed message from the agent ({problem})"
        log.error(error)
        was_running = node.state in (NodeState.RUNNING, NodeState.UNREACHABLE)
        self.book.lose(node, error, retry=False)
        if was_running:
            self.fail_participant(node, FailureCause.NODE_FAIL, error)

    def fail_participant(self, node: Node, cause: FailureCause, message: str) -> None:
        attempt = self.current
        if attempt is not None and not attempt.ended and node.index in attempt.node_plans:
            attempt.fail(Failure(cause, message, node_index=node.index, node_rank=node.node_rank,
                                 host=node.host, at=node.last_heard_unix))

    # --- the end --------------------------------------------------------------------------
    def shutdown(self, wait: float) -> None:
        """Tell every attached agent to stop its workers and exit, and wait until it has."""
        try:
            self.checkpoint(force=True)
        except Exception:  # the agents are told all the same: none may keep its workers
            log.exception("the last checkpoint before shutting the agents down failed")
        attached = [n for n in self.nodes if n.channel is not None]
        for node in attached:
            self.pool.send(node, C.Shutdown())
        self.enter(Phase.LINGERING)  # from here on, attaching means shutting down
        self.wait(lambda: all(n.channel is None for n in attached), wait, interruptible=False)
        for node in attached:
            self.pool.drop_channel(node)
            if node.state not in (NodeState.LOST, NodeState.FAILED, NodeState.UNREACHABLE):
                self.book.set(node, NodeState.DONE)
        self.close_sinks()

    def close_sinks(self) -> None:
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.sink.close()
        if self._setup_sink is not None:
            self._setup_sink.close()

    def close(self) -> None:
        self.pool.close()
        self.preparer.close()
        self.ticker.close()


class Ticker:
    """A thread that only notes the time, every TICK seconds: where it could not, the whole
    process was not running (SIGSTOP, swapped out, a paused VM, starved of CPU), as opposed
    to the loop's thread being busy while the rest of the process ran. Only the former is
    forgiven: a loop busy for seconds (a checkpoint creating and syncing thousands of new
    log files) is not looking, but the kernel and the channels' threads go on receiving,
    and what a node sent meanwhile is read before it is judged; forgiving that time as
    well only found dead nodes that much later (4,000 simulated nodes: 7 s instead of 5)."""

    TICK = 0.1
    LATE = 5 * TICK  # a tick this late: the process was not running meanwhile

    def __init__(self) -> None:
        self._gaps: deque[tuple[float, float]] = deque(maxlen=64)
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._started = False

    def start(self) -> None:
        """Tick from now on (the controller's process, once; an engine that never ticks
        counts every long turn as a stop, the cautious answer)."""
        if not self._started:
            self._started, self._last = True, time.monotonic()
            threading.Thread(target=self._run, daemon=True, name="ticker").start()

    def _run(self) -> None:
        while not self._closed.wait(self.TICK):
            now = time.monotonic()
            if now - self._last > self.LATE:
                self._gaps.append((self._last, now))
            self._last = now

    def stopped(self, since: float, until: float) -> float:
        """Seconds of [since, until] in which the process was not running, as far as the
        ticks tell; a tick that is late now counts as well (after a SIGCONT the loop may
        run before the ticker)."""
        gaps = [*self._gaps, (self._last, until)] if until - self._last > self.LATE \
            else list(self._gaps)
        return sum(max(0.0, min(b, until) - max(a, since)) for a, b in gaps)

    def close(self) -> None:
        self._closed.set()


def judge(engine: Engine, result: AttemptResult, margin: float,
          drain_limit: float) -> AttemptResult:
    """A worker's failure is judged once its attempt is stopped and none of its nodes is
    UNREACHABLE any more (back, or LOST after ``node_timeout``): a node whose agent died
    took its workers along, and their peers' errors can come before its channel's end.
    A node lost that way is the failure's cause (Attempt.fail)."""
    attempt = engine.current
    if attempt is None or attempt.ended or result.failure is None or \
            result.failure.cause != FailureCause.WORKER_FAILED:
        return result
    engine.stop_attempt(margin, drain_limit)
    engine.wait(lambda: not any(engine.nodes[i].state == NodeState.UNREACHABLE
                                for i in attempt.participants),
                engine.spec.health.node_timeout + 1)
    return attempt.result() or result


def linger(engine: Engine) -> None:
    """After the end: agents we could not reach may still hold workers. Keep trying to
    reach them (never launching one) and shut them down; they give up by themselves
    after controller_grace, so trying longer than that is pointless, and so is trying
    once told to exit (a SIGTERM: before, it waited out the 605 s all the same)."""
    grace = engine.spec.health.controller_grace
    # Also nodes whose connector is still out: what it reaches is shut down on arrival.
    targets = [n for n in engine.nodes if n.state in (NodeState.UNREACHABLE, NodeState.LOST)
               or n.connecting]
    for node in targets:
        engine.pool.connect(node, launch=False, retry=node.state != NodeState.PENDING)
        engine.pool.hurry(node)  # one already out may be waiting seconds to try again

    def still_out() -> list[Node]:
        return [n for n in targets if n.connecting or n.channel is not None]

    # With no grace the agents keep the workers forever: then so must we keep trying.
    engine.wait(lambda: engine.exit_requested or not still_out(),
                grace + 5 if grace is not None else None, interruptible=False)
    if engine.exit_requested and (out := still_out()):
        log.warning("told to exit while still trying to reach %s: %s",
                    ", ".join(n.host for n in out),
                    "the agents there stop their workers after controller_grace"
                    if grace is not None else "with no controller_grace their agents keep "
                    "their workers")
    for node in targets:
        engine.pool.give_up(node)
        engine.pool.drop_channel(node)
