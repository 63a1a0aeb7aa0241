"""What a week-long job meets on its submit host, on real local jobs: an exception of the
controller, a controller that keeps failing, a full disk under $ORCHESTRATOR_HOME. None of
them stops a worker or charges a restart, and every line is counted in the logs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
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
    wait_for,
    wait_for_output,
    write_spec,
)

STEPS = [PYTHON, str(WORKERS / "steps.py")]


def spec(tmp_path, *, nodes=2, nproc=1, **extra):
    return write_spec(tmp_path, {
        "name": "endure", "nodes": [{"host": "local"}] * nodes, "nproc_per_node": nproc,
        "command": STEPS, "workdir": str(tmp_path), "stop_grace_period": 2, **extra})


def steps_in_log(job_id: str, rank: int, attempt: int = 1) -> list[int]:
    path = Store().log_dir(job_id, attempt) / f"rank-{rank}.log"
    return [int(ln.split()[2]) for ln in path.read_text().splitlines()
            if ln.startswith(f"step {rank} ")]


def controller_log(job_id: str) -> str:
    return (Store().job_dir(job_id) / "controller.log").read_text()


def test_an_exception_of_the_controller_stops_no_worker_and_costs_nothing(home, tmp_path,
                                                                          monkeypatch):
    """Crash-only: the controller raises once (a failpoint in its loop); its supervisor
    starts another, which resumes the same attempt: no restart, every line once."""
    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@2x1")
    job_id = orchestrator.submit(spec(tmp_path, env={"STEPS": "100", "STEP_SLEEP": "0.05"}))
    first = orchestrator.status(job_id)["controller"]["pid"]
    workers = set(wait_for(lambda: job_processes(job_id), 30, what="workers"))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)
    assert result["controller"]["pid"] != first
    log = controller_log(job_id)
    assert "InjectedFault: failpoint turn" in log and "a new one in 1s" in log, log[-3000:]
    assert "stop" not in [e["message"] for n in result["nodes"] for e in n["history"]]
    for rank in (0, 1):
        assert steps_in_log(job_id, rank) == list(range(100))
    assert workers  # the same workers ran to the end: none was stopped or started again
    assert_no_job_processes(job_id)


def test_a_controller_failing_on_the_same_error_ends_the_job_after_the_grace(home, tmp_path,
                                                                            monkeypatch):
    """Every controller raises the same error: after three deaths the supervisor stops
    starting new ones; status says so while the workers go on; after the agents'
    controller_grace the job is FAILED, CONTROLLER_FAILED, naming the error and where its
    traceback is, with no restart charged."""
    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@1x0")
    job_id = orchestrator.submit(spec(tmp_path, max_restarts=3, health={"controller_grace": 6},
                                      env={"STEPS": "2000", "STEP_SLEEP": "0.05"}))
    shown = wait_for(lambda: (s := orchestrator.status(job_id))["controller"]["failing"] and s,
                     40, what="the controller shown failing")
    failing = shown["controller"]["failing"]
    assert failing["deaths"] == 3 and "failpoint turn" in failing["error"], failing
    assert failing["traceback"].endswith("controller.log") and failing["until"], failing
    assert shown["state"] == "RUNNING" and job_processes(job_id), "the workers go on"
    cli = subprocess.run([PYTHON, "-m", "orchestrator", "status", job_id], capture_output=True,
                         text=True, timeout=30)
    assert "the controller keeps failing (3 deaths" in cli.stderr, cli.stderr
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED", result
    failure = result["failure"]
    assert failure["cause"] == "CONTROLLER_FAILED" and "failpoint turn" in failure["message"]
    assert "controller.log" in failure["message"] and failure["failure_class"] == \
        "infrastructure"
    assert result["restarts"] == 0 and result["free_restarts"] == 0
    assert_no_job_processes(job_id, within=15)


def test_cancel_ends_a_failing_job_at_once(home, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@1x0")
    job_id = orchestrator.submit(spec(tmp_path, env={"STEPS": "2000", "STEP_SLEEP": "0.05"}))
    wait_for(lambda: orchestrator.status(job_id)["controller"]["failing"], 40,
             what="the controller shown failing")
    started = time.monotonic()
    result = orchestrator.cancel(job_id, wait_seconds=30)
    assert result["state"] == "CANCELLED" and time.monotonic() - started < 15, result
    assert_no_job_processes(job_id, within=10)


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only), unmounted afterwards."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs: {mounted.stderr}")
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to its last byte; the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_pauses_the_job_loses_no_line_and_stops_no_worker(tmp_path, monkeypatch):
    """$ORCHESTRATOR_HOME on a 48 MiB tmpfs, filled for 8 s while two ranks print 20 lines
    a second: the controller pauses (the agents keep the lines), status says which path is
    full and since when, and once there is room again every line is in the logs, once, in
    order; no worker stopped, no restart of any kind."""
    with small_disk(tmp_path / "home", "48m") as home:
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        job_id = orchestrator.submit(spec(tmp_path, logs={"min_free_bytes": 1 << 20},
                                          env={"STEPS": "600", "STEP_SLEEP": "0.05"}))
        try:
            wait_for_output(job_id, "step 1 40", 1)
            workers = set(job_processes(job_id))
            filler = fill(home)
            paused = wait_for(lambda: orchestrator.status(job_id)["paused"], 15,
                              what="the job shown paused")
            assert str(home) in paused["reason"] and paused["since"], paused
            time.sleep(8)
            assert set(job_processes(job_id)) >= workers, "a worker was stopped"
            filler.unlink()
            wait_for(lambda: not orchestrator.status(job_id)["paused"], 30,
                     what="the pause over")
            result = orchestrator.wait(job_id, timeout=120)
        finally:
            with contextlib.suppress(Exception):
                if orchestrator.status(job_id)["state"] not in ("SUCCEEDED", "FAILED",
                                                                "CANCELLED"):
                    orchestrator.cancel(job_id, wait_seconds=30)
        assert result["state"] == "SUCCEEDED", result["failure"]
        assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)
        for rank in (0, 1):
            assert steps_in_log(job_id, rank) == list(range(600))
        assert "the home can be written again" in controller_log(job_id)
        assert_no_job_processes(job_id)


def _no_alarm(result: dict) -> None:
    """No node was ever taken for unreachable or lost, and nothing was restarted."""
    alarms = [(n["node_index"], e["state"], e["message"]) for n in result["nodes"]
              for e in n["history"] if e["state"] in ("UNREACHABLE", "LOST")]
    assert not alarms, alarms
    assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)


def test_a_controller_stopped_for_20s_declares_nobody_lost_at_the_defaults(home, tmp_path):
    """SIGSTOP, as a long swap or a paused VM: the time it was not looking is nobody's
    silence (on main both nodes of this job were made UNREACHABLE, then LOST)."""
    job_id = orchestrator.submit(spec(tmp_path, env={"STEPS": "700", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 20", 1)
    controller = orchestrator.status(job_id)["controller"]["pid"]
    os.kill(controller, signal.SIGSTOP)
    try:
        time.sleep(20)
    finally:
        os.kill(controller, signal.SIGCONT)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert "the controller was stalled for 2" in controller_log(job_id)
    for rank in (0, 1):
        assert steps_in_log(job_id, rank) == list(range(700))
    assert_no_job_processes(job_id)


def test_a_node_starved_for_8s_is_not_lost_at_the_defaults(home, tmp_path):
    """Its agent gets no CPU for 8 s (SIGSTOP: a node whose every core is busy, at worst):
    at the default node_timeout it is late, not lost (on main: LOST at 5 s, a restart)."""
    job_id = orchestrator.submit(spec(tmp_path, env={"STEPS": "400", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 20", 1)
    agent = orchestrator.status(job_id)["nodes"][1]["agent_pid"]
    os.kill(agent, signal.SIGSTOP)
    try:
        time.sleep(8)
    finally:
        os.kill(agent, signal.SIGCONT)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert result["nodes"][1]["longest_silence_s"] >= 7, result["nodes"][1]
    for rank in (0, 1):
        assert steps_in_log(job_id, rank) == list(range(400))
    assert_no_job_processes(job_id)


def test_an_ended_job_leaves_no_secret_in_the_store_files(home, tmp_path, monkeypatch):
    """Its env values, webhook URL, agent secret and the submitter's environment are wiped
    when it ends: not in state.db, its WAL or free pages (read as raw bytes)."""
    monkeypatch.setenv("SUBMITTER_TOKEN", "sekrit-of-the-shell-4242")
    job_id = orchestrator.submit(spec(tmp_path, env={
        "STEPS": "3", "STEP_SLEEP": "0.01", "WANDB_API_KEY": "sekrit-of-the-spec-4242"},
        notify=[{"url": "https://hooks.invalid/T0/sekrit-of-the-hook-4242",
                 "on": ["cancelled"]}]))
    secret = Store().get_job(job_id).secret
    assert secret and orchestrator.wait(job_id, timeout=60)["state"] == "SUCCEEDED"
    for name in ("state.db", "state.db-wal"):
        path = home / name
        data = path.read_bytes() if path.exists() else b""
        for needle in (b"sekrit-of-the", secret.encode()):
            assert needle not in data, (name, needle)
    assert_no_job_processes(job_id)
