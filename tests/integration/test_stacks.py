"""Stacks of every rank on demand: py-spy, and the faulthandler hook when py-spy is not
there (no ptrace needed)."""

from __future__ import annotations

import pytest

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, wait_for_output, write_spec


@pytest.mark.parametrize("py_spy", ["found", "none"])
def test_stacks_of_a_running_job_name_the_odd_rank(home, tmp_path, monkeypatch, py_spy):
    if py_spy == "none":  # the agents inherit it: they must fall back to faulthandler
        monkeypatch.setenv("ORCHESTRATOR_PY_SPY", "none")
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "stacks", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "hang.py")], "workdir": str(tmp_path),
        "stop_grace_period": 2}))
    wait_for_output(job_id, "ready", 4, timeout=90)
    data = orchestrator.stacks(job_id)
    assert sorted(data["stacks"], key=int) == ["0", "1", "2", "3"], data
    method = "py-spy" if py_spy == "found" else "faulthandler"
    assert {s["method"] for s in data["stacks"].values()} == {method}, data
    assert "stuck_in_data_loading" in data["stacks"]["3"]["text"]
    assert data["diagnosis"].startswith("rank 3 in stuck_in_data_loading (hang.py:")
    assert "ranks 0-2 in " in data["diagnosis"]
    one = orchestrator.stacks(job_id, rank=1)
    assert list(one["stacks"]) == ["1"]
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)


def test_a_hang_keeps_stacks_and_every_rank_s_flight_recorder(home, tmp_path):
    import pickle
    from pathlib import Path

    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "hang", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "hang.py")], "workdir": str(tmp_path),
        "stop_grace_period": 2, "health": {"hang_timeout": 15}}))
    result = orchestrator.wait(job_id, timeout=120)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "HUNG", failure
    assert failure["diagnosis"].startswith("rank 3 in stuck_in_data_loading"), failure
    # torch's flight recorder (gloo here, NCCL on GPUs), dumped on the hang and fetched:
    recorder = failure["flight_recorder"]
    assert recorder["ranks"] == [0, 1, 2, 3] and recorder["left_on_nodes"] == {}, recorder
    ops = {}
    for rank in range(4):
        dump = pickle.loads((Path(recorder["dir"]) / f"nccl_trace_rank_{rank}").read_bytes())
        ops[rank] = [(e["profiling_name"], e["state"]) for e in dump["entries"]]
    # Ranks 0-2 issued the all_reduce that never completes; rank 3 never issued it.
    for rank in (0, 1, 2):
        assert ops[rank][-1][0].endswith("all_reduce") and ops[rank][-1][1] != "completed", ops
    assert not any(name.endswith("all_reduce") for name, _ in ops[3]), ops
    # (torch 2.13's analyzer, torch.distributed.flight_recorder.fr_trace, reads NCCL dumps;
    # on gloo dumps it stops at a KeyError: their pg_config names the group '', not '0'.)
    assert_no_job_processes(job_id)
