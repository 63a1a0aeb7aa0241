"""Trust boundaries on the local transport: secrets at rest, readers that never write (also
from another PID namespace), untrusted text from workers, and the controller's import path."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess

import pytest

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    CommandLineScan,
    assert_no_job_processes,
    wait_for,
    write_spec,
)


def spec(tmp_path, command, **extra):
    return write_spec(tmp_path, {
        "name": "trust", "nodes": [{"host": "local"}], "nproc_per_node": 1,
        "command": command, "workdir": str(tmp_path), "stop_grace_period": 2, **extra})


def run_cli(*args, cwd=ROOT, timeout=60):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_state_and_logs_are_private_even_under_a_loose_existing_home(home, tmp_path):
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    secret = "hunter2-abcdef"
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "env_dump.py")],
                                      env={"API_TOKEN": secret, "PLAIN": "shown"}))
    assert orchestrator.wait(job_id, timeout=60)["state"] == "SUCCEEDED"
    assert mode(home) == 0o700
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        if (home / name).exists():
            assert mode(home / name) == 0o600, name
    logs = list((home / "jobs" / job_id).rglob("*.log"))
    assert logs and all(mode(p) == 0o600 for p in logs), [(p, oct(mode(p))) for p in logs]
    # The orchestrator's own output never shows the value: dry-run masks it.
    dry = run_cli("submit", str(tmp_path / "job.yaml"), "--dry-run", "--json")
    assert dry.returncode == 0 and secret not in dry.stdout
    env = json.loads(dry.stdout)["nodes"][0]["env"]
    assert env["API_TOKEN"] == "***" and env["PLAIN"] == "shown"


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare")
def test_readers_in_another_pid_namespace_never_touch_the_job(home, tmp_path):
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "steps.py")],
                                      env={"STEPS": "60", "STEP_SLEEP": "0.05"}))
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 30, what="RUNNING")
    for command in (["list", "--json"], ["status", job_id, "--json"]):
        seen = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PYTHON, "-m",
                               "orchestrator", *command], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
        assert seen.returncode == 0, seen.stderr
        data = json.loads(seen.stdout)
        job = data[0] if isinstance(data, list) else data
        assert job["state"] == "RUNNING", job  # not UNKNOWN, and certainly not FAILED
        if "controller" in job:
            assert job["controller"]["alive"] is None  # "not visible from here"
    assert orchestrator.status(job_id)["recorded_state"] == "RUNNING"
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert_no_job_processes(job_id)


def test_worker_text_is_shown_literally(home, tmp_path):
    script = tmp_path / "evil.py"
    script.write_text(
        "import sys\n"
        "print('[/bold] [enforce fail at x.cpp:12] \\x1b[31mred\\x1b]0;title\\x07', "
        "file=sys.stderr)\nsys.exit(3)\n")
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(script)]))
    assert orchestrator.wait(job_id, timeout=60)["state"] == "FAILED"
    shown = run_cli("status", job_id)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "[/bold] [enforce fail at x.cpp:12]" in shown.stdout
    assert "\x1b" not in shown.stdout and "\\x1b[31mred" in shown.stdout


def test_nothing_beside_the_spec_is_imported_by_the_controller(home, tmp_path):
    planted = tmp_path / "planted-ran"
    for name in ("queue.py", "yaml.py", "json.py", "orchestrator.py"):
        (tmp_path / name).write_text(f"open({str(planted)!r}, 'w').write({name!r})\n"
                                     "raise SystemExit(9)\n")
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, "-c", "print('ok')"], workdir="/"))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert not planted.exists(), planted.read_text()


# A queue.py on the user's PYTHONPATH: it notes every process that imports it and every fork
# of one (a fork holds it without importing it again), then stands in for the standard
# library's, so that whoever imports it still works.
PLANTED_QUEUE = """
import os, sys
def _note(how):
    with open(os.path.join({marks!r}, how + "-" + str(os.getpid())), "w") as f:
        f.write(" ".join(sys.argv))
_note("imported")
os.register_at_fork(after_in_child=lambda: _note("forked"))
_here = os.path.dirname(os.path.abspath(__file__))
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
try:
    import queue as _real
finally:
    sys.path[:] = _saved
