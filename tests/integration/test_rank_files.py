"""A worker's heartbeat, sampler and error files are the worker's: whatever they hold (any
depth, size, encoding, type, a FIFO in their place) is that rank's problem, said once in its
log; the agent, its node and the other ranks go on."""

from __future__ import annotations

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, write_spec

SAID = {  # by rank: what its log says of its file
    0: ["heartbeat file is nested too deep"],
    1: ["heartbeat file is not UTF-8"],
    2: ["heartbeat has 300 metrics: only the first 256 are kept"],
    3: ["heartbeat metrics are a list, not an object"],
    4: ["heartbeat step 'x' is not an integer below 2**62",
        f"heartbeat metric 'big' = 1{'0' * 36}... is not a finite number: not kept"],
    6: ["heartbeat file is over 16384 bytes: ignored"],
    7: ["heartbeat metric 'loss' = nan is not a finite number: not kept"],  # said once
}


def test_any_heartbeat_or_error_file_content_is_only_that_ranks_problem(home, tmp_path):
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "bad-files", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 4, "command": [PYTHON, str(WORKERS / "bad_files.py")],
        "workdir": str(tmp_path), "health": {"heartbeat_interval": 0.3}}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["restarts"] == 0 and all(n["state"] == "DONE" for n in result["nodes"])
    for r in result["ranks"]:  # every agent went on reading every rank
        assert r["step"] == 7 and r["metrics"] == {"loss": 0.25}, r
    for rank, said in SAID.items():
        lines = list(orchestrator.logs(job_id, rank=rank))
        notes = [ln for ln in lines if "[orchestrator]" in ln]
        assert notes == [f"[local:{rank}] [orchestrator] {s}" for s in said], lines
        assert lines[-1] == f"[local:{rank}] done {rank}"
    assert_no_job_processes(job_id)


def test_a_heartbeat_file_dated_in_the_year_33658_breaks_no_reader(home, tmp_path):
    """Its mtime is the worker's to set; the agent dates a heartbeat by the file's change time
    (the kernel's) and keeps seeing new ones; status works while the job runs and after."""
    import time

    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "future-beat", "nodes": [{"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, str(WORKERS / "future_heartbeat.py"), "3"],
        "workdir": str(tmp_path), "health": {"heartbeat_interval": 0.3}}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        data = orchestrator.status(job_id)
        if data["ranks"] and data["ranks"][0]["step"] == 1:
            break
        time.sleep(0.2)
    assert data["ranks"][0]["step"] == 1, data["ranks"]
    beat = data["ranks"][0]["last_heartbeat"]
    assert beat.startswith(time.strftime("%Y-", time.gmtime())), beat
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["ranks"][0]["step"] == 5, result["ranks"]  # the second one was seen too
    assert orchestrator.cancel(job_id)["state"] == "SUCCEEDED"
    assert_no_job_processes(job_id)
