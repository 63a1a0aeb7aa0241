"""Warm restarts (``restart: {warm: true}``): a restart's workers are standby interpreters
that imported torch before the failure, and a script cannot tell, but by the modules already
imported, that it did not start cold: each worker dumps what it sees of its start
(tests/workers/warm_world.py) in a cold first attempt and a warm second one, and the two
are compared key by key, for ``python script.py`` and ``python -m pkg.mod``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import orchestrator
from orchestrator.store import Store
from tests.helpers import (
    PYTHON,
    WORKERS,
    assert_no_job_processes,
    job_processes,
    standby_processes,
    wait_for,
    write_spec,
)

# What a worker of the next attempt sees differently, cold or warm: its attempt's own values.
PER_ATTEMPT = {"ORCHESTRATOR_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT",
               "ORCHESTRATOR_STACK_DIR", "ORCHESTRATOR_HEARTBEAT_FILE", "TORCHELASTIC_ERROR_FILE",
               "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}


def project(tmp_path: Path, style: str) -> tuple[Path, list[str]]:
    """A two-file project, and the command that runs it."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(WORKERS / "warm_helper.py", root)
    if style == "script":
        shutil.copy(WORKERS / "warm_world.py", root)
        return root, [PYTHON, "warm_world.py"]
    (root / "warmpkg").mkdir()
    (root / "warmpkg" / "__init__.py").write_text("")
    shutil.copy(WORKERS / "warm_world.py", root / "warmpkg" / "world.py")
    return root, [PYTHON, "-m", "warmpkg.world"]


def run_warm_job(tmp_path, command, root, out, **extra):
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "warm", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [*command, str(out)], "workdir": str(root), "max_restarts": 1,
        "restart": {"warm": True}, "restart_backoff": {"initial": 0.1},
        "stop_grace_period": 2, **extra}))
    wait_for(lambda: len(list(out.glob("attempt-1/world-*.json"))) == 2, 60,
             what="attempt 1's worlds")
    ready = wait_for(lambda: len(standby_processes(job_id)) == 2 and standby_processes(job_id), 60,
                     what="two standbys")
    (out / "fail").touch()
    return job_id, ready


def load(out: Path, attempt: int) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text())
            for p in (out / f"attempt-{attempt}").glob("world-*.json")}


@pytest.mark.parametrize("style", ["script", "module"])
def test_a_warm_worker_sees_the_start_a_cold_one_saw(home, tmp_path, style):
    root, command = project(tmp_path, style)
    out = tmp_path / "out"
    out.mkdir()
    job_id, ready = run_warm_job(tmp_path, command, root, out)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert [a["warm_starts"] for a in result["attempts"]] == [0, 2]
    cold, warm = load(out, 1), load(out, 2)
    assert sorted(cold) == sorted(warm) == [0, 1]
    assert sorted(w["pid"] for w in warm.values()) == sorted(ready)  # the standbys themselves
    for rank in (0, 1):
        c, w = cold[rank], warm[rank]
        # torch's compiler too, which the first optimizer imports (agents/standby.py).
        assert c["preloaded"] == [] and {"torch", "torch._dynamo"} <= set(w["preloaded"])
        changed = {k for k in c["env"].keys() | w["env"].keys()
                   if c["env"].get(k) != w["env"].get(k)}
        assert changed <= PER_ATTEMPT, sorted(changed - PER_ATTEMPT)
        for key in c:
            if key not in ("preloaded", "env", "pid"):
                assert w[key] == c[key], (key, c[key], w[key])
        assert c["name"] == "__main__" and c["main_is_globals"] and c["pickled"] == 7
        assert c["sys_path"][0] == str(root if style == "module" else root)
    assert_no_job_processes(job_id)


def test_a_warm_worker_fails_as_a_cold_one_does(home, tmp_path):
    root, command = project(tmp_path, "script")
    out = tmp_path / "out"
    out.mkdir()
    job_id, _ = run_warm_job(tmp_path, command, root, out, env={"WARM_RAISE": "1"})
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "FAILED" and result["attempts"][1]["warm_starts"] == 2
    assert result["attempt"] == 2 and 1 in {r["exit_code"] for r in result["ranks"]}

    def traceback(attempt):
        # From its first line to the exception's: stdout and stderr are two pipes, so a line
        # the script printed before raising may be read after the traceback.
        lines = [ln.split("] ", 1)[1] for ln in orchestrator.logs(job_id, rank=0, attempt=attempt)]
        start = lines.index("Traceback (most recent call last):")
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("ValueError: "))
        return lines[start:end + 1]

    assert traceback(2) == traceback(1)  # no frame of ours, the same lines
    assert traceback(1)[-1] == "ValueError: failed on purpose in on purpose"
    assert_no_job_processes(job_id)


