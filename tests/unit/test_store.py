"""The state database's many-row writes: one statement over a JSON array where SQLite can,
a statement per row where it cannot; both must leave the same rows."""

from __future__ import annotations

import math

import pytest

from orchestrator import store as store_module
from orchestrator.state import InvalidTransition, NodeState
from orchestrator.store import Store

HOSTS = [f"h{i}" for i in range(300)]


@pytest.fixture(params=["batched", "per-row"])
def store(request, tmp_path, monkeypatch):
    if request.param == "per-row":
        monkeypatch.setattr(store_module, "_BATCH", False)
    elif not store_module._BATCH:
        pytest.fail("this SQLite cannot batch (UPDATE ... FROM and json_each): the batched "
                    "path is untested")
    s = Store(tmp_path / "home")
    s.create_job("job-000001", "t", "{}", str(tmp_path), 0, HOSTS)
    yield s
    s.close()


def test_set_nodes_many_in_order_with_history(store):
    changes = [(i, NodeState.CONNECTED, f"hello {i}", {"info": {"pid": i}})
               for i in range(len(HOSTS))]
    # A node changed twice in one batch: both steps are checked and kept in its history.
    changes += [(7, NodeState.RUNNING, None, {}), (7, NodeState.STOPPED, "done", {})]
    changes += [(8, NodeState.CONNECTED, None, {"info": {"pid": 80}})]  # same state: no event
    store.set_nodes("job-000001", changes)
    job = store.get_job("job-000001")
    assert [n.state for n in job.nodes] == [NodeState.STOPPED if i == 7 else
                                            NodeState.CONNECTED for i in range(len(HOSTS))]
    assert job.nodes[3].info == {"pid": 3}
    assert job.nodes[8].info == {"pid": 80}
    assert [(e.state, e.message) for e in job.nodes[7].history] == [
        (NodeState.CONNECTED, "hello 7"), (NodeState.RUNNING, None),
        (NodeState.STOPPED, "done")]
    assert [e.state for e in job.nodes[8].history] == [NodeState.CONNECTED]


def test_set_nodes_refuses_a_bad_transition_and_writes_nothing(store):
    with pytest.raises(InvalidTransition):
        store.set_nodes("job-000001", [(0, NodeState.CONNECTED, None, {}),
                                       (1, NodeState.DONE, None, {}),
                                       (1, NodeState.PENDING, None, {})])
    assert {n.state for n in store.get_job("job-000001").nodes} == {NodeState.PENDING}


def test_rank_updates_and_liveness_many_rows(store):
    ranks = [(r, r // 2, r % 2) for r in range(2 * len(HOSTS))]
    store.start_attempt("job-000001", 1, "10.0.0.1", 29500, len(ranks), ranks)
    fields = {r: {"state": "RUNNING", "pid": 1000 + r} for r, _, _ in ranks}
    fields[5] = {"state": "FAILED", "exit_code": 3, "metrics": {"loss": 0.5}}
    fields[6] = {"wait_share": math.nan}  # no NaN in JSON: this one goes row by row
    store.update_ranks("job-000001", 1, fields)
    store.liveness("job-000001", 1, {i: 1000.0 + i for i in range(len(HOSTS))},
                   {r: 2000.25 + r for r in range(0, len(ranks), 3)})
    store.checkpoint("job-000001", 1, {"x": 1}, {i: i * 10 for i in range(len(HOSTS))})
    job = store.get_job("job-000001")
    by_rank = {r.rank: r for r in job.ranks}
    assert by_rank[0].state == "RUNNING" and by_rank[0].pid == 1000
    assert by_rank[599].pid == 1599
    assert by_rank[5].state == "FAILED" and by_rank[5].exit_code == 3
    assert by_rank[5].metrics == {"loss": 0.5}
    assert by_rank[6].wait_share is None  # SQLite keeps NaN as NULL, either way
    assert by_rank[9].output_at == 2009.25 and by_rank[10].output_at is None
    assert [n.heard_at for n in job.nodes] == [1000.0 + i for i in range(len(HOSTS))]
    assert [n.acked_seq for n in job.nodes] == [i * 10 for i in range(len(HOSTS))]
