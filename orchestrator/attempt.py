"""One attempt of a job: what was started where, what every rank did, and its logs.

An :class:`Attempt` is fed the agents' messages by the controller (``handle``) and says when
it is over (``result``): every rank exited 0, or the first failure. It never talks to nodes
itself. Its bookkeeping is a plain dict (``snapshot``/``restore``) that the controller saves
with each checkpoint, so that a replaced controller carries on the same attempt.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator.diagnosis import stragglers
from orchestrator.logfiles import STDERR_TAIL, LogSink
from orchestrator.plan import TORCHRUN_LINE_RE, LaunchPlan, NodePlan
from orchestrator.state import AttemptOutcome, FailureCause, RankState

log = logging.getLogger("orchestrator.controller")


def start_command(number: int, node_plan: NodePlan, stop_grace: float, flight_recorder: int,
                  warm_imports: tuple[str, ...] | None = None,
                  kind: type[C.Start] = C.Start,
                  checkpoint: C.CheckpointConfig = C.NO_CHECKPOINT) -> C.Start:
    """The ``start`` of attempt ``number`` for one node (``kind`` C.Warm: a spare's standbys
    for it); ``warm_imports`` (None: cold starts only) is what its standbys import besides
    torch (agents/standby.py)."""
    return kind(number, node_plan.workdir, dict(node_plan.env), dict(node_plan.defaults),
                node_plan.route_to, node_plan.workers,
                stop_grace, flight_recorder,
                None if warm_imports is None else C.WarmImports(tuple(warm_imports)),
                checkpoint, node_plan.ranks)


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
    stacks: dict[str, str] = field(default_factory=dict)  # rank -> its stack (on a hang)
    diagnosis: str | None = None  # where the ranks were, grouped (orchestrator/diagnosis.py)
    flight_recorder: dict[str, Any] | None = None  # {dir, ranks, left_on_nodes, refused} (a hang)
    at: float | None = None  # when it happened, as well as known (unix time)
    detected_at: float | None = None  # when the controller knew (orchestrator/timelost.py)
    step: int | None = None  # the failing rank's last heartbeat step, where it gave one
    # Written when the attempt ends (orchestrator/failclass.py, orchestrator/policy.py):
    failure_class: str | None = None  # user, infrastructure, preempted, hung, unknown
    evidence: str | None = None  # the line, signal or event that decided the class
    signature: str | None = None  # the error, e.g. 'ModuleNotFoundError at train.py:4'
    decision: str | None = None  # what the restart policy did, and why

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cause"] = self.cause.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        fields: dict[str, Any] = {k: d.get(k) for k in cls.__dataclass_fields__ if k in d}
        fields["cause"] = FailureCause(d["cause"])
        fields["stderr_tail"] = list(d.get("stderr_tail") or [])
        fields["stacks"] = dict(d.get("stacks") or {})
        return cls(**fields)


@dataclass(frozen=True)
class AttemptResult:
    """How an attempt ended; ``failure`` is None exactly when it SUCCEEDED."""

    outcome: AttemptOutcome
    failure: Failure | None = None
    restored_step: int | None = None  # the checkpoint step its ranks resumed (None: fresh)


class Attempt:
    """Attempt ``plan.attempt``: its ranks' states, exits and first failure."""

    def __init__(self, plan: LaunchPlan, sink: LogSink, hosts: dict[int, str],
                 store: Any, job_id: str, nprocs: dict[int, int] | None = None,
                 checkpoint: C.CheckpointConfig = C.NO_CHECKPOINT,
                 per_node: dict[int, C.CheckpointConfig] | None = None):
        self.plan = plan
        self.checkpoint = checkpoint  # its nodes' settings, and the step its ranks resume
        # The step its ranks resumed: the one they were told, until they say which they loaded.
        self.restored_step = checkpoint.restore_step
        # Node -> its own of them: the replicas to fetch first, where other ranks' copies are.
        self.checkpoint_of = per_node or {}
        self.nprocs = nprocs or {}  # workers per node, as planned (gpu|auto differ per node)
        self.number = plan.attempt
        self.sink = sink
        self.hosts = hosts  # node index -> the host shown in log prefixes
        self.store = store
        self.job_id = job_id
        self.node_ranks = {n.node_index: n.node_rank for n in plan.nodes}
        # By node index (also: is a node a participant, in O(1), for thousands of nodes).
        self.node_plans = {n.node_index: n for n in plan.nodes}
        # The ranks each node may speak for: a node reporting another's is out of protocol.
        self.ranks_of = {n.node_index: {w.rank for w in n.workers if w.rank is not None}
                         for n in plan.nodes}
        # What each of a node's processes is, by local rank: a message must name the rank
        # that process was started as (None where torch's rendezvous or one process per node
        # owns the ranks), or it speaks for a process the node does not run.
        self.workers_of = {n.node_index: {w.local_rank: w.rank for w in n.workers}
                           for n in plan.nodes}
        # The global ranks a node's tagged output lines (torchrun's ``[orc-rank N]:``) may
        # be filed under: its own range where ranks are static, any rank of the world
        # otherwise (c10d assigns them), but never more than its ranks, nor another's.
        self._tagged: dict[int, set[int]] = {n.node_index: set() for n in plan.nodes}
        self._tag_owner: dict[int, int] = {}  # rank -> the node whose lines carry it
        self._rank_writes: dict[int, dict[str, Any]] = {}  # rank -> fields, not yet written
        self._samples: list[tuple[int, int | None, float, dict[str, float]]] = []  # not yet
        self._stragglers_named = False  # the stragglers changed since the last write
        self._participants = [n.node_index for n in plan.nodes]
        self.expected = sum(len(n.workers) for n in plan.nodes)
        self.started: set[tuple[int, int]] = set()  # (node_index, local_rank)
        self.exits: dict[int, tuple[int | None, str | None]] = {}  # rank key -> (code, signal)
        self.stopped_nodes: set[int] = set()
        self.failure: Failure | None = None
        self.stopping = False  # exits from here on are our doing, not failures
        self.ended = False  # recorded as ended in the store
        self.last_activity = time.monotonic()  # output, or a worker's heartbeat()
        self.heard = False  # a rank printed or beat: the start is over (health.startup_timeout)
        self.launched_at = time.monotonic()
        self.first_steps: dict[int, tuple[int, float]] = {}  # rank -> (step, when) first seen
        self.last_steps: dict[int, int] = {}  # rank -> the last step it gave
        self.output_at: dict[int, float] = {}  # rank -> when it last printed (wall clock)
        self.sampled_at: dict[int, float] = {}  # rank -> its last sample kept for the history
        self.unsampled: dict[int, tuple[int, int | None, float, dict[str, float]]] = {}
        self.waits: dict[int, tuple[int, int]] = {}  # rank -> (samples, waiting in collectives)
        self.stragglers: list[int] = []
        self.warm_started: set[tuple[int, int]] = set()  # (node, local rank) from a standby

    @property
    def participants(self) -> list[int]:
        return self._participants

    def start_command(self, node_index: int, stop_grace: float, flight_recorder: int,
                      warm_imports: tuple[str, ...] | None = None) -> C.Start:
        """The ``start`` a participant's agent gets (agents/commands.py)."""
        return start_command(self.number, self.node_plans[node_index], stop_grace,
                             flight_recorder, warm_imports,
                             checkpoint=self.checkpoint_of.get(node_index, self.checkpoint))

    def loaded(self, step: int) -> None:
        """Every rank said which step it loaded, the oldest ``step``: the step this attempt
        resumed (steps redone count from it; a repeated error falls back below it). It
        differs from the one they were told where a copy did not verify and the ranks agreed
        on an older one, or a DCP load resharded the newest step every old rank persisted."""
        if step == self.restored_step:
            return
        log.info("attempt %d: its ranks resumed step %d (they were told %s)", self.number,
                 step, "none" if self.restored_step is None else self.restored_step)
        self.restored_step = step
        self.store.set_restored_step(self.job_id, self.number, step)

    # --- the agents' messages ---------------------------------------------------------------
    def handle(self, node_index: int, message: P.Message) -> str | None:
        """Take one of the node's messages; returns what is wrong with it (a rank that is
        not the node's to speak for), or None."""
        if isinstance(message, P.Progress):
            if message.beat:  # a sampler's report alone is no sign of progress
                self.last_activity, self.heard = time.monotonic(), True
            if message.attempt == self.number:
                mine = self.ranks_of.get(node_index, set())
                if any(rank not in mine for rank in message.ranks):
                    return f"progress: rank not of this node {sorted(message.ranks)[:3]}"
                self._on_progress(message.ranks)
            return None
        if not isinstance(message, P.Sequenced) or message.attempt != self.number \
                or node_index not in self.node_ranks:
            return None  # a late message of an earlier attempt
        rank = getattr(message, "rank", None)
        if rank is not None and rank not in self.ranks_of[node_index]:
            return f"{type(message).__name__.lower()}: rank {rank} is not this node's"
        local = getattr(message, "local_rank", None)
        if local is not None:
            workers = self.workers_of[node_index]
            if local not in workers or workers[local] != rank:
                return (f"{type(message).__name__.lower()}: local rank {local} "
                        f"(rank {rank}) is not a process this node was started with")
        if isinstance(message, P.Output):
            self._on_output(node_index, message)
        elif isinstance(message, P.Started):
            self._on_started(node_index, message)
        elif isinstance(message, P.Exited):
            self._on_exited(node_index, message)
        elif isinstance(message, P.SpawnFailed):
            self.fail(Failure(
                FailureCause.LAUNCH_FAILED if self.number == 1 else FailureCause.WORKER_FAILED,
                f"rank {message.rank} on {self._host(node_index)} could not start: "
                f"{message.error}",
                node_index=node_index, node_rank=self.node_ranks[node_index],
                host=self._host(node_index), rank=message.rank,
                local_rank=message.local_rank))
        elif isinstance(message, P.Stopped):
            self.stopped_nodes.add(node_index)
        elif isinstance(message, P.Dropped):
            label = self._label(node_index, message.rank)
            self.sink.write(self.hosts[node_index], label, message.stream, [
                f"[orchestrator] {message.lines} {message.stream} lines of this rank were "
                "not kept: the agent's spool was full while no controller was attached "
                "(spool_max_bytes)"])
        return None

    def _host(self, node_index: int) -> str:
        return self.node_plans[node_index].host

    def _label(self, node_index: int, rank: int | None) -> str:
        return str(rank) if rank is not None else f"node{self.node_ranks[node_index]}"

    def _on_output(self, node_index: int, message: P.Output) -> None:
        host, rank, stream = self.hosts[node_index], message.rank, message.stream
        lines = list(message.lines)  # text: checked at the protocol boundary
        # Any line ends the start: a node's own (torchrun's, a launcher's) is often the only
        # kind a per-node launch gives.
        self.last_activity, self.heard = time.monotonic(), True
        if rank is not None:
            self.output_at[rank] = time.time()
            self.sink.write(host, str(rank), stream, lines)
            return
        # torchrun (c10d): each worker line comes prefixed with its global rank.
        label, group = self._label(node_index, None), list[str]()
        for line in lines:
            m = TORCHRUN_LINE_RE.match(line)
            if m and len(m.group(1)) <= 9 and self._may_tag(node_index, int(m.group(1))):
                this, line = str(int(m.group(1))), line[m.end():]
            else:  # untagged, or a tag this node may not use: the node's own, kept whole
                this = self._label(node_index, None)
            if this != label and group:
                self.sink.write(host, label, stream, group)
                group = []
            label = this
            group.append(line)
        self.sink.write(host, label, stream, group)

    def speaks_for(self, node_index: int, rank: int) -> bool:
        """May this node report on global ``rank`` (its stack, its flight recorder dump)?"""
        if node_index not in self.node_plans:
            return False
        if self.ranks_of[node_index]:
            return rank in self.ranks_of[node_index]
        return self._may_tag(node_index, rank)  # its ranks are torch's to assign

    def _may_tag(self, node_index: int, rank: int) -> bool:
        """May this node's output be filed under global ``rank``? (See ``_tagged``.)"""
        tagged = self._tagged[node_index]
        if rank in tagged:
            return True
        node = self.node_plans[node_index]
        count = _ranks_in(node)
        if self.plan.backend == "c10d":
            allowed = 0 <= rank < self.plan.world_size
        else:  # static: the node's ranks follow those of the nodes before it
            first = sum(_ranks_in(n)
                        for n in self.plan.nodes[:self.participants.index(node_index)])
            allowed = first <= rank < first + count
        if not allowed or len(tagged) >= count or rank in self._tag_owner:
            return False
        tagged.add(rank)
        self._tag_owner[rank] = node_index
        return True

    def _on_progress(self, ranks: dict[int, P.RankProgress]) -> None:
        """Steps and metrics that ranks gave heartbeat(), recorded with steps per second since
        the first step this attempt saw and, now and then, as a sample for the history; and
        each rank's share of time waiting in collectives, which names the stragglers."""
        updates: dict[int, dict[str, Any]] = {}
        samples: list[tuple[int, int | None, float, dict[str, float]]] = []
        waits_changed = False
        for rank, record in ranks.items():
            fields = dict[str, Any]()
            if record.waits is not None and record.waits[0] > 0:
                self.waits[rank] = record.waits
                fields["wait_share"] = record.waits[1] / record.waits[0]
                waits_changed = True
            if record.at is not None:
                fields.update(self._progress_fields(rank, record))
                at = record.at
                sample = (rank, fields.get("step"), at, fields["metrics"])
                if at - self.sampled_at.get(rank, 0.0) >= self._sample_every():
                    self.sampled_at[rank] = at
                    samples.append(sample)
                    self.unsampled.pop(rank, None)
                else:  # kept when the rank ends: a curve ends at its last point
                    self.unsampled[rank] = sample
            if fields:
                updates[rank] = fields
        if waits_changed:
            found = stragglers(self.waits)
            if found != self.stragglers:
                self.stragglers, self._stragglers_named = found, True
        for rank, fields in updates.items():  # written with the turn's other rank changes
            self._rank_update(rank, **fields)
        self._samples += samples

    def _progress_fields(self, rank: int, record: P.RankProgress) -> dict[str, Any]:
        step, at = record.step, record.at
        fields: dict[str, Any] = {"metrics": dict(record.metrics), "heartbeat_at": at}
        if record.total_steps is not None:
            fields["total_steps"] = record.total_steps
        if step is not None:
            fields["step"] = self.last_steps[rank] = step
            fields["step_at"] = at
            if rank not in self.first_steps:  # kept with the rank: time lost is read there
                self.first_steps[rank] = (step, float(at or 0))
                fields["first_step"], fields["first_step_at"] = step, at
            first = self.first_steps[rank]
            if at is not None and at > first[1] and step > first[0]:
                fields["steps_per_s"] = (step - first[0]) / (at - first[1])
        return fields

    def _sample_every(self) -> float:
        """Seconds between kept samples of one rank: fine at first, coarser for long runs,
        and for jobs of many ranks at most 100 samples a second (20 after the first ten
        minutes); the store thins them further as they age (Store.compact_samples)."""
        early = time.monotonic() - self.launched_at < 600
        ranks = self.plan.world_size
        return max(1.0, ranks / 100) if early else max(15.0, ranks / 20)

    def _on_started(self, node_index: int, message: P.Started) -> None:
        self.started.add((node_index, message.local_rank))
        if message.warm:
            self.warm_started.add((node_index, message.local_rank))
        if message.rank is not None:
            self._rank_update(message.rank, pid=message.pid, state=RankState.RUNNING.value)

    def _rank_update(self, rank: int, **fields: Any) -> None:
        self._rank_writes.setdefault(rank, {}).update(fields)

    def flush_ranks(self) -> None:
        """Write the ranks' starts, exits, steps and samples seen since the last flush, in
        one transaction (the controller calls it at the end of each turn of its loop): a
        job of many nodes reporting progress costs a write per turn, not per message."""
        if self._rank_writes or self._samples or self._stragglers_named:
            writes, self._rank_writes = self._rank_writes, {}
            samples, self._samples = self._samples, []
            named, self._stragglers_named = self._stragglers_named, False
            self.store.record_progress(self.job_id, self.number, writes, samples,
                                       self.stragglers if named else None)

    def _on_exited(self, node_index: int, message: P.Exited) -> None:
        rank, code, sig = message.rank, message.exit_code, message.signal
        key = rank if rank is not None else -1 - node_index
        self.exits[key] = (code, sig)
        stopping = self.stopping or self.failure is not None
        ok = code == 0
        state = RankState.SUCCEEDED if ok else (RankState.STOPPED if stopping else
                                                RankState.FAILED)
        if rank is not None:
            self._rank_update(rank, state=state.value, exit_code=code, signal=sig)
            last = self.unsampled.pop(rank, None)
            if last is not None:
                self._samples.append(last)
        if ok or stopping:
            return
        node_rank = self.node_ranks[node_index]
        host = self._host(node_index)
        label = self._label(node_index, rank)
        who = f"rank {rank}" if rank is not None else self.plan.owner(node_rank)
        how = f"exited with code {code}" if code is not None else f"was killed by {sig}"
        detail = _error_file_message(message.error_file)
        self.fail(Failure(
            FailureCause.WORKER_FAILED,
            f"{who} (local rank {message.local_rank} on node {node_rank}, {host}) {how}"
            + (f": {detail}" if detail else ""),
            node_index=node_index, node_rank=node_rank, host=host, rank=rank,
            local_rank=message.local_rank, exit_code=code, signal=sig,
            stderr_tail=list(self.sink.stderr.get(label, [])),
            error_file=message.error_file, at=message.at,
            step=self.last_steps.get(rank) if rank is not None else None))

    # --- verdicts ------------------------------------------------------------------------------
    def fail(self, failure: Failure) -> None:
        """Keep the first failure of the attempt; later ones are its consequences. But a
        node lost that was last heard before a worker's failure was seen is that failure's
        cause: a node that dies takes its workers along, and their peers' broken
        collectives can reach us before the node's loss does (which waits for a reconnect
        or ``node_timeout``). The worker's failure is then kept as its consequence."""
        first = self.failure
        if first is not None and not _caused_by(failure, first):
            return
        if first is not None:
            log.warning("%s; counted as the failure of node %s, silent since before it: %s",
                        first.message, failure.node_rank, failure.message)
            failure.detected_at = first.detected_at  # when the controller knew of trouble
        failure.detected_at = failure.detected_at or time.time()
        failure.at = min(failure.at or failure.detected_at, failure.detected_at)
        self.failure = failure

    @property
    def all_started(self) -> bool:
        return len(self.started) >= self.expected

    def result(self) -> AttemptResult | None:
        """None while the attempt runs."""
        if self.failure is not None:
            return AttemptResult(AttemptOutcome.FAILED, self.failure, self.restored_step)
        if len(self.exits) >= self.expected:
            return AttemptResult(AttemptOutcome.SUCCEEDED)
        return None

    # --- checkpoints ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "logs": self.sink.flush(),
            "log_state": self.sink.state(),
            "started": sorted(self.started),
            "warm_started": sorted(self.warm_started),
            "exits": {str(k): list(v) for k, v in self.exits.items()},
            "stopped_nodes": sorted(self.stopped_nodes),
            "failure": self.failure.to_dict() if self.failure else None,
            "stopping": self.stopping,
            "stderr": {k: list(v) for k, v in self.sink.stderr.items()},
        }

    def forgive(self, seconds: float, now: float) -> None:
        """The controller was not looking for ``seconds``: no hang counts that time."""
        self.last_activity = min(self.last_activity + seconds, now)

    def held(self) -> None:
        """Its ranks hold at a planned move's step (orchestrator/drain.py) until the move
        ends: their silence meanwhile is our doing, and no hang counts it (a whole-job stop
        persisting a big state to a slow filesystem was declared HUNG, and charged)."""
        self.last_activity = time.monotonic()

    def stop(self) -> None:
        """Its workers are being stopped: exits from here on are our doing."""
        self.stopping = True

    def end(self) -> None:
        """It is recorded as ended: nothing of it is started or stopped any more."""
        self.ended = True

    def restore(self, state: dict[str, Any],
                first_steps: dict[int, tuple[int, float]] | None = None) -> None:
        """Carry on from a checkpoint (``first_steps``: each rank's first step and when, as
        the store kept them: a rank's first step stays its first)."""
        self.first_steps = dict(first_steps or {})
        self.started = {(int(a), int(b)) for a, b in state.get("started", [])}
        self.warm_started = {(int(a), int(b)) for a, b in state.get("warm_started", [])}
        self.exits = {int(k): (v[0], v[1]) for k, v in state.get("exits", {}).items()}
        self.stopped_nodes = set(state.get("stopped_nodes", []))
        self.failure = Failure.from_dict(state["failure"]) if state.get("failure") else None
        self.stopping = bool(state.get("stopping"))
        for label, lines in state.get("stderr", {}).items():
            self.sink.stderr[label] = deque(lines, maxlen=STDERR_TAIL)