def test_an_environment_read_at_import_that_changed_starts_cold_and_says_why(home, tmp_path):
    root, command = project(tmp_path, "script")
    out = tmp_path / "out"
    out.mkdir()
    job_id, _ = run_warm_job(tmp_path, command, root, out, env={"STAMP": "a-${attempt}"})
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED" and result["attempts"][1]["warm_starts"] == 0
    assert load(out, 2)[0]["preloaded"] == []
    said = [ln for ln in orchestrator.logs(job_id, rank=0, attempt=2) if "[orchestrator]" in ln]
    assert said == ["[local:0] [orchestrator] started cold: the environment changed since the "
                    "standby started (STAMP)"]
    assert_no_job_processes(job_id)


def test_no_standby_or_warm_worker_outlives_its_agent(home, tmp_path):
    root, command = project(tmp_path, "script")
    out = tmp_path / "out"
    out.mkdir()
    # Attempt 2's warm workers keep running (they exited at once, and under load were gone
    # before the test read their parent: FileNotFoundError, one full run).
    job_id, _ = run_warm_job(tmp_path, command, root, out, env={"WARM_HOLD": "1"})
    wait_for(lambda: len(list(out.glob("attempt-2/world-*.json"))) == 2, 60, what="attempt 2")
    # attempt 2's workers were standbys; attempt 3's standbys start as those run
    shown = orchestrator.status(job_id)
    assert shown["attempt"] == 2
    worker = shown["ranks"][0]
    with open(f"/proc/{worker['pid']}/stat", "rb") as f:
        agent = int(f.read().rsplit(b")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and job_processes(job_id):
        time.sleep(0.1)
    left = job_processes(job_id)
    orchestrator.cancel(job_id)
    assert left == []


def test_time_lost_per_incident_is_measured_against_the_workers_own_steps(home, tmp_path):
    """A real gloo training with a checkpoint every 10 steps loses a rank: the incident's steps
    redone and time to training again agree with the STEP lines the workers printed."""
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "lost", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "goodput_train.py"), str(tmp_path / "ckpt")],
        "workdir": str(tmp_path), "max_restarts": 1, "restart_backoff": {"initial": 0.1},
        "env": {"STEPS": "80", "STEP_TIME": "0.1", "CKPT_EVERY": "10"},
        "health": {"heartbeat_interval": 0.1}, "stop_grace_period": 2}))

    def at_step_25():
        ranks = orchestrator.status(job_id)["ranks"]
        return len(ranks) == 4 and min(r["step"] or 0 for r in ranks) >= 25 and ranks

    victim = wait_for(at_step_25, 90, what="step 25")[3]
    os.kill(victim["pid"], signal.SIGKILL)  # a worker of this test's job
    killed = time.time()
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    (incident,) = result["time_lost"]["incidents"]
    printed = [ln.split("] ", 1)[1].split() for ln in orchestrator.logs(job_id)
               if "] STEP " in ln]
    last = max(int(p[3]) for p in printed if p[1] == "0")
    resumed = min(int(p[3]) for p in printed if p[1] == "1")
    again = max(min(float(p[4]) for p in printed if p[1] == "1" and p[2] == str(r))
                for r in range(4))
    # Steps are seen through heartbeat files read every 0.1 s: a step (0.1 s) either way.
    assert abs(incident["steps_redone"] - (last + 1 - resumed)) <= 2, (incident, last, resumed)
    assert incident["recovered_s"] == pytest.approx(again - killed, abs=0.5)
    assert 0 <= incident["detected_s"] < 2 and incident["restarted_s"] <= incident["recovered_s"]
    assert incident["gpu_s"] == pytest.approx(4 * incident["lost_s"], rel=1e-3)
    assert 0 < result["time_lost"]["goodput"] < 1
    assert_no_job_processes(job_id)


