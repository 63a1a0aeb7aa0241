"""Whatever a worker or an agent sends that passes the door, the controller stores, and every
reader shows it without raising: ``status`` and ``status --json``, the live view, ``list``,
the dashboard's JSON (Starlette refuses NaN), its samples and ``/metrics``. Fuzzed with
hypothesis from the protocol's valid messages, every field replaced by hostile values; and a
record an older version stored (a heartbeat time in the year 33658) is shown as invalid."""

from __future__ import annotations

import copy
import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from agents import protocol as P
from orchestrator import api, cli
from orchestrator.attempt import Attempt
from orchestrator.logfiles import LogSink
from orchestrator.nodebook import NodeInfo
from orchestrator.plan import plan_attempt
from orchestrator.spec import validate_jobspec
from orchestrator.state import JobState, NodeState
from orchestrator.store import Store
from orchestrator.ui.metrics import exposition
from tests.unit.test_fuzz import FUZZ, JSON, VALID

SPEC = {"name": "hostile", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": ["python3", "-c", "pass"], "workdir": "/tmp"}
AGENT_SAYS = [m for m in VALID if m["type"] in {"hello", "progress", "started", "spawn_failed",
                                                "output", "exited", "stopped", "dropped"}]
HOSTILE = JSON | st.sampled_from([1e12, -1e12, 4_102_444_799.0, 2 ** 62 - 1, -(2 ** 62) + 1,
                                  1e308, 2 ** 63, "\x1b[31m<script>", "\ud800", 0, -1])
CHANGES = st.lists(st.tuples(st.sampled_from(["at", "step", "metrics", "waits", "rank",
                                              "exit_code", "signal", "error_file", "pid",
                                              "hostname", "python", "torch", "gpus", "lines",
                                              "local_rank", "error", "loss", "ranks"]),
                             HOSTILE), max_size=5)


def _job(home, tmp_path):
    store = Store(home)
    spec = validate_jobspec(SPEC)
    job_id = f"hostile-{time.monotonic_ns() % 0xffffff:06x}"
    store.create_job(job_id, "hostile", spec.model_dump_json(), str(tmp_path), 1,
                     ["local", "local"])
    store.set_state(job_id, JobState.LAUNCHING, started_at=time.time())
    plan = plan_attempt(spec, job_id, attempt=1, master_port=29500, spec_dir=str(tmp_path))
    ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers]
    store.start_attempt(job_id, 1, plan.master_addr, 29500, plan.world_size, ranks)
    store.set_state(job_id, JobState.RUNNING)
    sink = LogSink(store.log_dir(job_id, 1), ranks=plan.world_size)
    attempt = Attempt(plan, sink, {0: "local", 1: "local"}, store, job_id, {0: 2, 1: 2})
    return store, job_id, attempt


def _read_everything(home, job_id):
    """Every reader of the job, as a user and the dashboard call them."""
    from starlette.responses import JSONResponse  # what the dashboard answers with

    data = api.status(job_id, home=home)
    JSONResponse(data).render(data)  # allow_nan=False: a NaN anywhere is a 500
    json.dumps(data, allow_nan=False)
    JSONResponse(api.list_jobs(home=home)).render(api.list_jobs(home=home))
    console = Console(record=True, width=160, color_system=None, file=open("/dev/null", "w"))
    console.print(cli.render_watch(data, ["x"], now=time.time()))
    store = Store(home)
    try:
        rows = store.samples(job_id)
    finally:
        store.close()
    samples = [{"attempt": a, "rank": r, "step": s, "at": at, "metrics": m}
               for a, r, s, at, m in rows]
    JSONResponse(samples).render(samples)
    exposition(home)
    return data


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(AGENT_SAYS), CHANGES, st.integers(0, 1)),
                min_size=1, max_size=6))
def test_whatever_passes_the_door_every_reader_shows(tmp_path_factory, said):
    tmp_path = tmp_path_factory.mktemp("h")
    home = tmp_path / "home"
    store, job_id, attempt = _job(home, tmp_path)
    try:
        for base, changes, node in said:
            message = copy.deepcopy(base)
            for name, value in changes:
                target = message
                inner = message.get("ranks")
                if name in ("step", "metrics", "waits", "at", "loss") and \
                        isinstance(inner, dict) and isinstance(inner.get("0"), dict):
                    target = inner["0"]
                if name == "loss":
                    if not isinstance(target.get("metrics"), dict):
                        target["metrics"] = {}
                    target = target["metrics"]
                target[name] = value
            raw = P.decode(json.dumps(message).encode("utf-8", "surrogatepass"))
            if raw is None:
                continue
            try:
                parsed = P.parse(raw)
            except P.ProtocolError:
                continue  # refused at the door: the node's fault, nothing stored
            if isinstance(parsed, P.Hello):
                store.set_nodes(job_id, [(node, NodeState.CONNECTED, None,
                                          {"info": NodeInfo.from_hello(parsed).to_dict()})])
                continue
            attempt.handle(node, parsed)
            attempt.flush_ranks()
        store.liveness(job_id, 1, {0: time.time()}, dict(attempt.output_at))
        store.checkpoint(job_id, 1, attempt.snapshot(), {0: 1, 1: 1})
        _read_everything(home, job_id)  # while it runs
        failure = attempt.failure.to_dict() if attempt.failure else None
        store.end_attempt(job_id, 1, "FAILED" if failure else "SUCCEEDED", failure,
                          len(attempt.warm_started))
        store.set_state(job_id, JobState.FAILED if failure else JobState.SUCCEEDED,
                        failure=failure)
        attempt.sink.close()
        _read_everything(home, job_id)  # and after
    finally:
        store.close()