sys.modules[__name__] = _real
"""

SEES_PYTHONPATH = """
import json, os, queue, sys
json.dump({"pid": os.getpid(), "PYTHONPATH": os.environ.get("PYTHONPATH")}, open(sys.argv[1], "w"))
"""


# The orchestrator command forks its supervisor; the API starts a fresh interpreter.
SUBMITTERS = {
    "command": ["-m", "orchestrator", "submit", "{spec}"],
    "api": ["-c", "import orchestrator, sys; print(orchestrator.submit(sys.argv[1]))", "{spec}"],
}


@pytest.mark.parametrize("submitter", sorted(SUBMITTERS))
def test_the_users_pythonpath_reaches_workers_and_never_the_controller(home, tmp_path,
                                                                        submitter):
    lib, marks, workdir = tmp_path / "userlib", tmp_path / "marks", tmp_path / "project"
    for directory in (lib, marks, workdir):
        directory.mkdir()
    (lib / "queue.py").write_text(PLANTED_QUEUE.format(marks=str(marks)))
    seen = tmp_path / "worker.json"
    job = spec(tmp_path, [PYTHON, "-c", SEES_PYTHONPATH, str(seen)], workdir=str(workdir))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env.update(ORCHESTRATOR_HOME=str(home), PYTHONPATH=str(lib))
    # The submitting process is the user's own: it may import it (as any Python program
    # started from that shell would); the controller, a fork of it or not, must not.
    submit = subprocess.Popen(
        [PYTHON, *(a.format(spec=job) for a in SUBMITTERS[submitter])], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = submit.communicate(timeout=60)
    assert submit.returncode == 0, err
    job_id = out.strip()
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    worker = json.loads(seen.read_text())
    assert worker["PYTHONPATH"].split(os.pathsep)[0] == str(lib)
    noted = {p.name: p.read_text() for p in marks.iterdir()}
    assert f"imported-{worker['pid']}" in noted, noted  # its sys.path is torchrun's
    others = set(noted) - {f"imported-{submit.pid}", f"imported-{worker['pid']}"}
    assert not others, {name: noted[name] for name in others}
    assert_no_job_processes(job_id)


def test_log_cap_keeps_head_and_tail_with_a_marker(home, tmp_path):
    n = 40_000
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "flood.py")],
                                      env={"FLOOD_LINES": str(n)},
                                      logs={"max_bytes_per_rank": 65536}))
    assert orchestrator.wait(job_id, timeout=60)["state"] == "SUCCEEDED"
    log = home / "jobs" / job_id / "logs" / "attempt-1" / "rank-0.log"
    lines = log.read_text().splitlines()
    assert log.stat().st_size < 65536 + 1024
    markers = [ln for ln in lines if ln.startswith("[orchestrator] ")]
    assert len(markers) == 1 and "cut here" in markers[0], markers
    kept = [ln for ln in lines if ln.startswith("flood ")]
    assert kept[0] == "flood 0 0" and kept[-1] == f"flood 0 done {n}"
    assert len(kept) + int(markers[0].split()[1]) == n + 1


def test_keep_attempts_prunes_old_logs_and_a_full_disk_refuses_submit(home, tmp_path):
    job_id = orchestrator.submit(spec(
        tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")], max_restarts=2,
        env={"FAIL_RANK": "0", "FAIL_AFTER": "0"}, logs={"keep_attempts": 1},
        restart_backoff={"initial": 0.1, "max": 0.1}))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["attempt"] == 3
    kept = sorted(p.name for p in (home / "jobs" / job_id / "logs").iterdir())
    assert kept == ["attempt-3"]
    with pytest.raises(orchestrator.LaunchError, match="logs.min_free_bytes"):
        orchestrator.submit(spec(tmp_path, ["true"], logs={"min_free_bytes": 10 ** 18}))


def test_an_endless_line_is_cut_into_bounded_pieces_and_nothing_is_lost(home, tmp_path):
    size = 3_000_000
    script = tmp_path / "endless.py"
    script.write_text(f"import sys\nsys.stderr.write('x' * {size})\nsys.stderr.flush()\n"
                      "sys.exit(4)\n")
    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(script)]))
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["exit_code"] == 4
    pieces = (home / "jobs" / job_id / "logs" / "attempt-1" / "rank-0.log").read_text().split()
    assert max(map(len, pieces)) <= 8192 and sum(map(len, pieces)) == size
    assert all(len(t) <= 8192 for t in result["failure"]["stderr_tail"])


def test_a_recycled_pid_is_never_taken_for_the_jobs_controller(home, tmp_path):
    """Another user's process, or one of ours started later, on the recorded pid, with the
    controller's very command line (the same job id, from another store): not the job's
    controller. On a pid alone, cancel signalled it and waited in vain."""
    from orchestrator import pids
    from orchestrator.store import Store

    job_id = orchestrator.submit(spec(tmp_path, [PYTHON, str(WORKERS / "steps.py")],
                                      env={"STEPS": "2000", "STEP_SLEEP": "0.05"}))
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 30, what="RUNNING")
    before = orchestrator.status(job_id)["controller"]
    store = Store(home)
    recorded = store.get_job(job_id).controller_ident
    assert before["alive"] and recorded == pids.identity(before["pid"])
    os.kill(before["supervisor_pid"], signal.SIGKILL)  # first, or it would start a new one
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: orchestrator.status(job_id)["controller"]["alive"] is False, 10,
             what="controller dead")
    look_alike = ["sh", "-c", "sleep 120; :", "orchestrator.controller", job_id, "--supervise"]
    impostors = [
        # another user's (nobody's), on a record from before identities were kept
        (subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534",
                           "--clear-groups", *look_alike]), None),
        # ours, started after the recorded controller
        (subprocess.Popen(look_alike), recorded),
    ]
    try:
        for proc, ident in impostors:
            wait_for(lambda p=proc: pids.argv(p.pid)[:1] == [b"sh"], 10,
                     what="impostor started")  # setpriv has exec'd
            store.update_job(job_id, controller_pid=proc.pid, supervisor_pid=proc.pid,
                             controller_ident=ident, supervisor_ident=ident)
            shown = orchestrator.status(job_id)
            assert shown["controller"]["alive"] is False and shown["state"] == "UNKNOWN"
        # cancel knows there is no controller: it starts one, which stops the workers
        assert orchestrator.cancel(job_id, wait_seconds=30)["state"] == "CANCELLED"
        assert all(proc.poll() is None for proc, _ in impostors)  # never signalled
    finally:
        for proc, _ in impostors:
            proc.kill()
            proc.wait()
        store.close()
    assert_no_job_processes(job_id)


def submit_with_secrets(tmp_path, spec_path, values, run_cli_env=None):
    """``submit --wait`` with API_TOKEN from the environment and HF_TOKEN from a 0600 env
    file, while every command line on the machine is scanned for any secret's value."""
    env_file = tmp_path / "job.env"
    env_file.write_text(f'# credentials\nexport HF_TOKEN="{values["HF_TOKEN"]}"\n')
    env_file.chmod(0o600)
    with CommandLineScan(*values.values()) as scan:
        done = subprocess.run(
            [PYTHON, "-m", "orchestrator", "submit", str(spec_path), "--wait", "--env",
             "API_TOKEN", "--env-file", str(env_file)], capture_output=True, text=True,
            cwd=ROOT, timeout=180, env={**os.environ, "API_TOKEN": values["API_TOKEN"]})
    assert done.returncode == 0, done.stderr
    assert scan.scans > 20 and not scan.hits, scan.hits
    return re.search(r"submitted (\S+)", done.stderr)[1]