def test_a_hot_spare_takes_a_lost_nodes_place_warm(home, tmp_path):
    """Three nodes, nnodes 2: the third is a spare, connected and with standbys of its own.
    Node 1's agent is SIGKILLed (its workers and standbys die with it): the next attempt runs
    on nodes 0 and 2, every worker from a standby, and node 1, back, is the spare."""
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "spare", "nodes": [{"host": "local"}] * 3, "nnodes": 2, "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "goodput_train.py"), str(tmp_path / "ckpt")],
        "workdir": str(tmp_path), "max_restarts": 1, "restart": {"warm": True},
        "restart_backoff": {"initial": 0.1}, "stop_grace_period": 2,
        "env": {"STEPS": "400", "STEP_TIME": "0.05", "CKPT_EVERY": "10"}}))
    wait_for(lambda: len(standby_processes(job_id)) == 6, 90, what="6 standbys (2 on the spare)")
    shown = orchestrator.status(job_id)
    assert [n["spare"] for n in shown["nodes"]] == [False, False, True]
    victim = next(r for r in shown["ranks"] if r["node_index"] == 1)
    with open(f"/proc/{victim['pid']}/stat", "rb") as f:
        agent = int(f.read().rsplit(b")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)  # the agent of this test's node 1
    wait_for(lambda: orchestrator.status(job_id)["attempt"] == 2, 60, what="attempt 2")
    wait_for(lambda: orchestrator.status(job_id)["nodes"][1]["spare"], 60,
             what="node 1 back as the spare")
    # While attempt 2 runs, not only once it ended (what `status` showed was 0).
    wait_for(lambda: orchestrator.status(job_id)["attempts"][1]["warm_starts"] == 4, 10,
             what="4 warm starts shown while attempt 2 runs")
    assert orchestrator.status(job_id)["attempts"][1]["outcome"] == "RUNNING"
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["attempts"][0]["failure"]["cause"] == "NODE_FAIL"
    assert result["attempts"][1]["warm_starts"] == 4
    assert {r["node_index"] for r in result["ranks"]} == {0, 2}
    assert_no_job_processes(job_id)


def test_a_controller_replaced_mid_recovery_counts_one_restart_loses_no_line_and_stays_warm(
        home, tmp_path):
    """The fault suite's hardest case: a rank SIGKILLed on node 1 of 2 (+ a spare), and the
    controller SIGKILLed while the job waits to restart. Its supervisor starts a new one,
    which finishes the recovery: attempt 2 on nodes 0 and 2, every worker warm, one restart
    charged once, every line of both attempts in the logs, nothing left running."""
    steps = 120
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "midway", "nodes": [{"host": "local"}] * 3, "nnodes": 2, "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "steps.py")], "workdir": str(tmp_path),
        "max_restarts": 1, "restart": {"warm": True}, "stop_grace_period": 2,
        "restart_backoff": {"initial": 3, "max": 3},
        "env": {"STEPS": str(steps), "STEP_SLEEP": "0.05"}}))
    wait_for(lambda: len(standby_processes(job_id)) == 6, 90, what="6 standbys (2 on the spare)")
    shown = orchestrator.status(job_id)
    victim = next(r for r in shown["ranks"] if r["node_index"] == 1)
    first = shown["controller"]
    os.kill(victim["pid"], signal.SIGKILL)  # a worker of this test's job
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RESTARTING", 30,
             what="RESTARTING")
    os.kill(first["pid"], signal.SIGKILL)  # the controller, in the middle of the recovery
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["controller"]["pid"] != first["pid"]
    assert len(result["attempts"]) == 2, result["attempts"]
    assert result["restarts"] + result["infra_restarts"] == 1, result
    assert result["free_restarts"] == 0
    assert result["attempts"][1]["warm_starts"] == 4
    assert {r["node_index"] for r in result["ranks"]} == {0, 2}
    store = Store()
    for rank in range(4):
        second = (store.log_dir(job_id, 2) / f"rank-{rank}.log").read_text().splitlines()
        assert [ln for ln in second if ln.startswith("step ")] == \
            [f"step {rank} {i}" for i in range(steps)]
        # Attempt 1 ended at the kill: each rank's lines, whole and in order, up to it.
        first_lines = [ln for ln in (store.log_dir(job_id, 1) / f"rank-{rank}.log")
                       .read_text().splitlines() if ln.startswith("step ")]
        assert first_lines == [f"step {rank} {i}" for i in range(len(first_lines))]
        assert first_lines, rank
    assert_no_job_processes(job_id)
    assert standby_processes(job_id) == []
