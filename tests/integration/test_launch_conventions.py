"""The seeds' launch conventions on local nodes: placeholders, --env/--set, max_duration,
port ranges, and the deprecated NCCL variable warning."""

from __future__ import annotations

import json
import re
import secrets
import socket
import subprocess
import time

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    command_lines,
    write_spec,
)


def spec(tmp_path, command, **extra):
    return write_spec(tmp_path, {
        "name": "conv", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 2,
        "command": command, "workdir": str(tmp_path), "stop_grace_period": 2, **extra})


def run_cli(*args, timeout=120):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_legacy_launch_script_runs_unchanged_with_placeholders(home):
    job_id = orchestrator.submit(ROOT / "jobspecs" / "legacy-launch.yaml")
    result = orchestrator.wait(job_id, timeout=120)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    seen = {int(m[1]): int(m[2]) for ln in lines
            if (m := re.search(r"legacy rank (\d)/4 local_rank (\d) sum 6", ln))}
    assert seen == {0: 0, 1: 1, 2: 0, 3: 1}
    assert 29500 <= result["attempts"][0]["master_port"] <= 29550
    assert_no_job_processes(job_id)


def test_env_and_set_override_the_spec_for_one_job(home, tmp_path):
    path = spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")],
                env={"NCCL_ASYNC_ERROR_HANDLING": "1", "KEEP": "${node_rank}-$$"})
    run = run_cli("submit", str(path), "--env", "EXTRA=x=y", "--set", "nproc_per_node=1",
                  "--set", "max_restarts=2", "--wait")
    assert run.returncode == 0, run.stderr
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in run.stderr  # the warning, with the new name
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    result = orchestrator.status(job_id)
    assert result["max_restarts"] == 2 and len(result["ranks"]) == 2
    envs = [json.loads(ln.split("ENV ", 1)[1]) for ln in orchestrator.logs(job_id)
            if "] ENV " in ln]
    assert {e["EXTRA"] for e in envs} == {"x=y"}
    assert sorted(e["KEEP"] for e in envs) == ["0-$", "1-$"]
    assert {e["NCCL_ASYNC_ERROR_HANDLING"] for e in envs} == {"1"}  # passed through
    bad = run_cli("submit", str(path), "--set", "nodes[0].port=99")
    assert bad.returncode == 2 and bad.stderr.startswith("error: nodes[0].port")


def test_max_duration_stops_everything_and_never_restarts(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")],
                                      max_duration=3, max_restarts=3,
                                      env={"SPAWN_GRANDCHILD": "1"}))
    started = time.monotonic()
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "TIMEOUT"
    assert "max_duration" in result["failure"]["message"]
    assert result["restarts"] == 0 and len(result["attempts"]) == 1
    assert time.monotonic() - started < 20
    assert_no_job_processes(job_id)


def test_a_fully_occupied_port_range_is_a_launch_failure_naming_it(home, tmp_path):
    held = []
    try:
        for port in (29731, 29732):
            s = socket.socket()
            s.bind(("", port))
            s.listen()
            held.append(s)
        job_id = orchestrator.submit(spec(tmp_path, ["true"],
                                          rendezvous={"port": "29731-29732"}, max_restarts=2))
        result = orchestrator.wait(job_id, timeout=60)
    finally:
        for s in held:
            s.close()
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "LAUNCH_FAILED"
    assert "29731-29732" in failure["message"] and failure["host"] == "local"
    assert result["restarts"] == 0


def test_nproc_gpu_is_refused_on_a_node_without_gpus_and_auto_gives_one(home, tmp_path):
    gpu = orchestrator.submit(spec(tmp_path, ["true"], nproc_per_node="gpu", max_restarts=2))
    result = orchestrator.wait(gpu, timeout=60)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "LAUNCH_FAILED"
    assert failure["message"] == "nproc_per_node: gpu, but local has no GPU (use a number, or auto)"
    assert result["attempts"] == [] and result["restarts"] == 0  # no worker ever started
    auto = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")],
                                    nproc_per_node="auto"))
    result = orchestrator.wait(auto, timeout=60)
    assert result["state"] == "SUCCEEDED" and len(result["ranks"]) == 2  # 1 per CPU node
    assert_no_job_processes(auto)


def test_setup_runs_before_workers_is_cached_and_a_failure_costs_no_restart(home, tmp_path):
    runs = tmp_path / "setup-runs"  # (the path differs per test run: setups are cached)
    setup = ["echo setting up in $(pwd)", f"echo run >> {runs}"]
    job = spec(tmp_path, [PYTHON, "-c", "print('worker ran')"], setup=setup, max_restarts=2)
    first = orchestrator.submit(job)
    assert orchestrator.wait(first, timeout=60)["state"] == "SUCCEEDED"
    lines = list(orchestrator.logs(first))
    assert lines[0] == f"[local:setup] setting up in {tmp_path}", lines[:3]
    # Both local "nodes" are this machine: one run, the other found it done.
    assert runs.read_text().count("run") == 1
    second = orchestrator.submit(job)  # the same setup again: nothing runs
    assert orchestrator.wait(second, timeout=60)["state"] == "SUCCEEDED"
    assert runs.read_text().count("run") == 1
    changed = orchestrator.submit(spec(tmp_path, ["true"], setup=[*setup, "true"]))
    assert orchestrator.wait(changed, timeout=60)["state"] == "SUCCEEDED"
    assert runs.read_text().count("run") == 2
    failing = orchestrator.submit(spec(tmp_path, [PYTHON, "-c", "print('never')"],
                                       max_restarts=2,
                                       setup=["echo about to fail >&2", "exit 7"]))
    result = orchestrator.wait(failing, timeout=60)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "SETUP_FAILED"
    assert failure["exit_code"] == 7 and failure["host"] == "local"
    assert "about to fail" in failure["stderr_tail"] and result["restarts"] == 0
    assert result["attempts"] == []  # no worker ever started
    assert_no_job_processes(failing)


def test_a_setup_past_setup_timeout_is_stopped_and_fails_the_job_naming_the_node(home, tmp_path):
    nap = f"600.{secrets.randbelow(10**6):06d}"  # a sleep no other process has
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, "-c", "print('never')"],
                                      max_restarts=2, setup_timeout=2,
                                      setup=["echo installing", f"sleep {nap}"]))
    started = time.monotonic()
    result = orchestrator.wait(job_id, timeout=60)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "SETUP_FAILED", failure
    assert failure["message"] == \
        "setup on local did not finish within 2s (setup_timeout): stopped"
    assert failure["host"] == "local" and failure["stderr_tail"] == ["installing"]
    assert result["restarts"] == 0 and result["attempts"] == []
    assert time.monotonic() - started < 20
    assert not [c for c in command_lines() if f"sleep {nap}".encode() in c]  # stopped
    assert_no_job_processes(job_id)
