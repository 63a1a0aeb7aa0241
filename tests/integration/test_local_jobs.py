"""Real jobs on the local transport: real agents, real worker processes, real torch gloo."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)


def local_spec(tmp_path, command, *, nodes=2, nproc=2, **extra):
    data = {
        "name": "itest",
        "nodes": [{"host": "local"} for _ in range(nodes)],
        "nproc_per_node": nproc,
        "command": command,
        "workdir": str(tmp_path),
        "stop_grace_period": 2,
        **extra,
    }
    return write_spec(tmp_path, data)


def run_cli(*args, timeout=120):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_torch_ddp_job_succeeds_with_loss_in_logs(home, tmp_path):
    spec = local_spec(tmp_path, [PYTHON, str(ROOT / "examples" / "ddp_train.py"),
                                 "--epochs", "2", "--samples", "256"])
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result, lines[-20:])
    assert result["failure"] is None
    assert any(re.search(r"^\[local:0\] epoch 1 loss \d", ln) for ln in lines), lines
    digests = {m.group(1): m.group(2) for ln in lines
               if (m := re.search(r"^\[local:(\d)\] rank \d final weights (\w+)", ln))}
    assert sorted(digests) == ["0", "1", "2", "3"]
    assert len(set(digests.values())) == 1, digests  # DDP kept every replica identical
    assert [r["exit_code"] for r in result["ranks"]] == [0, 0, 0, 0]
    assert_no_job_processes(job_id)


def test_worker_environment_follows_torchrun(home, tmp_path):
    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")], nodes=2, nproc=2,
                      env={"USER_VAR": "x y"}, max_restarts=2)
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED"
    envs = {}
    for line in orchestrator.logs(job_id):
        label, text = line.split("] ", 1)
        if text.startswith("ENV "):
            envs[int(label.rsplit(":", 1)[1])] = json.loads(text[4:])
    assert sorted(envs) == [0, 1, 2, 3]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and 1 <= int(ports.pop()) <= 65535
    for rank, e in envs.items():
        assert e["RANK"] == str(rank) and e["ROLE_RANK"] == str(rank)
        assert e["LOCAL_RANK"] == str(rank % 2)
        assert e["GROUP_RANK"] == str(rank // 2)
        assert e["WORLD_SIZE"] == "4" and e["ROLE_WORLD_SIZE"] == "4"
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["ROLE_NAME"] == "default"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert e["TORCHELASTIC_RUN_ID"] == job_id
        assert e["TORCHELASTIC_ERROR_FILE"]
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["ORCHESTRATOR_JOB_ID"] == job_id and e["ORCHESTRATOR_ATTEMPT"] == "1"
        assert e["GLOO_SOCKET_IFNAME"] == "lo"
        assert e["USER_VAR"] == "x y"


def test_failing_rank_fails_job_and_stops_the_others(home, tmp_path):
    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")],
                      env={"FAIL_RANK": "1", "FAIL_CODE": "7"})
    started = time.monotonic()
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED"
    failure = result["failure"]
    assert failure["cause"] == "WORKER_FAILED"
    assert failure["rank"] == 1 and failure["exit_code"] == 7 and failure["signal"] is None
    assert failure["node_rank"] == 0 and failure["host"] == "local"
    assert "rank 1 is about to fail" in failure["stderr_tail"]
    assert "rank 1" in failure["message"] and "code 7" in failure["message"]
    # The survivors (sleeping 600 s) were stopped, not waited for.
    assert time.monotonic() - started < 30
    states = {r["rank"]: r["state"] for r in result["ranks"]}
    assert states[1] == "FAILED" and {states[0], states[2], states[3]} == {"STOPPED"}
    assert_no_job_processes(job_id)


def test_cancel_mid_run_leaves_nothing(home, tmp_path):
    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")],
                      env={"SPAWN_GRANDCHILD": "1"})
    job_id = orchestrator.submit(spec)
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 30, what="RUNNING")
    wait_for(lambda: len(list(orchestrator.logs(job_id))) >= 4, 10, what="output")
    result = orchestrator.cancel(job_id)
    assert result["state"] == "CANCELLED"
    assert_no_job_processes(job_id)
    again = orchestrator.cancel(job_id)  # harmless
    assert again["state"] == "CANCELLED"


def test_restart_resumes_from_checkpoint(home, tmp_path):
    marker = tmp_path / "crashed-once"
    spec = local_spec(
        tmp_path,
        [PYTHON, str(ROOT / "examples" / "ddp_train.py"), "--epochs", "3", "--samples", "256",
         "--crash-rank", "2", "--crash-epoch", "1", "--crash-marker", str(marker)],
        max_restarts=2, restart_backoff={"initial": 0.1, "max": 0.5},
    )
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=240)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-20:])
    assert result["attempt"] == 2 and result["restarts"] == 1
    first = result["attempts"][0]
    assert first["outcome"] == "FAILED" and first["failure"]["rank"] == 2
    assert first["failure"]["exit_code"] == 13
    assert result["attempts"][1]["outcome"] == "SUCCEEDED"
    second = list(orchestrator.logs(job_id, attempt=2, rank=0))
    assert any("resumed from" in ln and "at epoch 1" in ln for ln in second), second
    assert_no_job_processes(job_id)


def test_cli_submit_wait_exit_codes_status_and_logs(home, tmp_path):
    ok = local_spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")], nodes=1, nproc=2)
    done = run_cli("submit", str(ok), "--wait")
    assert done.returncode == 0, done.stderr
    job_id = done.stderr.split()[1]

    status = run_cli("status", job_id, "--json")
    data = json.loads(status.stdout)
    assert data["state"] == "SUCCEEDED" and data["job_id"] == job_id
    assert [n["node_rank"] for n in data["nodes"]] == [0]
    for key in ("name", "attempt", "restarts", "max_restarts", "failure", "attempts"):
        assert key in data

    rank1 = run_cli("logs", job_id, "--rank", "1")
    assert rank1.returncode == 0
    assert rank1.stdout.strip() and all(ln.startswith("[local:1] ")
                                        for ln in rank1.stdout.splitlines())

    listed = json.loads(run_cli("list", "--json").stdout)
    assert [j["job_id"] for j in listed] == [job_id]
    assert {"job_id", "name", "state", "submitted_at"} <= set(listed[0])

    bad = local_spec(tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")], nodes=1,
                     env={"FAIL_RANK": "0", "FAIL_CODE": "3", "FAIL_AFTER": "0"})
    failed = run_cli("submit", str(bad), "--wait")
    assert failed.returncode == 1
    assert "rank 0" in failed.stderr and "code 3" in failed.stderr

    missing = run_cli("status", "no-such-job")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")
    traversal = run_cli("logs", "../../etc")
    assert traversal.returncode == 2 and "Traceback" not in traversal.stderr


@pytest.mark.parametrize("flag", ["--follow"])
def test_cli_follow_streams_and_returns_outcome(home, tmp_path, flag):
    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")], nodes=2, nproc=1)
    run = run_cli("submit", str(spec), flag)
    assert run.returncode == 0, run.stderr
    assert re.search(r"^\[local:0\] ENV ", run.stdout, re.M)
    assert re.search(r"^\[local:1\] ENV ", run.stdout, re.M)


def test_run_takes_a_torchrun_command_line_and_the_script_gets_its_arguments(home, tmp_path):
    # As after torchrun: the script's arguments reach it untouched, even ones that look like
    # our flags or a placeholder; the workers run where `run` was started.
    script = WORKERS / "echo_args.py"
    done = subprocess.run(
        [PYTHON, "-m", "orchestrator", "run", "--nproc-per-node", "2", "--rdzv-id", "7",
         "--save-spec", "job.yaml", str(script), "--some-arg", "x", "--hosts", "${rank}$"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    args = '["--some-arg", "x", "--hosts", "${rank}$"]'
    assert sorted(re.findall(r"^\[local:\d\] rank \d of 2 args .*$", done.stdout, re.M)) == [
        f"[local:0] rank 0 of 2 args {args}", f"[local:1] rank 1 of 2 args {args}"]
    assert done.stderr.splitlines()[0].startswith("note: --rdzv-id ignored")
    job_id = next(ln.split()[1] for ln in done.stderr.splitlines()
                  if ln.startswith("submitted "))
    assert orchestrator.status(job_id)["state"] == "SUCCEEDED"
    saved = orchestrator.load_jobspec(tmp_path / "job.yaml")
    assert saved.workdir == str(tmp_path) and saved.nproc_per_node == 2
    assert_no_job_processes(job_id)


def test_bad_spec_exits_2_and_starts_nothing(home, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nnodes: [{host: local}]\ncommand: [true]\nnproc_per_node: two\n")
    run = run_cli("submit", str(spec), "--wait")
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "nproc_per_node" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (home / "state.db").exists() or not json.loads(run_cli("list", "--json").stdout)


def _pids_running(job_id):
    wait_for(lambda: len(orchestrator.status(job_id)["ranks"]) == 4 and all(
        r["state"] == "RUNNING" for r in orchestrator.status(job_id)["ranks"]), 30,
        what="all ranks RUNNING")
    wait_for_output(job_id, "sleeping", 4)  # signal handlers and grandchildren in place


def test_killed_agent_is_a_node_failure_and_leaves_no_orphans(home, tmp_path):
    import os
    import signal

    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")],
                      env={"SPAWN_GRANDCHILD": "1"})
    job_id = orchestrator.submit(spec)
    _pids_running(job_id)
    agent_pid = orchestrator.status(job_id)["nodes"][1]["agent_pid"]
    os.kill(agent_pid, signal.SIGKILL)
    result = orchestrator.wait(job_id, timeout=30)
    assert result["state"] == "FAILED"
    assert result["failure"]["cause"] == "NODE_FAIL" and result["failure"]["node_index"] == 1
    assert_no_job_processes(job_id)


def test_a_peers_failure_while_a_node_dies_is_that_nodes_failure(home, tmp_path):
    """Node 1's agent is SIGKILLed and, at once, a rank of node 0 dies as a peer of a dead
    node's ranks does (its collective broken): node 0's exit reaches the controller before
    node 1's loss can be known, yet the failure is node 1's."""
    import os
    import signal

    job_id = orchestrator.submit(local_spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")]))
    _pids_running(job_id)
    shown = orchestrator.status(job_id)
    peer = next(r for r in shown["ranks"] if r["node_index"] == 0)
    os.kill(shown["nodes"][1]["agent_pid"], signal.SIGKILL)  # this test's job's agent
    os.kill(peer["pid"], signal.SIGKILL)  # and a worker of this test's job
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED"
    failure = result["failure"]
    assert (failure["cause"], failure["node_index"]) == ("NODE_FAIL", 1), failure
    assert_no_job_processes(job_id)


def test_worker_ignoring_sigterm_is_killed_after_grace(home, tmp_path):
    spec = local_spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], nodes=1, nproc=2,
                      env={"IGNORE_SIGTERM": "1"}, stop_grace_period=1)
    job_id = orchestrator.submit(spec)
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 30, what="RUNNING")
    wait_for_output(job_id, "sleeping", 2)  # SIGTERM is ignored from here on
    started = time.monotonic()
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert time.monotonic() - started < 10
    ranks = orchestrator.status(job_id)["ranks"]
    assert {r["signal"] for r in ranks} == {"SIGKILL"}
    assert_no_job_processes(job_id)


def test_unusable_state_directory_is_one_line_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(blocker / "home"))  # under a regular file
    run = run_cli("list")
    assert run.returncode == 1
    assert run.stderr.startswith("error: cannot use the state directory")
    assert "Traceback" not in run.stderr