def _caused_by(lost: Failure, first: Failure) -> bool:
    """Whether node failure ``lost`` explains the worker failure ``first`` (see fail)."""
    return (lost.cause == FailureCause.NODE_FAIL and first.cause == FailureCause.WORKER_FAILED
            and lost.at is not None and first.detected_at is not None
            and lost.at < first.detected_at and lost.node_index != first.node_index)


def _ranks_in(node: NodePlan) -> int:
    """How many ranks a node runs, where one process owns them: LOCAL_WORLD_SIZE (per-node),
    or torchrun's ``--nproc-per-node`` (c10d)."""
    options = node.workers[0].env if node.workers else {}
    for size in (node.env.get("LOCAL_WORLD_SIZE"), options.get("PET_NPROC_PER_NODE")):
        if size and size.isdigit():
            return int(size)
    return len(node.workers)


def _error_file_message(content: str | None) -> str | None:
    """The first line of the message a worker wrote with torch's ``@record``; the file's own
    first line, as text, when it is not what torch writes (any depth, size or encoding: it
    is the worker's file, never the controller's problem)."""
    if not content:
        return None
    try:
        data = json.loads(content)
        record = data["message"]  # torch's error file, not a message of ours
        text = record["message"] if isinstance(record, dict) else str(record)
        lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
        return lines[-1][:2000] if lines else None
    except Exception:  # noqa: BLE001 (RecursionError, MemoryError, anything a file causes)
        first = next((ln for ln in content.splitlines() if ln.strip()), "")
        return f"error file (not torch's): {first[:200]}" if first else None
