"""A node speaks only for the processes it was started with: an exit or a start that names no
rank (or another local rank) where the node runs ranks, a stack of another node's rank, and
output lines tagged with ranks the node does not run are refused, never counted."""

from __future__ import annotations

from agents import protocol as P
from orchestrator import hang
from orchestrator.attempt import Attempt
from orchestrator.logfiles import LogSink
from orchestrator.plan import plan_attempt
from orchestrator.spec import validate_jobspec
from orchestrator.store import Store


def _attempt(tmp_path, **spec_fields):
    spec = validate_jobspec({"name": "door", "nodes": [{"host": "a"}, {"host": "b"}],
                             "nproc_per_node": 2, "command": ["python3", "-c", "pass"],
                             "workdir": "/tmp", **spec_fields})
    store = Store(tmp_path / "home")
    job_id = "door-000001"
    store.create_job(job_id, "door", spec.model_dump_json(), str(tmp_path), 1, ["a", "b"])
    plan = plan_attempt(spec, job_id, attempt=1, master_port=29500, spec_dir=str(tmp_path))
    ranks = [(w.rank, n.node_index, w.local_rank) for n in plan.nodes for w in n.workers
             if w.rank is not None]
    store.start_attempt(job_id, 1, plan.master_addr, 29500, plan.world_size, ranks)
    sink = LogSink(store.log_dir(job_id, 1), ranks=plan.world_size)
    return Attempt(plan, sink, {0: "a", 1: "b"}, store, job_id), sink


def _exited(seq, rank, local_rank, code=0):
    return P.Exited(seq, 1, rank, local_rank, code, None, None)


def test_an_exit_of_no_rank_from_a_node_that_runs_ranks_ends_nothing(tmp_path):
    attempt, _ = _attempt(tmp_path)
    assert attempt.handle(0, _exited(1, 0, 0)) is None  # a's rank 0 ends; its rank 1 runs
    assert attempt.handle(1, _exited(1, 2, 0)) is None
    assert attempt.handle(1, _exited(2, 3, 1)) is None
    problem = attempt.handle(1, _exited(3, None, 0))
    assert problem is not None and "local rank 0 (rank None)" in problem, problem
    assert attempt.result() is None  # rank 1 still runs: not SUCCEEDED


def test_four_starts_of_no_rank_from_one_node_are_not_everyone_started(tmp_path):
    attempt, _ = _attempt(tmp_path)
    for local in range(4):
        problem = attempt.handle(1, P.Started(local + 1, 1, None, local, 100 + local))
        assert problem is not None and "not a process this node was started with" in problem
    assert not attempt.started and not attempt.all_started


def test_a_start_that_pairs_a_rank_with_another_local_rank_is_refused(tmp_path):
    attempt, _ = _attempt(tmp_path)
    assert attempt.handle(1, P.Started(1, 1, 2, 1, 100)) is not None  # rank 2 is local 0
    assert attempt.handle(1, P.Started(2, 1, 2, 0, 100)) is None


def test_a_node_cannot_give_the_stack_or_the_dump_of_another_nodes_rank(tmp_path):
    attempt, _ = _attempt(tmp_path)

    def ask_all(channels, request, timeout):
        return {index: P.Stacks(1, {
            0: P.Stack("py-spy", f"stack of rank 0 from node {index}"),
            2 * index + 1: P.Stack("py-spy", f"own rank from node {index}")},
            {0: f"/forged/by/{index}"}) for index in channels}

    found = hang.collect({0: object(), 1: object()}, {0: "a", 1: "b"},  # type: ignore[dict-item]
                         ask_all, flight_recorder=True, owns=attempt.speaks_for)
    assert found.found["0"]["text"] == "stack of rank 0 from node 0"
    assert found.found["3"]["host"] == "b" and "1" in found.found
    assert {rank: dump[2] for rank, dump in found.dumps.items()} == {"0": "/forged/by/0"}


def test_tagged_lines_of_one_process_per_node_make_no_more_ranks_than_it_runs(tmp_path):
    attempt, sink = _attempt(tmp_path, launch="per-node", nodes=[{"host": "a"}],
                             nproc_per_node=1)
    lines = [f"[orc-rank {n}]: forged {n}" for n in range(3000)]
    assert attempt.handle(0, P.Output(1, 1, None, "stdout", tuple(lines))) is None
    sink.flush()
    written = _labels(sink)
    assert written == {"0", "node0"}, sorted(written)[:10]  # one rank, and the rest its own


def test_c10d_nodes_file_tagged_lines_under_at_most_their_own_count_of_ranks(tmp_path):
    attempt, sink = _attempt(tmp_path, rendezvous={"backend": "c10d"})
    ours = tuple(f"[orc-rank {r}]: from a" for r in (0, 1))
    assert attempt.handle(0, P.Output(1, 1, None, "stdout", ours)) is None
    theirs = tuple(f"[orc-rank {r}]: from b" for r in (0, 2, 3, 7, 10 ** 12))
    assert attempt.handle(1, P.Output(1, 1, None, "stdout", theirs)) is None
    sink.flush()
    # b may not use 0 (a's), nor 7 or 10**12 (no such rank): those lines stay b's own.
    assert _labels(sink) == {"0", "1", "2", "3", "node1"}


def _labels(sink: LogSink) -> set[str]:
    """The log labels (ranks, or node<N>) the sink wrote files for."""
    return {p.name[len("rank-"):-len(".log")] for p in sink.directory.glob("rank-*.log")}
