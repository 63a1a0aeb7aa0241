"""Failure classes and the restart policy with real local jobs: a bug is not restarted twice,
the infrastructure's failures have their own budget, and the history says why (issue 20)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import orchestrator
from tests.helpers import PYTHON, ROOT, assert_no_job_processes, wait_for_output, write_spec


def spec_for(tmp_path, script: str, **extra):
    (tmp_path / "train.py").write_text(script)
    return write_spec(tmp_path, {
        "name": "classes", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 1, "command": [PYTHON, "train.py"], "workdir": str(tmp_path),
        "stop_grace_period": 2, "restart_backoff": {"initial": 0.2, "max": 0.2}, **extra})


def test_a_missing_import_ends_after_two_attempts_not_six(home, tmp_path):
    # A two-file project whose train.py imports a module beside it that is not there.
    (tmp_path / "helpers.py").write_text("VALUE = 1\n")
    spec = spec_for(tmp_path, "import helpers\nimport os\n\nimport mymodel  # never written\n",
                    max_restarts=5)
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "FAILED"
    assert len(result["attempts"]) == 2 and result["restarts"] == 1
    first, second = (a["failure"] for a in result["attempts"])
    assert first["failure_class"] == "user" and first["signature"] == \
        "ModuleNotFoundError at train.py:4"
    assert first["evidence"] == "ModuleNotFoundError: No module named 'mymodel'"
    assert first["decision"] == "restarted: restart 1 of max_restarts 5"
    assert second["decision"] == \
        "not restarted: the same error twice (ModuleNotFoundError at train.py:4)"
    failure = result["failure"]
    assert failure["restarts_exhausted"] is False
    assert "not restarted: the same error twice (ModuleNotFoundError at train.py:4)" in \
        failure["message"]
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "status", job_id],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "CLASS" in shown.stdout and " user " in shown.stdout, shown.stdout
    assert "the same error twice (ModuleNotFoundError at train.py:4)" in shown.stdout
    assert_no_job_processes(job_id)


WAIT_FOR_A_SIGNAL = """import os, sys, time
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] in ("0", "1"):
    print(f"waiting {os.getpid()}", flush=True)
    time.sleep(120)
print("done", flush=True)
"""


def rank_pid(job_id: str, attempt: int) -> int:
    for line in orchestrator.logs(job_id, attempt=attempt):
        if "waiting " in line:
            return int(line.rsplit(" ", 1)[1])
    raise AssertionError("rank 1 did not say its pid")


def test_preempted_and_killed_ranks_are_classed_and_charged_apart(home, tmp_path):
    spec = spec_for(tmp_path, WAIT_FOR_A_SIGNAL, max_restarts=1,
                    restart_policy={"max_infra_restarts": 1})
    job_id = orchestrator.submit(spec)
    wait_for_output(job_id, "waiting ", 1)
    os.kill(rank_pid(job_id, 1), signal.SIGTERM)  # as a scheduler preempting it would
    wait_for_output(job_id, "waiting ", 2)  # attempt 2's line (logs() reads every attempt)
    os.kill(rank_pid(job_id, 2), signal.SIGKILL)  # as the kernel's OOM killer would
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["attempts"]
    first, second, third = result["attempts"]
    assert first["failure"]["failure_class"] == "preempted"
    assert first["failure"]["evidence"] == "SIGTERM from outside the orchestrator"
    assert second["failure"]["failure_class"] == "infrastructure"
    assert "SIGKILL" in second["failure"]["evidence"]
    assert second["failure"]["decision"] == \
        "restarted: infrastructure failure 1 of max_infra_restarts 1"
    assert third["failure"] is None
    assert result["restarts"] == 1 and result["infra_restarts"] == 1
    assert_no_job_processes(job_id)


def test_fail_on_log_ends_the_job_at_the_first_match(home, tmp_path):
    spec = spec_for(tmp_path, "import sys\nprint('torch.OutOfMemoryError: CUDA out of memory. "
                              "Tried to allocate 2.00 GiB', file=sys.stderr)\nsys.exit(1)\n",
                    max_restarts=3, restart_policy={"fail_on_log": ["CUDA out of memory"]})
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "FAILED" and len(result["attempts"]) == 1
    assert result["failure"]["decision"].startswith(
        "not restarted: fail_on_log matched: torch.OutOfMemoryError: CUDA out of memory")
    assert_no_job_processes(job_id)


def _memory_cgroup(tmp_path) -> str:
    """A child of this process's memory cgroup (v1, else v2) limited to 64 MiB: a worker put
    in it and allocating more is killed by the kernel's OOM killer."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit = f"/sys/fs/cgroup/memory{path}", "memory.limit_in_bytes"
            break
    else:
        path = open("/proc/self/cgroup").read().splitlines()[0].split(":", 2)[2]
        base, limit = f"/sys/fs/cgroup/unified{path}", "memory.max"
        if not os.path.isdir(base):
            base = f"/sys/fs/cgroup{path}"
    group = os.path.join(base, f"orchestrator-oom-{tmp_path.name}"[:60])
    os.mkdir(group)
    with open(os.path.join(group, limit), "w") as f:
        f.write(str(64 * 1024 * 1024))
    return group