SECRET_NAMES = ("API_TOKEN", "HF_TOKEN", "DB_PASSWORD", "SETUP_KEY")


def secret_spec(tmp_path, values, **extra):
    return spec(tmp_path, [PYTHON, str(WORKERS / "secrets_seen.py")],
                env={"DB_PASSWORD": values["DB_PASSWORD"],
                     "SECRETS_TO_CHECK": "API_TOKEN,HF_TOKEN,DB_PASSWORD", "SLEEP": "2"},
                setup=[f"SETUP_KEY={values['SETUP_KEY']}",
                       'echo "setup has a key of ${#SETUP_KEY} characters"'], **extra)


def assert_secrets_arrived(job_id, values, ranks):
    import hashlib

    lines = list(orchestrator.logs(job_id))
    for name in ("API_TOKEN", "HF_TOKEN", "DB_PASSWORD"):
        digest = hashlib.sha256(values[name].encode()).hexdigest()[:16]
        assert sum(ln.endswith(f"secret {name} {digest}") for ln in lines) == ranks, lines
    said = f"setup has a key of {len(values['SETUP_KEY'])} characters"
    assert any(ln.endswith(said) for ln in lines), lines[:5]


def test_no_secret_reaches_a_command_line_and_one_written_there_is_refused(home, tmp_path):
    values = {n: f"{n.lower()}-{secrets.token_hex(8)}" for n in SECRET_NAMES}
    path = secret_spec(tmp_path, values)
    for args, name in ((["--env", f"API_TOKEN={values['API_TOKEN']}"], "API_TOKEN"),
                       (["--set", "env.DB_PASSWORD=hunter2"], "DB_PASSWORD")):
        refused = run_cli("submit", str(path), *args)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip() == (
            f"error: --env: {name}'s value is on the command line, where every local user can "
            f"read it (ps): pass --env {name} to take it from your environment, or --env-file "
            "FILE")
    # A webhook URL holds a token as often as not: never from the command line either.
    refused = run_cli("submit", str(path), "--set", "notify[0].url=https://hooks.example/T0KEN")
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: --set: notify[0].url: a webhook URL is a secret"), refused.stderr
    assert orchestrator.list_jobs() == []  # nothing was submitted
    job_id = submit_with_secrets(tmp_path, path, values)
    assert_secrets_arrived(job_id, values, ranks=1)
    assert_no_job_processes(job_id)
