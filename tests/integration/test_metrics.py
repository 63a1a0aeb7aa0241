"""Steps and metrics that workers give heartbeat(), through the agent, in status."""

from __future__ import annotations

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, write_spec


def test_steps_and_metrics_reach_status_with_a_rate(home, tmp_path):
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "metrics", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, str(WORKERS / "stepper.py")], "workdir": str(tmp_path),
        # silent but heartbeating: a hang_timeout must not fire
        "health": {"hang_timeout": 2, "heartbeat_interval": 0.5}, "env": {"STEPS": "30"}}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    for r in result["ranks"]:
        assert r["step"] == 29 and abs(r["metrics"]["loss"] - 1 / 30) < 1e-9, r
        assert r["steps_per_s"] and 2 < r["steps_per_s"] < 40, r  # about 20 steps/s
        assert r["last_heartbeat"]
    assert result["attempts"][0]["steps_per_s"] == min(r["steps_per_s"] for r in result["ranks"])
    assert_no_job_processes(job_id)


def test_the_watch_view_shows_state_nodes_ranks_steps_and_last_lines(home, tmp_path):
    from rich.console import Console

    from orchestrator.cli import render_watch

    script = tmp_path / "talk.py"
    script.write_text("import os, time\nimport orchestrator_worker as ow\n"
                      "for i in range(5):\n    ow.heartbeat(step=i)\n    time.sleep(0.2)\n"
                      "print('rank', os.environ['RANK'], 'done [/bold]', flush=True)\n"
                      "time.sleep(1.2)\n")
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "watch", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, str(script)], "workdir": str(tmp_path),
        "health": {"heartbeat_interval": 0.5}}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    console = Console(record=True, width=140, color_system=None)
    console.print(render_watch(result, list(orchestrator.logs(job_id, tail=8))))
    text = console.export_text()
    assert f"{job_id}  SUCCEEDED  attempt 1  restarts 0/0" in text
    assert text.count(" DONE ") == 2 and "ago" in text  # nodes, last heard
    rows = [ln.split() for ln in text.splitlines() if ln.split()[:1] in (["0"], ["1"])
            and "SUCCEEDED" in ln]
    assert len(rows) == 2 and all(row[3] == "4" for row in rows), rows  # the last step
    assert "[local:0] rank 0 done [/bold]" in text  # shown literally