def test_a_time_no_date_can_be_is_shown_as_invalid_not_raised(tmp_path):
    """What an older version stored from a worker that set its heartbeat file's mtime to 1e12
    (status, cancel and submit --wait failed with 'year 33658 is out of range')."""
    home = tmp_path / "home"
    store, job_id, attempt = _job(home, tmp_path)
    store.update_ranks(job_id, 1, {0: {"heartbeat_at": 1e12, "step": 3, "output_at": 1e300},
                                   1: {"heartbeat_at": -1e15}})
    store.liveness(job_id, 1, {0: 1e12}, {})
    store.close()
    data = _read_everything(home, job_id)
    rank0 = next(r for r in data["ranks"] if r["rank"] == 0)
    assert rank0["last_heartbeat"] == "invalid time 1000000000000.0", rank0
    assert data["nodes"][0]["last_heard"].startswith("invalid time"), data["nodes"][0]
    assert api.wait(job_id, timeout=0, home=home)["job_id"] == job_id


def test_the_door_refuses_a_time_no_date_can_be():
    progress = {"type": "progress", "attempt": 1, "beat": True,
                "ranks": {"0": {"step": 3, "at": 1e12}}}
    assert "bad at" in P.check(progress)
    exited = {"type": "exited", "seq": 4, "attempt": 1, "rank": 0, "local_rank": 0,
              "exit_code": 1, "signal": None, "error_file": None, "at": -5.0}
    assert "bad at" in P.check(exited)
    assert P.check({**exited, "at": time.time()}) is None


def test_a_lone_surrogate_is_refused_at_the_door_and_kept_out_by_the_agent(tmp_path):
    """JSON lets "\\ud800" through; no log, page or line to the controller can hold it: an
    agent that sends one is out of protocol, and a worker's metric named so is not kept."""
    from agents import rankfiles

    output = {"type": "output", "seq": 3, "attempt": 1, "rank": 0, "stream": "stdout",
              "lines": ["fine", "bad \ud800"]}
    assert "valid Unicode" in P.check(output)
    assert "bad message" in P.check({**VALID[-1], "message": "\udfff"})
    progress = {"type": "progress", "attempt": 1, "beat": True,
                "ranks": {"0": {"step": 3, "metrics": {"\ud800": 1.0}, "at": 5.0}}}
    assert "bad metrics" in P.check(progress)
    beat = tmp_path / "heartbeat"
    beat.write_text('{"step": 3, "metrics": {"\\ud800": 1, "loss": 2}}')
    record, problems = rankfiles.heartbeat(str(beat))
    assert record == {"step": 3, "metrics": {"loss": 2.0}}
    assert problems == ["heartbeat metric '\\ud800' has a name that is not valid Unicode: "
                        "not kept"], problems


@pytest.mark.parametrize("total", ['"100"', "0", "-5", "1.5", str(1 << 62), "true", "[1]"])
def test_a_total_steps_that_is_not_a_count_is_the_ranks_problem_and_not_kept(tmp_path, total):
    """heartbeat(total_steps=...) gives status a percentage and an ETA: only a positive
    count within the protocol's range leaves the node; the agent refuses anything else."""
    from agents import rankfiles

    beat = tmp_path / "heartbeat"
    beat.write_text(f'{{"step": 3, "total_steps": {total}}}')
    record, problems = rankfiles.heartbeat(str(beat))
    assert record == {"step": 3, "metrics": {}}
    assert len(problems) == 1 and "total_steps" in problems[0] and "ignored" in problems[0]
    progress = {"type": "progress", "attempt": 1, "beat": True,
                "ranks": {"0": {"step": 3, "at": 5.0, "total_steps": json.loads(total)}}}
    assert "bad total_steps" in P.check(progress)


def test_a_total_steps_that_is_a_count_is_kept_and_passes_the_door(tmp_path):
    from agents import rankfiles

    beat = tmp_path / "heartbeat"
    beat.write_text('{"step": 3, "total_steps": 9000}')
    record, problems = rankfiles.heartbeat(str(beat))
    assert record == {"step": 3, "metrics": {}, "total_steps": 9000} and problems == []
    progress = {"type": "progress", "attempt": 1, "beat": True,
                "ranks": {"0": {**record, "at": 5.0}}}
    assert P.check(progress) is None
    assert P.parse(progress).ranks[0].total_steps == 9000
