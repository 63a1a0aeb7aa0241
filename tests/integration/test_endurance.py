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


def rank_pids(job_id: str) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in orchestrator.status(job_id)["ranks"]}


def _no_alarm(result: dict) -> None:
    """No node was ever taken for unreachable or lost, and nothing was restarted."""
    alarms = [(n["node_index"], state, n["entered"][state]) for n in result["nodes"]
              for state in ("UNREACHABLE", "LOST") if n["entered"].get(state)]
    assert not alarms, (alarms, [n["history"] for n in result["nodes"]])
    assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)


# --- the scenarios, run here on local nodes, and over SSH and on Slurm (tests/cluster) ------

def check_an_exception_costs_nothing(job_spec: Path, ranks: int, steps: int) -> None:
    """With ORCHESTRATOR_FAILPOINTS=turn@2x1 in the environment: the controller raises once;
    its supervisor starts another, which resumes the same attempt: the same workers (pids)
    run to the end, no restart of any kind, every line once."""
    job_id = orchestrator.submit(job_spec)
    first = orchestrator.status(job_id)["controller"]["pid"]
    wait_for(lambda: len(rank_pids(job_id)) == ranks and all(rank_pids(job_id).values()), 60,
             what="every worker started")
    workers = rank_pids(job_id)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert result["controller"]["pid"] != first
    assert {r["rank"]: r["pid"] for r in result["ranks"]} == workers, "a worker was replaced"
    log = controller_log(job_id)
    assert "InjectedFault: failpoint turn" in log and "a new one in 1s" in log, log[-3000:]
    for rank in range(ranks):
        assert steps_in_log(job_id, rank) == list(range(steps))
    assert_no_job_processes(job_id)


def check_a_full_disk_pauses(job_spec: Path, home: Path, ranks: int, steps: int, *,
                             refill: bool = False) -> None:
    """$ORCHESTRATOR_HOME (a small tmpfs) filled for 8 s while the ranks print: the
    controller pauses (the agents keep the lines), status says which path is full and since
    when; then every line is in the logs, once, in order; no worker stopped, no restart.
    With ``refill``, the room the pause's record was given (the home's reserve) is taken
    too, so that nothing more fits for 8 s."""
    job_id = orchestrator.submit(job_spec)
    try:
        wait_for_output(job_id, f"step {ranks - 1} 40", 1)
        workers = rank_pids(job_id)
        filler = fill(home)
        paused = wait_for(lambda: orchestrator.status(job_id)["paused"], 15,
                          what="the job shown paused")
        assert str(home) in paused["reason"] and paused["since"], paused
        if refill:
            fill(home)
            assert os.statvfs(home).f_bavail == 0
        time.sleep(8)
        assert rank_pids(job_id) == workers and all(map(job_processes_alive, workers.values()))
        filler.unlink()
        wait_for(lambda: not orchestrator.status(job_id)["paused"], 30, what="the pause over")
        result = orchestrator.wait(job_id, timeout=120)
    finally:
        with contextlib.suppress(Exception):
            if orchestrator.status(job_id)["state"] not in ("SUCCEEDED", "FAILED",
                                                            "CANCELLED"):
                orchestrator.cancel(job_id, wait_seconds=30)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert {r["rank"]: r["pid"] for r in result["ranks"]} == workers
    for rank in range(ranks):
        assert steps_in_log(job_id, rank) == list(range(steps))
    assert "the home can be written again" in controller_log(job_id)
    assert_no_job_processes(job_id)
    assert_controller_gone(job_id)


def check_a_stalled_controller_declares_nobody_lost(job_spec: Path, ranks: int,
                                                    steps: int) -> None:
    """SIGSTOP for 20 s, as a long swap or a paused VM, at the default liveness settings:
    the time it was not looking is nobody's silence (on main both nodes of this job were
    made UNREACHABLE, then LOST)."""
    job_id = orchestrator.submit(job_spec)
    wait_for_output(job_id, f"step {ranks - 1} 20", 1)
    stopped_for(orchestrator.status(job_id)["controller"]["pid"], 20)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert "the controller was stalled for 2" in controller_log(job_id)
    for rank in range(ranks):
        assert steps_in_log(job_id, rank) == list(range(steps))
    assert_no_job_processes(job_id)


