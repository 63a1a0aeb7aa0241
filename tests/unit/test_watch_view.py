"""The live view flags stragglers with their waiting share (rendered with rich, captured)."""

from rich.console import Console

from orchestrator.cli import render_watch


def test_the_watch_view_names_stragglers_and_shows_waiting_shares():
    rank = {"host": "n1", "state": "RUNNING", "step": 40, "steps_per_s": 2.5,
            "last_output": None, "straggler": False}
    data = {"job_id": "j-1", "state": "RUNNING", "attempt": 1, "restarts": 0,
            "max_restarts": 3, "failure": None, "stragglers": [2],
            "nodes": [{"node_rank": 0, "host": "n1", "state": "RUNNING", "last_heard": None}],
            "ranks": [{**rank, "rank": 0, "wait_share": 0.83},
                      {**rank, "rank": 1, "wait_share": 0.81},
                      {**rank, "rank": 2, "wait_share": 0.02, "straggler": True}]}
    console = Console(record=True, width=140, color_system=None)
    console.print(render_watch(data, ["[n1:0] step 40"], now=0.0))
    text = console.export_text()
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.split()[:1] in (["0"], ["2"])}
    assert "83%" in rows["0"] and "STRAGGLER" not in rows["0"], text
    assert "2% STRAGGLER" in rows["2"], text
    assert "stragglers: rank 2 (n1) while the others wait 83% of the time" in text, text


def test_the_watch_view_shows_progress_under_the_head():
    data = {"job_id": "j-1", "state": "RUNNING", "attempt": 2, "restarts": 1,
            "max_restarts": 3, "failure": None, "stragglers": [], "nodes": [], "ranks": [],
            "progress": {"step": 500, "total_steps": 2000, "total_from": "spec",
                         "percent": 25.0, "remaining_steps": 1500, "steps_per_s": 5.0,
                         "lost_share": 0.1, "eta_s": 333.3, "eta_without_faults_s": 300.0,
                         "eta_at": "2026-11-26T11:00:00+00:00"}}
    console = Console(record=True, width=200, color_system=None)
    console.print(render_watch(data, [], now=0.0))
    lines = console.export_text().splitlines()
    assert lines[0].startswith("j-1  RUNNING  attempt 2"), lines
    assert lines[1] == ("progress: step 500 of 2,000 (25.0%), 5 steps/s, ETA 5m 33s (at "
                        "2026-11-26T11:00:00+00:00), counting the 10% of the time lost to "
                        "faults so far"), lines


def _status(checkpoint):
    return {"job_id": "j-1", "state": "SUCCEEDED", "recorded_state": "SUCCEEDED", "attempt": 1,
            "restarts": 0, "max_restarts": 0, "submitted_at": "t", "failure": None,
            "controller": {"alive": None}, "stragglers": [], "attempts": [], "time_lost": {},
            "nodes": [{"node_index": 0, "node_rank": 0, "host": "n1", "state": "DONE",
                       "checkpoint": checkpoint}],
            "ranks": [{"rank": 0, "node_index": 0, "state": "SUCCEEDED", "exit_code": 0,
                       "signal": None, "step": None}]}


def test_status_shows_a_checkpoints_column_only_where_a_node_holds_one(capsys, monkeypatch):
    from orchestrator import render

    monkeypatch.setattr(render, "console", lambda: Console(width=140, color_system=None))
    nothing = {"memory_bytes": 0, "ranks": 0, "newest_in_memory": None,
               "newest_persisted": None}
    render.print_status(_status(nothing))
    assert "CHECKPOINTS" not in capsys.readouterr().out
    render.print_status(_status({**nothing, "memory_bytes": 3 << 20, "newest_in_memory": 7}))
    out = capsys.readouterr().out
    assert "CHECKPOINTS" in out and "3 MiB, step 7" in out, out
    assert "other nodes" not in out
    render.print_status(_status({**nothing, "memory_bytes": 3 << 20, "newest_in_memory": 7,
                                 "newest_elsewhere": 6}))
    assert "3 MiB, step 7; on other nodes: step 6" in capsys.readouterr().out
