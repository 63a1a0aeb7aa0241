"""A hang on the namespace cluster: the stacks are taken before the workers are stopped, and
the failure says which rank is the odd one out and where."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes


def test_hang_keeps_every_rank_stack_and_names_the_odd_one(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "hang.py")], hosts=cluster.hosts[:2],
        health={"hang_timeout": 8}))
    result = orchestrator.wait(job_id, timeout=120)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "HUNG", failure
    assert sorted(failure["stacks"], key=int) == ["0", "1", "2", "3"]
    assert "stuck_in_data_loading" in failure["stacks"]["3"]
    assert all("all_reduce" in failure["stacks"][r] for r in "012")
    assert failure["diagnosis"].startswith("rank 3 in stuck_in_data_loading (hang.py:")
    assert "ranks 0-2 in all_reduce (hang.py:" in failure["diagnosis"], failure["diagnosis"]
    # Every rank's flight recorder, dumped on the nodes and fetched over the SSH channel.
    recorder = failure["flight_recorder"]
    assert recorder["ranks"] == [0, 1, 2, 3] and recorder["left_on_nodes"] == {}, recorder
    for rank in range(4):
        entries = pickle.loads(
            (Path(recorder["dir"]) / f"nccl_trace_rank_{rank}").read_bytes())["entries"]
        issued = any(e["profiling_name"].endswith("all_reduce") for e in entries)
        assert issued == (rank != 3), (rank, entries)
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "status", job_id],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "rank 3 in stuck_in_data_loading" in shown.stdout, shown.stdout
    assert_no_job_processes(job_id)
