#!/usr/bin/env python3
"""Endurance: a job of 1,000 ranks over a simulated week, in compressed time.

    python benchmarks/bench_endurance.py [--ranks 1000] [--nproc 8] [--days 7]
                                         [--failures-per-day 1] [--calls 30] [--exact]
                                         [--quick] [--out benchmarks] [--name endurance]

"Bounded in time as well as in space" (the design's principles): every table, file and reader must
cost the same on day 7 as on day 1. This drives the controller's bookkeeping for a week of a
job of --ranks ranks (--nproc per node, nodes ``host: local``) without sleeping, and reports
at simulated days 1, 3 and 7 what grows: the size of state.db (and its -wal), the latency of
``orchestrator.api.status`` (``status --json`` and the dashboard's job API), of the
dashboard's samples query (``Store.samples``, limit 20000, alone and as the route serves it:
a fresh Store, ``get_job``, the rows as JSON) and of the Prometheus exposition
(``orchestrator.ui.metrics.exposition``), p50/p95 of --calls calls each; the sample rows;
the process's VmRSS (taken before the readers run: the bookkeeping's memory, plus whatever
earlier readers left in the heap); and the size of the job's log directory.

What is real: the store (``Store(durable=True)``: synchronous=FULL, WAL, as the controller
opens it), the spec (``validate_jobspec``), the plans (``plan_attempt``), the attempts
(``Attempt`` fed messages parsed by ``agents.protocol.parse``, its ``flush_ranks`` once per
simulated turn), the log files (``LogSink``, capped per rank, as the controller opens it),
the checkpoints (``Store.checkpoint`` of ``Attempt.snapshot`` as Engine.checkpoint does),
``Store.liveness``, ``Store.compact_samples`` every COMPACT_EVERY simulated seconds with the
arguments Engine._checks gives it, the job's and nodes' state changes, and every reader.

What is simulated: the clock. ``time`` in orchestrator.attempt, orchestrator.store,
orchestrator.timelost and orchestrator.ui.metrics is replaced by a clock that returns the
simulated time (time.time and time.monotonic; the rest of the module is the real one), so
that attempt start and end times, the sampling (Attempt._sample_every reads time.monotonic)
and the readers' "now" all live in the simulated week. Not simulated at all: the event loop,
the channels, the node pool and the agents. Messages go straight from a dict to
``protocol.parse`` to ``Attempt.handle``; there is no hang or silence detection, and no
reader's request (cancel, stacks) to poll for.

The job: every rank calls heartbeat(step) each second, 2 steps a second, with two metrics
(loss, tokens_per_s); the agent forwards one progress message per node per second. Each rank
prints one line a minute. --failures-per-day failures (at the middle of each 1/f of a day):
one rank exits 1 with a short traceback on stderr, the others are stopped (SIGTERM), the
attempt ends (FAILED, a failure dict as the controller records it), the job goes RESTARTING
and LAUNCHING, and 60 s later the next attempt starts, resuming at the last multiple of 1,000
steps (a checkpoint every 500 s). Logs capped at 16 MiB per rank (logs.max_bytes_per_rank).

What is reduced, so that a week takes minutes, not hours (unless --exact):

- progress: generated only at the simulated seconds at which the attempt keeps a sample
  (plus the second of a failure). Attempt keeps at most one sample per rank per
  _sample_every() seconds (max(1, ranks/100) in an attempt's first 10 minutes, then
  max(15, ranks/20): 10 s and 50 s for 1,000 ranks), all ranks report at the same whole
  seconds, so the stored samples are exactly those of one message per node per second
  (checked: 400 ranks, 0.02 day, one failure: the same 124,000 (attempt, rank, step, at)
  rows with and without --exact). What is lost: the ranks' latest step and
  heartbeat_at in the store are up to one sample interval old between two feeds, and
  heartbeat_at/step rows are rewritten ~50x less often (the WAL sees fewer writes);
- liveness (Store.liveness): written with each progress feed, not once a second;
- log lines: one per rank per simulated minute, delivered in batches every 5 simulated
  minutes (5 lines per rank per message), each batch followed by a checkpoint (the
  controller checkpoints after every turn that received lines, many times a second);
- the restart: no backoff or launch is simulated beyond the 60 s gap.

--exact feeds every second and writes liveness every second (use it for small runs only).
The simulated week starts on a boundary of compaction's widest bucket, and the random
numbers are seeded: two runs keep the same samples. A default run took about 2 minutes of
wall time per simulated day on 2 shared cores (about 15 minutes for the week); --quick about
30 s. It writes about 340 MiB of logs per simulated day to a temporary directory, removed
at the end (--keep keeps it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import resource
import socket
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents import protocol as P  # noqa: E402
from orchestrator import api, timelost  # noqa: E402
from orchestrator import attempt as attempt_module  # noqa: E402
from orchestrator import store as store_module  # noqa: E402
from orchestrator.attempt import Attempt  # noqa: E402
from orchestrator.controller import log_files_budget  # noqa: E402
from orchestrator.engine import COMPACT_EVERY  # noqa: E402
from orchestrator.logfiles import LogSink  # noqa: E402
from orchestrator.nodebook import NodeInfo  # noqa: E402
from orchestrator.pids import pid_namespace  # noqa: E402
from orchestrator.plan import plan_attempt  # noqa: E402
from orchestrator.spec import JobSpec, validate_jobspec  # noqa: E402
from orchestrator.state import JobState, NodeState  # noqa: E402
from orchestrator.store import SAMPLE_BANDS, Store  # noqa: E402
from orchestrator.ui import metrics as metrics_module  # noqa: E402
from orchestrator.ui.metrics import exposition  # noqa: E402

DAY = 86400
STEPS_PER_S = 2.0
WARMUP = 30  # seconds from an attempt's start to its ranks' first heartbeat(step)
RESUME_EVERY = 1000  # steps between the job's checkpoints: a restart resumes at one
RESTART_GAP = 60  # seconds from a failure to the next attempt's start
LOG_EVERY = 300  # seconds between two batches of output (one line per rank per minute)
LOG_CAP = 16 << 20  # logs.max_bytes_per_rank
REPORT_DAYS = (1, 3, 7)
TARGET_STATUS_P95_MS = 200.0
TARGET_DB_MB = 200.0
TARGET_GROWTH = 1.5
MB = 1e6
MIB = 1 << 20


class SimClock:
    """time.time() and time.monotonic() as the simulated time; the rest of ``time`` real."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def simulated(clock: SimClock) -> Iterator[None]:
    """The modules that read the clock on the simulated paths read ``clock``."""
    with contextlib.ExitStack() as stack:
        for module in (attempt_module, store_module, timelost, metrics_module):
            stack.enter_context(mock.patch.object(module, "time", clock))
        yield


def vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _timed(call: Callable[[], Any], n: int) -> dict[str, float]:
    """p50 and p95 of ``n`` calls, in milliseconds (after one call not counted: imports)."""
    call()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        took.append((time.perf_counter() - t) * 1000)
    return {"p50": _pct(took, 50), "p95": _pct(took, 95), "max": max(took)}


def _tree_bytes(path: Path) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    size = files = 0
    for base, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(base, name)).st_size
                files += 1
    return size, files


class Endurance:
    """One job driven through ``days`` simulated days (see the module's docstring)."""

    def __init__(self, home: Path, *, ranks: int, nproc: int, days: float,
                 failures_per_day: float, calls: int, exact: bool, clock: SimClock,
                 seed: int = 1):
        if ranks % nproc:
            raise SystemExit(f"error: --ranks {ranks} is not a multiple of --nproc {nproc}")
        self.home, self.clock, self.exact, self.calls = home, clock, exact, calls
        self.ranks, self.nproc, self.nodes = ranks, nproc, ranks // nproc
        self.days = days
        self.t0 = clock.now
        self.rng = random.Random(seed)
        self.job_id = "endurance-000001"
        self.spec_dir = str(home.parent)
        failures = math.floor(days * failures_per_day + 1e-9)
        self.failures = [round((k + 0.5) * DAY / failures_per_day) for k in range(failures)]
        self.spec: JobSpec = validate_jobspec({
            "name": "endurance", "nodes": [{"host": "local"}] * self.nodes,
            "nproc_per_node": nproc, "command": ["python3", "train.py"], "workdir": "/tmp",
            "max_restarts": failures + 1, "logs": {"max_bytes_per_rank": LOG_CAP}})
        self.store = Store(home, durable=True)  # as the controller process opens it
        self.hosts = {i: "local" for i in range(self.nodes)}
        self.seq = dict.fromkeys(range(self.nodes), 0)  # each agent's message numbers
        self.current: Attempt | None = None
        self.previous: Attempt | None = None
        self.started_at = 0  # the current attempt's start (simulated seconds)
        self.resume_step = 0
        self.last_step = 0
        self.restarts = 0
        self.feeds = self.messages = self.lines = 0
        self.compacted_wall: float | None = None
        self.next_feed: int | None = None
        self.fed_at: int | None = None
        self.next_start: int | None = 0

    # --- the controller's side -----------------------------------------------------------
    def launch(self) -> None:
        """submit and the controller's first moments: the job row, the nodes' hellos."""
        store, job_id, spec = self.store, self.job_id, self.spec
        store.create_job(job_id, spec.name, spec.model_dump_json(), self.spec_dir,
                         spec.max_restarts, [n.host for n in spec.nodes])
        store.claim_controller(job_id, os.getpid(), socket.gethostname(), pid_namespace())
        store.set_state(job_id, JobState.LAUNCHING, started_at=self.clock.now)
        changes: list[tuple[int, NodeState, str | None, dict[str, Any]]] = []
        for i in range(self.nodes):
            hello = P.parse({"type": "hello", "protocol": P.VERSION, "pid": 10_000 + i,
                             "attempt": 0, "hostname": f"node{i:04d}", "python": "3.11",
                             "torch": "2.6.0", "gpus": self.nproc, "instance": f"{i:08x}",
                             "last_seq": 0, "workers": []})
            assert isinstance(hello, P.Hello)
            changes.append((i, NodeState.CONNECTED, None,
                            {"info": NodeInfo.from_hello(hello).to_dict()}))
        store.set_nodes(job_id, changes)

    def _message(self, node: int, raw: dict[str, Any]) -> None:
        """One of ``node``'s messages through the door to the attempt it belongs to."""
        if raw["type"] != P.PROGRESS:
            self.seq[node] += 1
            raw["seq"] = self.seq[node]
        message = P.parse(raw)
        self.messages += 1
        for attempt in (self.current, self.previous):
            if attempt is not None and attempt.number == raw["attempt"]:
                problem = attempt.handle(node, message)
                assert problem is None, problem

    def _flush(self) -> None:
        """The end of a turn (Engine.flush)."""
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.flush_ranks()

    def _checkpoint(self) -> None:
        """Engine.checkpoint: log sizes and handled messages in one transaction."""
        attempt = self.current
        assert attempt is not None
        state = {**attempt.snapshot(), "participants": attempt.participants,
                 "master_port": attempt.plan.master_port, "nprocs": attempt.nprocs,
                 "sync_tree": None}
        if self.previous is not None:
            self.previous.sink.flush()
        self.store.checkpoint(self.job_id, attempt.number, state, dict(self.seq),
                              len(attempt.warm_started))

    def start_attempt(self, t: int) -> None:
        """Controller._run_attempt, then every worker's ``started`` and the job RUNNING."""
        number = (self.current.number if self.current else 0) + 1
        plan = plan_attempt(self.spec, self.job_id, attempt=number, restart_count=number - 1,
                            master_port=29500 + number, spec_dir=self.spec_dir)
        self._flush()
        if self.previous is not None:
            self.previous.sink.close()
        self.previous = self.current
        logs = self.spec.logs
        sink = LogSink(self.store.log_dir(self.job_id, number), cap=logs.max_bytes_per_rank,
                       ranks=plan.world_size, min_free=logs.min_free_bytes,
                       max_open=log_files_budget(self.nodes))
        attempt = Attempt(plan, sink, self.hosts, self.store, self.job_id,
                          dict.fromkeys(range(self.nodes), self.nproc))
        self.current = attempt
        ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers
                 if w.rank is not None]
        self.store.start_attempt(self.job_id, number, plan.master_addr, plan.master_port or 0,
                                 plan.world_size, ranks)
        self._checkpoint()
        self.store.set_nodes(self.job_id, [(n.node_index, NodeState.RUNNING, None,
                                            {"node_rank": n.node_rank}) for n in plan.nodes])
        for rank, node, local_rank in ranks:
            self._message(node, {"type": "started", "attempt": number, "rank": rank,
                                 "local_rank": local_rank, "pid": 100_000 + rank})
        self._flush()
        self._checkpoint()
        self.store.set_state(self.job_id, JobState.RUNNING)
        self.started_at, self.resume_step = t, self.last_step // RESUME_EVERY * RESUME_EVERY
        self.next_feed, self.next_start = t + WARMUP, None

    def _step(self, t: int) -> int:
        return self.resume_step + int((t - self.started_at - WARMUP) * STEPS_PER_S)

    def _loss(self, step: int) -> float:
        return 2.0 + 8.0 / (1.0 + step / 2000.0) + self.rng.gauss(0.0, 0.02)

    def feed(self, t: int) -> None:
        """Every node's progress message of second ``t``, a turn's flush, liveness."""
        attempt = self.current
        assert attempt is not None
        step = self.last_step = self._step(t)
        for node in range(self.nodes):
            first = node * self.nproc
            self._message(node, {"type": P.PROGRESS, "attempt": attempt.number, "beat": True,
                                 "ranks": {str(r): {"step": step, "at": float(self.t0 + t),
                                                    "metrics": {
                                                        "loss": self._loss(step),
                                                        "tokens_per_s": self.rng.gauss(
                                                            30000.0, 300.0)}}
                                           for r in range(first, first + self.nproc)}})
        self._flush()
        now = self.clock.now
        self.store.liveness(self.job_id, attempt.number, dict.fromkeys(range(self.nodes), now),
                            dict(attempt.output_at), dict.fromkeys(range(self.nodes), 1.0))
        self.feeds, self.fed_at = self.feeds + 1, t
        self.next_feed = t + 1 if self.exact else self._next_sample(t)

    def _next_sample(self, t: int) -> int:
        """The first second after ``t`` at which a progress message would give a sample:
        the attempt's own rule (Attempt._sample_every, which grows with its age), asked at
        that second. All ranks are sampled at the same seconds."""
        attempt = self.current
        assert attempt is not None
        last = attempt.sampled_at.get(0)
        if last is None:
            return t + 1
        last -= self.t0
        now, s = self.clock.now, t + 1
        try:
            while True:
                self.clock.now = self.t0 + s
                due = math.ceil(last + attempt._sample_every() - 1e-9)
                if due <= s:
                    return s
                s = due
        finally:
            self.clock.now = now

    def output(self, t: int) -> None:
        """The last LOG_EVERY seconds of output (one line per rank per minute), a checkpoint."""
        attempt = self.current
        if attempt is None or t - self.started_at <= WARMUP:
            return
        minutes = [m for m in range(t - LOG_EVERY + 60, t + 1, 60) if m > self.started_at]
        for rank in range(self.ranks):
            lines = []
            for m in minutes:
                step = max(self.resume_step, self._step(m))
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.t0 + m))
                lines.append(f"{stamp} INFO train.py:212] step {step:>8} | loss "
                             f"{self._loss(step):.4f} | tokens/s "
                             f"{self.rng.gauss(30000.0, 300.0):,.0f} | lr 3.00e-04 | "
                             f"grad_norm {abs(self.rng.gauss(0.8, 0.1)):.3f}")
            self._message(rank // self.nproc, {"type": "output", "attempt": attempt.number,
                                               "rank": rank, "stream": "stdout", "lines": lines})
            self.lines += len(lines)
        self._flush()
        self._checkpoint()

    def fail(self, t: int) -> None:
        """One rank exits 1; the controller stops the others and ends the attempt (FAILED)."""
        attempt = self.current
        assert attempt is not None
        if self.fed_at != t and t >= self.started_at + WARMUP:
            self.feed(t)  # the agents' last progress, at the second of the failure
        at = float(self.t0 + t)
        victim = self.rng.randrange(self.ranks)
        node = victim // self.nproc
        self._message(node, {"type": "output", "attempt": attempt.number, "rank": victim,
                             "stream": "stderr", "lines": [
                                 "Traceback (most recent call last):",
                                 '  File "train.py", line 212, in <module>',
                                 "    loss.backward()",
                                 "RuntimeError: CUDA error: an illegal memory access was "
                                 "encountered"]})
        self._message(node, {"type": "exited", "attempt": attempt.number, "rank": victim,
                             "local_rank": victim % self.nproc, "exit_code": 1,
                             "signal": None, "error_file": None, "at": at})
        self._flush()
        attempt.stop()  # Engine.stop_attempt
        for rank in range(self.ranks):
            if rank != victim:
                self._message(rank // self.nproc, {
                    "type": "exited", "attempt": attempt.number, "rank": rank,
                    "local_rank": rank % self.nproc, "exit_code": None, "signal": "SIGTERM",
                    "error_file": None, "at": at + 1})
        for i in range(self.nodes):
            self._message(i, {"type": "stopped", "attempt": attempt.number})
        self._flush()
        self.store.set_nodes(self.job_id, [(i, NodeState.STOPPED, None, {})
                                           for i in range(self.nodes)])
        result = attempt.result()
        assert result is not None and result.failure is not None
        failure = result.failure
        failure.failure_class, failure.evidence = "user", failure.stderr_tail[-1]
        failure.signature = "RuntimeError at train.py:212"
        failure.decision = f"restart {self.restarts + 1} of {self.spec.max_restarts}"
        self._checkpoint()  # Engine.end_attempt
        attempt.end()
        self.store.end_attempt(self.job_id, attempt.number, result.outcome.value,
                               failure.to_dict(), len(attempt.warm_started))
        self.restarts += 1
        self.store.set_state(self.job_id, JobState.RESTARTING, restarts=self.restarts)
        self.store.set_state(self.job_id, JobState.LAUNCHING)
        self.next_feed, self.next_start = None, t + RESTART_GAP

    def compact(self) -> None:
        """Engine._checks, every COMPACT_EVERY seconds."""
        wall = self.clock.now
        self.store.compact_samples(self.job_id, wall, self.compacted_wall)
        self.compacted_wall = wall

    # --- the readers ----------------------------------------------------------------------
    def _route_samples(self) -> bytes:
        """The dashboard's /api/jobs/<id>/samples, as orchestrator/ui serves it."""
        store = Store(self.home)
        try:
            store.get_job(self.job_id)
            rows = store.samples(self.job_id)
        finally:
            store.close()
        return json.dumps([{"attempt": a, "rank": r, "step": s, "at": at, "metrics": m}
                           for a, r, s, at, m in rows], ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()  # as Starlette's JSONResponse

    def _counts(self) -> tuple[dict[str, int], dict[str, float]]:
        """Rows of the tables that grow, and MB of each table and index (with the free
        pages as "(free)"; sizes empty where this SQLite has no dbstat)."""
        with contextlib.closing(sqlite3.connect(f"file:{self.home / 'state.db'}?mode=ro",
                                                uri=True)) as db:
            rows = {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                    for table in ("samples", "ranks", "attempts", "nodes", "node_events")}
            sizes: dict[str, float] = {}
            with contextlib.suppress(sqlite3.Error):
                sizes = {name: size / MB for name, size in db.execute(
                    "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC")
                    if size >= 0.01 * MB}
                page = db.execute("PRAGMA page_size").fetchone()[0]
                sizes["(free)"] = db.execute("PRAGMA freelist_count").fetchone()[0] * page / MB
        return rows, sizes

    def report(self, day: float, wall: float, cpu: float) -> dict[str, Any]:
        """What grows, at simulated ``day``. The readers are timed with the simulation's
        own heap frozen (gc.freeze): a real `status` runs in a process of its own, and a
        collection that walks a week of simulated bookkeeping is not its cost."""
        gc.collect()
        gc.freeze()
        try:
            return self._report(day, wall, cpu)
        finally:
            gc.unfreeze()

    def _report(self, day: float, wall: float, cpu: float) -> dict[str, Any]:
        row: dict[str, Any] = {"day": day, "attempt": self.current.number if self.current
                               else None, "rss_mib": vm_rss_mib(), "sim_wall_s": wall,
                               "sim_cpu_s": cpu}
        db, wal = (self.home / "state.db").stat().st_size, 0
        with contextlib.suppress(OSError):
            wal = (self.home / "state.db-wal").stat().st_size
        row.update(db_mb=(db + wal) / MB, db_file_mb=db / MB, wal_mb=wal / MB)
        row["rows"], row["tables_mb"] = self._counts()
        row["samples"] = row["rows"]["samples"]
        logs, files = _tree_bytes(self.store.job_dir(self.job_id) / "logs")
        row.update(logs_mib=logs / MIB, log_files=files)
        row["status_ms"] = _timed(lambda: api.status(self.job_id, home=self.home), self.calls)
        row["status_kib"] = len(json.dumps(api.status(self.job_id, home=self.home))) / 1024
        opened = Store(self.home)
        try:
            row["samples_ms"] = _timed(lambda: opened.samples(self.job_id), self.calls)
        finally:
            opened.close()
        row["samples_route_ms"] = _timed(self._route_samples, self.calls)
        row["samples_route_kib"] = len(self._route_samples()) / 1024
        row["metrics_ms"] = _timed(lambda: exposition(self.home), self.calls)
        row["metrics_kib"] = len(exposition(self.home)[0]) / 1024
        return row

    # --- the week -------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        end = round(self.days * DAY)
        reports = [round(d * DAY) for d in REPORT_DAYS if d <= self.days]
        if end not in reports:
            reports.append(end)
        failures = list(self.failures)
        next_log, next_compact = LOG_EVERY, int(COMPACT_EVERY)
        next_day = DAY
        rows = []
        wall0, cpu0 = time.monotonic(), _cpu()
        self.launch()
        while True:
            t = min(x for x in (self.next_start, self.next_feed, failures[0] if failures
                                else None, next_log, next_compact, reports[0] if reports
                                else None) if x is not None)
            if t > end or not reports:
                break
            self.clock.now = self.t0 + t
            if self.next_start == t:
                self.start_attempt(t)
            if self.next_feed == t:
                self.feed(t)
            if next_log == t:
                self.output(t)
                next_log += LOG_EVERY
            if failures and failures[0] == t:
                failures.pop(0)
                if self.current is not None and not self.current.ended:
                    self.fail(t)
            if next_compact == t:
                self.compact()
                next_compact += int(COMPACT_EVERY)
            if reports[0] == t:
                reports.pop(0)
                day = t / DAY
                row = self.report(day, time.monotonic() - wall0, _cpu() - cpu0)
                rows.append(row)
                print(_line(row), flush=True)
            if t >= next_day:
                print(f"  simulated day {t / DAY:g}: {time.monotonic() - wall0:.0f} s wall, "
                      f"{self.feeds} feeds, {self.messages} messages", flush=True)
                next_day += DAY
        for attempt in (self.previous, self.current):
            if attempt is not None:
                attempt.sink.close()
        self.store.close()
        return rows


def _line(row: dict[str, Any]) -> str:
    return (f"day {row['day']:g}: state.db {row['db_mb']:.1f} MB, status p95 "
            f"{row['status_ms']['p95']:.0f} ms, samples p95 {row['samples_ms']['p95']:.0f} ms, "
            f"metrics p95 {row['metrics_ms']['p95']:.0f} ms, {row['samples']} samples, "
            f"RSS {row['rss_mib']:.0f} MiB ({row['sim_wall_s']:.0f} s wall so far)")


def table(rows: list[dict[str, Any]]) -> list[str]:
    def ms(d: dict[str, float]) -> str:
        return f"{d['p50']:.0f} / {d['p95']:.0f}"

    out = ["| simulated | state.db + wal (MB) | status --json p50 / p95 (ms) | "
           "samples query p50 / p95 (ms) | samples route p50 / p95 (ms) | "
           "/metrics p50 / p95 (ms) | sample rows | RSS (MiB) | logs (MiB) | attempt |",
           "| --- |" + " ---: |" * 9]
    for r in rows:
        out.append(f"| day {r['day']:g} | {r['db_mb']:.1f} | {ms(r['status_ms'])} | "
                   f"{ms(r['samples_ms'])} | {ms(r['samples_route_ms'])} | "
                   f"{ms(r['metrics_ms'])} | {r['samples']:,} | {r['rss_mib']:.0f} | "
                   f"{r['logs_mib']:.0f} | {r['attempt']} |")
    return out


def breakdown(rows: list[dict[str, Any]]) -> list[str]:
    """Where state.db's bytes are, and what the readers return."""
    out = ["| simulated | state.db (MB) | -wal (MB) | samples + its indexes (MB) | "
           "free pages (MB) | rank rows | node events | status (KiB) | /metrics (KiB) |",
           "| --- |" + " ---: |" * 8]
    for r in rows:
        t = r["tables_mb"]
        samples = sum(v for k, v in t.items() if k.startswith("samples"))
        out.append(f"| day {r['day']:g} | {r['db_file_mb']:.1f} | {r['wal_mb']:.1f} | "
                   f"{samples:.1f} | {t.get('(free)', 0.0):.1f} | {r['rows']['ranks']:,} | "
                   f"{r['rows']['node_events']:,} | {r['status_kib']:.0f} | "
                   f"{r['metrics_kib']:.0f} |")
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals, checked on the last report against the first."""
    first, last = rows[0], rows[-1]
    found = [
        ("status --json p95 (ms)", last["status_ms"]["p95"], f"< {TARGET_STATUS_P95_MS:g}",
         last["status_ms"]["p95"] < TARGET_STATUS_P95_MS),
        ("state.db + wal (MB)", last["db_mb"], f"< {TARGET_DB_MB:g}",
         last["db_mb"] < TARGET_DB_MB)]
    if len(rows) > 1:
        for label, key in (("status --json p95", "status_ms"), ("state.db + wal", "db_mb")):
            a, b = first[key], last[key]
            a, b = (a["p95"], b["p95"]) if isinstance(a, dict) else (a, b)
            ratio = b / a if a else math.inf
            found.append((f"{label}, day {last['day']:g} / day {first['day']:g}", ratio,
                          f"<= {TARGET_GROWTH:g}x", ratio <= TARGET_GROWTH))
    return [{"what": w, "value": v, "target": t, "ok": ok} for w, v, t, ok in found]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--failures-per-day", type=float, default=1.0)
    p.add_argument("--calls", type=int, default=30, help="calls of each reader per report")
    p.add_argument("--exact", action="store_true",
                   help="a progress message per node every second (small runs only)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 ranks, 1 day")
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    p.add_argument("--name", help="file stem for the .md/.json (default: endurance, or "
                   "endurance-quick with --quick)")
    p.add_argument("--keep", action="store_true", help="keep the simulated home (printed)")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.days = 64, 1.0
    args.name = args.name or ("endurance-quick" if args.quick else "endurance")
    cmd = "python benchmarks/bench_endurance.py " + " ".join(sys.argv[1:])
    tmp = tempfile.mkdtemp(prefix="bench-endurance-")
    # The start on a boundary of the widest bucket of compaction (SAMPLE_BANDS): every run
    # keeps the same samples.
    widest = int(max(width for _age, width in SAMPLE_BANDS))
    clock = SimClock(float(int(time.time()) // widest * widest))
    wall, cpu = time.monotonic(), _cpu()
    try:
        with simulated(clock):
            sim = Endurance(Path(tmp) / "home", ranks=args.ranks, nproc=args.nproc,
                            days=args.days, failures_per_day=args.failures_per_day,
                            calls=args.calls, exact=args.exact, clock=clock)
            print(f"simulating {args.days:g} day(s) of {args.ranks} ranks "
                  f"({sim.nodes} nodes x {args.nproc}), {len(sim.failures)} failure(s), "
                  f"in {tmp}", flush=True)
            rows = sim.run()
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    wall, cpu = time.monotonic() - wall, _cpu() - cpu
    checked = targets(rows)
    params = {"ranks": args.ranks, "nproc": args.nproc, "nodes": sim.nodes, "days": args.days,
              "failures_per_day": args.failures_per_day, "calls": args.calls,
              "exact": args.exact, "log_cap_bytes": LOG_CAP, "steps_per_s": STEPS_PER_S,
              "log_lines_per_rank_per_min": 1, "log_batch_s": LOG_EVERY,
              "restart_gap_s": RESTART_GAP, "compact_every_s": COMPACT_EVERY,
              "progress_feeds": sim.feeds, "messages": sim.messages, "log_lines": sim.lines,
              "failures": len(sim.failures), "wall_s": wall, "cpu_s": cpu,
              "cores": os.cpu_count(), "sqlite": sqlite3.sqlite_version}
    feeding = ("one progress message per node every simulated second, liveness every second"
               if args.exact else
               "progress generated only at the seconds the attempt keeps a sample (the same "
               "stored samples as one message per node per second), liveness written with "
               "each of those feeds, not every second")
    reduced = [feeding, f"output: one line per rank per minute, delivered every {LOG_EVERY} s "
               "(and a checkpoint after each batch)", "the clock of the store, the attempts "
               "and the readers is the simulated one", "no event loop, channels or agents"]
    lines = table(rows)
    goals = [f"- {c['what']}: {c['value']:.2f}, target {c['target']}: "
             f"{'ok' if c['ok'] else 'MISSED'}" for c in checked]
    md = (f"# Endurance: a simulated week\n\n`{cmd.strip()}`: {args.ranks} ranks "
          f"({sim.nodes} nodes x {args.nproc}), {args.days:g} simulated day(s), "
          f"{len(sim.failures)} failure(s) ({args.failures_per_day:g} a day), logs capped at "
          f"{LOG_CAP >> 20} MiB per rank; readers: p50 / p95 of {args.calls} calls each. "
          f"{wall:.0f} s wall, {cpu:.0f} s CPU on {os.cpu_count()} cores (shared, noisy); "
          f"SQLite {sqlite3.sqlite_version}.\n\nCompressed time, reduced work: "
          + "; ".join(reduced) + " (see the docstring of benchmarks/bench_endurance.py).\n\n"
          + "\n".join(lines) + "\n\nTargets (last report against the first):\n\n"
          + "\n".join(goals) + "\n\nWhere the bytes are:\n\n" + "\n".join(breakdown(rows))
          + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(md)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"command": cmd.strip(), "params": params, "reduced": reduced, "rows": rows,
         "targets": checked}, indent=1))
    print("\n".join(lines))
    print("\n".join(goals))
    print(f"{wall:.0f} s wall, {cpu:.0f} s CPU; wrote {out / args.name}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
