"""No silent gaps in what `logs` shows: where a rank's log was cut (logs.max_bytes_per_rank)
the marker says how many lines, in `logs --rank`, `--node`, `--tail`, `-f` and the
dashboard's tail, while the job runs and after; every line is either shown or counted."""

from __future__ import annotations

import subprocess
import threading

import orchestrator
from orchestrator import api
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes, write_spec

N = 30_000


def spec(tmp_path, **env):
    return write_spec(tmp_path, {
        "name": "gaps", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "flood.py")], "workdir": str(tmp_path),
        "env": {"FLOOD_LINES": str(N), **env}, "logs": {"max_bytes_per_rank": 65536}})


def accounted(lines, prefix):
    """(numbers of ``flood <rank> <i>`` lines shown, lines the markers say were cut)."""
    numbers, cut = [], 0
    for ln in lines:
        assert ln.startswith(prefix), ln
        text = ln[len(prefix):]
        if text.startswith("[orchestrator] ") and " cut here" in text:
            cut += int(text.split()[1])
        elif text.startswith("flood ") and "done" not in text:
            numbers.append(int(text.split()[2]))
    return numbers, cut


def test_rank_node_tail_and_the_dashboard_show_where_and_how_many_lines_were_cut(
        home, tmp_path):
    # Slow enough that the follower reads part of it while it runs.
    job_id = orchestrator.submit(spec(tmp_path, FLOOD_SLEEP_EVERY="2000", FLOOD_SLEEP="0.05"))
    followed: list[str] = []
    follower = threading.Thread(target=lambda: followed.extend(
        orchestrator.logs(job_id, rank=1, follow=True)))
    follower.start()
    assert orchestrator.wait(job_id, timeout=120)["state"] == "SUCCEEDED"
    follower.join(timeout=30)
    numbers, cut = accounted([ln for ln in followed if "done" not in ln], "[local:1] ")
    assert cut > 0 and numbers == sorted(numbers) and len(numbers) + cut == N, (len(numbers),
                                                                                cut)
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "logs", job_id, "--rank", "0"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = shown.stdout.splitlines()
    numbers, cut = accounted(lines, "[local:0] ")
    markers = [i for i, ln in enumerate(lines) if "cut here" in ln]
    assert len(markers) == 1 and cut > 0 and len(numbers) + cut == N
    before = int(lines[markers[0] - 1].split()[-1])
    after = int(lines[markers[0] + 1].split()[-1])
    assert after == before + cut + 1  # the marker stands exactly in the gap
    last = list(orchestrator.logs(job_id, rank=0, tail=3))
    assert last == [f"[local:0] flood 0 {N - 2}", f"[local:0] flood 0 {N - 1}",
                    f"[local:0] flood 0 done {N}"]
    node = list(orchestrator.logs(job_id, node=1))  # ranks 2 and 3, from the combined log
    assert {ln.split("] ", 1)[0] for ln in node if not ln.startswith("[orchestrator]")} == {
        "[local:2", "[local:3"}
    assert any("cut here" in ln for ln in node)  # the combined log was cut too: said so
    tail = api.log_tail(job_id, rank=2, lines=5)["lines"]
    assert tail[-1] == f"[local:2] flood 2 done {N}" and len(tail) == 5
    assert_no_job_processes(job_id)


def test_a_running_jobs_cut_log_shows_the_marker_in_logs_and_the_dashboard(home, tmp_path):
    # All the lines at once, then it waits: the log is cut and the attempt still open.
    job_id = orchestrator.submit(spec(tmp_path, FLOOD_SLEEP_EVERY=str(N), FLOOD_SLEEP="60"))
    from tests.helpers import wait_for

    wait_for(lambda: any(f"flood 3 {N - 1}" in ln for ln in
                         orchestrator.logs(job_id, rank=3, tail=1)), 60, what="the flood")
    numbers, cut = accounted(list(orchestrator.logs(job_id, rank=3)), "[local:3] ")
    assert cut > 0 and len(numbers) + cut == N
    whole = api.log_tail(job_id, rank=3, lines=100_000)["lines"]
    assert accounted(whole, "[local:3] ") == (numbers, cut)
    orchestrator.cancel(job_id)
    assert_no_job_processes(job_id)