def test_an_oom_killed_worker_is_the_infrastructures(home, tmp_path):
    group = _memory_cgroup(tmp_path)
    try:
        (tmp_path / "train.py").write_text(
            "import os, sys\n"
            "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
            f"    open({os.path.join(group, 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "    hog = bytearray(512 * 1024 * 1024)  # past the cgroup's 64 MiB\n"
            "print('done', flush=True)\n")
        job_id = orchestrator.submit(write_spec(tmp_path, {
            "name": "oom", "nodes": [{"host": "local"}, {"host": "local"}],
            "nproc_per_node": 1, "command": [PYTHON, "train.py"], "workdir": str(tmp_path),
            "stop_grace_period": 2, "restart_backoff": {"initial": 0.2},
            "restart_policy": {"max_infra_restarts": 1}}))
        result = orchestrator.wait(job_id, timeout=120)
    finally:
        os.rmdir(group)
    assert result["state"] == "SUCCEEDED", result["attempts"]
    failure = result["attempts"][0]["failure"]
    assert failure["rank"] == 1 and failure["signal"] == "SIGKILL"
    assert failure["failure_class"] == "infrastructure" and "OOM killer" in failure["evidence"]
    assert result["restarts"] == 0 and result["infra_restarts"] == 1
    assert_no_job_processes(job_id)


def test_too_little_free_disk_fails_the_job_before_it_starts(home, tmp_path):
    spec = spec_for(tmp_path, "print('never')\n", max_restarts=3,
                    health={"min_free_bytes": 2 ** 60, "node_check": [PYTHON, "-c", "pass"]})
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_UNHEALTHY"
    assert "GiB free in " in result["failure"]["message"]
    assert "fewer than health.min_free_bytes" in result["failure"]["message"]
    assert not any("never" in ln for ln in orchestrator.logs(job_id))


def test_check_runs_the_nodes_health_checks_too(home, tmp_path):
    failing = [PYTHON, "-c", "import sys; print('GPU 0 fell off the bus', file=sys.stderr); "
                             "sys.exit(4)"]
    spec = spec_for(tmp_path, "print('never')\n", health={"node_check": failing})
    report = orchestrator.check(spec)
    assert report["ok"] is False
    for node in report["nodes"]:
        assert node["health"] == ["health.node_check failed (exit code 4)"]
        assert node["health_tail"] == ["GPU 0 fell off the bus"]
        assert node["error"] == "unhealthy: health.node_check failed (exit code 4)"
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(spec)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode != 0 and "unhealthy: health.node_check failed" in shown.stdout
    healthy = spec_for(tmp_path, "print('never')\n",
                       health={"node_check": [PYTHON, "-c", "pass"], "min_free_bytes": 1})
    assert orchestrator.check(healthy)["ok"] is True


def test_check_runs_the_network_check_among_the_nodes(home, tmp_path):
    spec = spec_for(tmp_path, "print('never')\n", health={"network_check": True})
    report = orchestrator.check(spec)
    assert report["ok"] is True, report
    assert report["network"].startswith("network check: 2 link(s) of 8 MiB, slowest node ")
    # A minimum no link can reach (a petabyte a second): every link is bad.
    spec = spec_for(tmp_path, "print('never')\n",
                    health={"network_check": {"bytes": 2**20, "min_mb_per_s": 1e9}})
    report = orchestrator.check(spec)
    assert report["ok"] is False
    for node in report["nodes"]:
        assert node["error"].startswith(
            "unhealthy: network check: every link of this node is slow or broken (below "
            "health.network_check.min_mb_per_s 1e+09): node 0 (local) -> node 1 (local) "), node
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(spec)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 1 and "network check: 2 link(s) of 1 MiB" in shown.stdout


def test_nodes_policy_shows_and_sets_the_quarantine_thresholds(home):
    def cli(*args):
        return subprocess.run([PYTHON, "-m", "orchestrator", "nodes", "policy", *args],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    assert cli().stdout.strip() == ("quarantine a host after 2 infrastructure failure(s) "
                                    "within 1h, for 10m (doubled each time, at most 1d)")
    changed = cli("--after", "3", "--window", "2h", "--cooldown", "90", "--json")
    assert json.loads(changed.stdout) == {"after": 3, "window": 7200.0, "cooldown": 90.0,
                                          "max_cooldown": 86400.0}
    assert orchestrator.quarantine_policy()["after"] == 3  # the same store, from Python
    refused = cli("--window", "soon")
    assert refused.returncode == 2 and "--window: not a length of time: 'soon'" in \
        refused.stderr
    refused = cli("--after", "-1")
    assert refused.returncode == 1 and "quarantine after: must be a whole number" in \
        refused.stderr
    assert orchestrator.quarantine_policy()["after"] == 3
    assert cli("--after", "0").stdout.strip() == "hosts are never quarantined"