def stopped_for(pid: int, seconds: float) -> None:
    """No CPU for ``pid`` for ``seconds`` (SIGSTOP, then SIGCONT whatever happens)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def job_processes_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def running_pid(pid: int | None) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def assert_controller_gone(job_id: str) -> None:
    """The job's controller and its supervisor exit once the job ended (before the test
    takes the home's disk away: then a supervisor once stayed, looking for its job)."""
    shown = orchestrator.status(job_id)["controller"]
    wait_for(lambda: not any(running_pid(shown[k]) for k in ("pid", "supervisor_pid")
                             if shown[k]), 30, what="the controller and supervisor gone")


def test_an_exception_of_the_controller_stops_no_worker_and_costs_nothing(home, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@2x1")
    check_an_exception_costs_nothing(
        spec(tmp_path, env={"STEPS": "100", "STEP_SLEEP": "0.05"}), 2, 100)


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
    agent = orchestrator.status(job_id)["nodes"][0]["agent_pid"]
    started = time.monotonic()
    result = orchestrator.cancel(job_id, wait_seconds=30)
    assert result["state"] == "CANCELLED" and time.monotonic() - started < 15, result
    assert_no_job_processes(job_id, within=10)
    # And its agent, told to shut down: not left waiting controller_grace for a controller
    # (the abandon read a gap in its messages, relaunched it and crashed on RUNNING -> PENDING).
    wait_for(lambda: not os.path.exists(f"/proc/{agent}"), 15, what=f"agent {agent} gone")
    log = (home / "jobs" / job_id / "controller.log").read_text()
    assert "InvalidTransition" not in log and "missing: reattaching" not in log, log[-3000:]


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
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_pauses_the_job_loses_no_line_and_stops_no_worker(tmp_path, monkeypatch):
    """...and the `paused` notification names the path and when (a local webhook)."""
    from tests.integration.test_notify import Receiver

    receiver = Receiver()
    with small_disk(tmp_path / "home", "48m") as home:
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        check_a_full_disk_pauses(spec(tmp_path, logs={"min_free_bytes": 1 << 20},
                                      notify=[{"url": receiver.url, "on": ["paused"]}],
                                      env={"STEPS": "600", "STEP_SLEEP": "0.05"}),
                                 home, 2, 600)
    paused = [b for b in receiver.bodies if b["event"] == "paused"]
    assert len(paused) == 1 and str(home) in paused[0]["reason"], receiver.bodies
    assert "paused: cannot write" in paused[0]["text"] and paused[0]["since"] > 0


def test_a_full_disk_under_the_agents_too_loses_no_line(tmp_path, monkeypatch):
    """The usual login node: the agents' runtime directory (their spools) on the same full
    disk as the home. The agents spool while the controller is paused; their spool moves to
    memory when its disk refuses (on main the sender thread died of ENOSPC: the nodes fell
    silent and were lost)."""
    with small_disk(tmp_path / "home", "48m") as home:
        run = home / "run"
        run.mkdir(mode=0o700)
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        # 200 lines a second a rank: more than a spool file's buffer while the disk is full.
        check_a_full_disk_pauses(spec(tmp_path, logs={"min_free_bytes": 1 << 20},
                                      env={"STEPS": "6000", "STEP_SLEEP": "0.005"}),
                                 home, 2, 6000, refill=True)
        assert (run / "orchestrator").is_dir(), "the agents ran elsewhere"


def test_a_controller_stopped_for_20s_declares_nobody_lost_at_the_defaults(home, tmp_path):
    check_a_stalled_controller_declares_nobody_lost(
        spec(tmp_path, env={"STEPS": "700", "STEP_SLEEP": "0.05"}), 2, 700)


def test_a_node_starved_for_8s_is_not_lost_at_the_defaults(home, tmp_path):
    """Its agent gets no CPU for 8 s (SIGSTOP: a node whose every core is busy, at worst):
    at the default node_timeout it is late, not lost (on main: LOST at 5 s, a restart)."""
    job_id = orchestrator.submit(spec(tmp_path, env={"STEPS": "400", "STEP_SLEEP": "0.05"}))
    wait_for_output(job_id, "step 1 20", 1)
    stopped_for(orchestrator.status(job_id)["nodes"][1]["agent_pid"], 8)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    _no_alarm(result)
    assert result["nodes"][1]["longest_silence_s"] >= 7, result["nodes"][1]
    for rank in (0, 1):
        assert steps_in_log(job_id, rank) == list(range(400))
    assert_no_job_processes(job_id)


def test_a_slow_start_is_no_hang_with_startup_timeout_and_a_start_silent_past_it_is(
        home, tmp_path):
    """Ranks silent for their first 4 s (imports, a model or a checkpoint loaded), then
    printing every 0.2 s: with hang_timeout 2 and startup_timeout 30 the job succeeds (on the
    old code, HUNG at 2 s, a failure charged); a start silent past startup_timeout is HUNG,
    and the message names that field."""
    script = tmp_path / "slow_start.py"
    script.write_text("import os\nimport time\n\ntime.sleep(float(os.environ['SILENT']))\n"
                      "for i in range(15):\n    print('step', i, flush=True)\n"
                      "    time.sleep(0.2)\n")

    def submit(silent: float, startup_timeout: float) -> str:
        return orchestrator.submit(write_spec(tmp_path, {
            "name": "starts", "nodes": [{"host": "local"}], "nproc_per_node": 2,
            "command": [PYTHON, str(script)], "workdir": str(tmp_path),
            "stop_grace_period": 2, "env": {"SILENT": str(silent)},
            "health": {"hang_timeout": 2, "startup_timeout": startup_timeout}},
            name=f"silent-{silent:g}.yaml"))

    slow, silent = submit(4, 30), submit(600, 3)
    result = orchestrator.wait(slow, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert sum(ln.endswith("step 14") for ln in orchestrator.logs(slow)) == 2
    result = orchestrator.wait(silent, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "HUNG", result
    assert ("for 3s since the attempt started (health.startup_timeout)"
            in result["failure"]["message"]), result["failure"]
    assert_no_job_processes(silent)


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


def test_a_cancel_stops_the_workers_of_a_job_paused_on_a_full_disk(tmp_path, monkeypatch):
    """The disk is so full that `cancel` cannot even record its request: it tells the
    controller by signal, the workers stop at once, and once there is room the job is
    recorded CANCELLED (not restarted: the next controller knows of the cancel)."""
    with small_disk(tmp_path / "home", "48m") as home:
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        job_id = orchestrator.submit(spec(tmp_path, logs={"min_free_bytes": 1 << 20},
                                          env={"STEPS": "2000", "STEP_SLEEP": "0.05"}))
        fillers = []
        try:
            wait_for_output(job_id, "step 1 20", 1)
            fillers.append(fill(home))
            wait_for(lambda: orchestrator.status(job_id)["paused"], 15,
                     what="the job shown paused")
            fillers.append(fill(home / "jobs"))  # what the pause's note freed, too
            assert job_processes(job_id)
            shown = orchestrator.cancel(job_id, wait_seconds=1)
            assert shown["state"] != "CANCELLED"  # not recorded yet: nowhere to write it
            assert_no_job_processes(job_id, within=15)
        finally:
            for filler in fillers:
                filler.unlink()
        result = wait_for(lambda: (s := orchestrator.status(job_id))["state"] == "CANCELLED"
                          and s, 60, what="the job recorded CANCELLED")
        assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)
        assert "cancel requested while paused" in controller_log(job_id)
        assert_controller_gone(job_id)
