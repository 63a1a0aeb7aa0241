"""Where agents keep their sockets on a node: $XDG_RUNTIME_DIR where the user has one, else
~/.cache/orchestrator/run; never a name under /tmp that another local user can create first.
An agent whose runtime directory is removed under it (systemd removes /run/user/<uid> when
the user's last session ends) listens again, and a new controller finds it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import orchestrator
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes, wait_for, write_spec


def spec(tmp_path, **env):
    return write_spec(tmp_path, {
        "name": "rundir", "nodes": [{"host": "local"}, {"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, str(WORKERS / "steps.py")], "workdir": str(tmp_path),
        "env": env, "health": {"heartbeat_interval": 0.5}})


def tmp_names_this_run_is_in() -> list[str]:
    """The entries of /tmp that the python running the tests and the code it runs live in:
    a clone under /tmp, the venv inside it."""
    paths = [sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, str(ROOT),
             os.path.dirname(orchestrator.__file__), *sys.path]
    names = set()
    for path in paths:
        for seen in (os.path.abspath(path), os.path.realpath(path)):
            parts = Path(seen).parts
            if parts[:2] == ("/", "tmp") and len(parts) > 2 and os.path.lexists(seen):
                names.add(parts[2])
    return sorted(names)


def keep_from_tmp(name: str, private: Path) -> str:
    """The shell command that shows /tmp/``name`` in ``private`` (a /tmp of a test's own):
    bound from the real one (a link: copied)."""
    real, there = Path("/tmp", name), shlex.quote(str(private / name))
    if real.is_symlink():
        return f"ln -s {shlex.quote(os.readlink(real))} {there}"
    make = "mkdir" if real.is_dir() else "touch"
    return f"{make} {there} && mount --rbind {shlex.quote(str(real))} {there}"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="plants a directory as another user in a private /tmp: needs root")
def test_a_directory_another_user_planted_in_tmp_does_not_stop_anyone():
    """/tmp/orchestrator-<uid>, made first by another user (nobody, mode 0777), in a /tmp of
    this test's own (a mount namespace): the job runs, its agents under the cache. The home
    is deep enough that the socket's path is over the 108 bytes a socket address holds.
    Where the tests run from /tmp (a clone there, its venv), the private /tmp holds those
    directories, bound from the real one, and nothing else of it."""
    outside = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="rundir-"))  # not under /tmp
    try:
        home = outside / ("h" * 90) / "home"
        home.mkdir(parents=True)
        spec_path = spec(outside, STEPS="5", STEP_SLEEP="0.05")
        uid = os.getuid()
        private = outside / "tmp"  # the private /tmp: made here, then moved over /tmp
        private.mkdir()
        kept = tmp_names_this_run_is_in()
        assert f"orchestrator-{uid}" not in kept, kept  # the tests run from the planted name
        q = shlex.quote
        script = " && ".join([
            "mount --make-rprivate /", f"mount -t tmpfs -o mode=1777 tmpfs {q(str(private))}",
            *(keep_from_tmp(name, private) for name in kept),
            f"mount --move {q(str(private))} /tmp",
            f"mkdir -m 777 /tmp/orchestrator-{uid}", f"chown 65534:65534 /tmp/orchestrator-{uid}",
            f"exec {q(PYTHON)} -m orchestrator submit {q(str(spec_path))} --wait"])
        done = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                              text=True, cwd=ROOT, timeout=120,
                              env={**os.environ, "HOME": str(home),
                                   "ORCHESTRATOR_HOME": str(outside / "state"),
                                   "XDG_RUNTIME_DIR": ""})
        assert done.returncode == 0, (done.stdout, done.stderr)
        job_id = re.search(r"submitted (\S+)", done.stderr)[1]
        assert f"{job_id}: SUCCEEDED" in done.stderr, done.stderr
        run = home / ".cache" / "orchestrator" / "run"
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert len(str(run / f"{job_id}.0" / "agent.sock")) > 108
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_agents_live_in_the_users_runtime_dir_and_survive_its_removal(home, tmp_path,
                                                                       monkeypatch):
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the submitter's: the agents' too
    job_id = orchestrator.submit(spec(tmp_path, STEPS="120", STEP_SLEEP="0.05"))
    sockets = [runtime / "orchestrator" / f"{job_id}.{i}" / "agent.sock" for i in (0, 1)]
    wait_for(lambda: all(s.exists() for s in sockets), 30, what="agents listening")
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 30, what="RUNNING")
    agents = [n["agent_pid"] for n in orchestrator.status(job_id)["nodes"]]
    # The user's last session ends: systemd removes the runtime directory, agents go on.
    shutil.rmtree(runtime / "orchestrator")
    # And the controller dies with it (e.g. the submitting session's machine sleeps).
    c = orchestrator.status(job_id)["controller"]
    os.kill(c["supervisor_pid"], signal.SIGKILL)
    os.kill(c["pid"], signal.SIGKILL)
    wait_for(lambda: all(s.exists() for s in sockets), 10, what="agents listening again")
    result = orchestrator.wait(job_id, timeout=90)  # resumes: reattaches to the same agents
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["restarts"] == 0 and result["attempt"] == 1
    assert [n["agent_pid"] for n in result["nodes"]] == agents
    for rank in (0, 1):
        steps = [int(m[1]) for ln in orchestrator.logs(job_id, rank=rank)
                 if (m := re.fullmatch(rf"\[local:{rank}\] step {rank} (\d+)", ln))]
        assert steps == list(range(120)), steps  # not a line lost
    assert_no_job_processes(job_id)
