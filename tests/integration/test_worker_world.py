"""A worker's world is torchrun's: the same script dumps its environment, sys.path, cwd,
umask, rlimits and signal dispositions under ``torchrun`` and under a one-node local job
submitted from the same shell, and the two are compared key by key (tests/worker_world.py
holds the documented differences)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess

import orchestrator
from tests.helpers import (
    PYTHON,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)
from tests.worker_world import differences, documented_in_readme, load_worlds

WORLD = str(WORKERS / "world.py")
UMASK = 0o027  # not the usual 022, nor the controller's 077: a leak either way shows


def shell_env(tmp_path, home, **extra):
    """The submitting shell, in tmp_path/project: this process's environment with a
    PYTHONPATH of the user's and a variable of their own."""
    lib = tmp_path / "userlib"
    lib.mkdir(exist_ok=True)
    # Without the variables a leak would add (this machine may set PYTHONUNBUFFERED).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ORCHESTRATOR_", "PYTEST_"))
           and k not in ("PYTHONUNBUFFERED", "PYTHONSAFEPATH", "OMP_NUM_THREADS")}
    env.update(ORCHESTRATOR_HOME=str(home), PYTHONPATH=str(lib), MY_SETTING="on",
               PWD=str(tmp_path / "project"), **extra)
    return env


def torchrun_world(tmp_path, env, workdir, nproc=2, preexec=None):
    out = tmp_path / "torchrun"
    out.mkdir()
    run = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}", WORLD, str(out)],
                         cwd=workdir, env=env, umask=UMASK, capture_output=True, text=True,
                         timeout=120, preexec_fn=preexec)
    assert run.returncode == 0, run.stderr[-2000:]
    return load_worlds(out)


def job_spec(tmp_path, workdir, out, **extra):
    return write_spec(tmp_path, {
        "name": "world", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, WORLD, str(out)], "workdir": str(workdir),
        "stop_grace_period": 2, **extra})


def cli(args, env, cwd, umask=UMASK, preexec=None):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], cwd=cwd, env=env,
                          umask=umask, capture_output=True, text=True, timeout=180,
                          preexec_fn=preexec)


def test_a_local_workers_world_is_torchruns(home, tmp_path):
    workdir = tmp_path / "project"
    workdir.mkdir()
    env = shell_env(tmp_path, home)
    reference = torchrun_world(tmp_path, env, workdir)
    out = tmp_path / "ours"
    out.mkdir()
    run = cli(["submit", str(job_spec(tmp_path, workdir, out)), "--wait"], env, workdir)
    assert run.returncode == 0, run.stderr
    ours = load_worlds(out)
    assert sorted(ours) == sorted(reference) == [0, 1]
    for rank in (0, 1):
        assert differences(reference[rank], ours[rank]) == [], f"rank {rank}"
    # What the contract is about, said plainly: the script's directory first, no safe path,
    # the shell's umask, torchrun's NCCL error handling, no warning printed.
    assert ours[0]["sys_path"][0] == str(WORKERS)
    assert ours[0]["flags"]["safe_path"] is False
    assert ours[0]["umask"] == UMASK
    assert ours[0]["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "PYTHONSAFEPATH" not in ours[0]["env"] and "PYTHONUNBUFFERED" not in ours[0]["env"]
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    assert not [ln for ln in orchestrator.logs(job_id) if "Warning" in ln or "deprecated" in ln]
    assert_no_job_processes(job_id)


def test_signals_a_background_shell_ignores_are_torchruns_in_a_worker(home, tmp_path):
    # A non-interactive shell's `cmd &` ignores INT and QUIT in cmd; torchrun handles TERM,
    # INT, HUP and QUIT, so its workers have them at their defaults; what else the shell
    # ignored (here USR2) stays ignored under both.
    def background():
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)

    workdir = tmp_path / "project"
    workdir.mkdir()
    env = shell_env(tmp_path, home)
    reference = torchrun_world(tmp_path, env, workdir, preexec=background)
    out = tmp_path / "ours"
    out.mkdir()
    run = cli(["submit", str(job_spec(tmp_path, workdir, out)), "--wait"], env, workdir,
              preexec=background)
    assert run.returncode == 0, run.stderr
    ours = load_worlds(out)
    for rank in (0, 1):
        assert differences(reference[rank], ours[rank]) == [], f"rank {rank}"
    ignored = int(ours[0]["signals"]["SigIgn"], 16)
    assert ignored & (1 << (signal.SIGUSR2 - 1))
    assert not ignored & (1 << (signal.SIGQUIT - 1)) and not ignored & (1 << (signal.SIGINT - 1))
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    assert_no_job_processes(job_id)


def test_the_world_is_the_submitters_also_after_resume_from_another_shell(home, tmp_path):
    workdir = tmp_path / "project"
    workdir.mkdir()
    env = shell_env(tmp_path, home, WORLD_HOLD_ONCE=str(tmp_path / "held"))
    reference = torchrun_world(tmp_path, {**env, "WORLD_HOLD_ONCE": ""}, workdir)
    out = tmp_path / "ours"
    out.mkdir()
    spec = job_spec(tmp_path, workdir, out, health={"controller_grace": 2})
    run = cli(["submit", str(spec)], env, workdir)
    assert run.returncode == 0, run.stderr
    job_id = run.stdout.strip()
    wait_for_output(job_id, "holding", 2)
    controller = orchestrator.status(job_id)["controller"]
    os.kill(controller["supervisor_pid"], signal.SIGKILL)
    os.kill(controller["pid"], signal.SIGKILL)
    assert_no_job_processes(job_id, within=15)  # the agents gave up (controller_grace)
    # Another shell: other variables, another umask, another directory.
    other = {k: v for k, v in env.items() if k != "MY_SETTING"}
    other.update(OTHER_SHELL="1", PYTHONPATH="/nowhere")
    resumed = cli(["resume", job_id], other, tmp_path, umask=0o077)
    assert resumed.returncode == 0, resumed.stderr
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED" and result["attempt"] == 2, result["failure"]
    ours = load_worlds(out)
    for rank in (0, 1):
        problems = differences(reference[rank], ours[rank],
                               also_differ=frozenset({"WORLD_HOLD_ONCE"}))
        assert problems == [], f"rank {rank}"
    assert ours[0]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert_no_job_processes(job_id)


def test_a_worker_has_the_shells_open_files_limit_not_the_controllers(home, tmp_path):
    # The controller raises its own soft limit to the hard one (descriptors add up there);
    # torchrun's workers have the shell's, and so must ours.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = 1000 if hard == resource.RLIM_INFINITY or hard > 1000 else hard - 1
    out = tmp_path / "ours"
    out.mkdir()
    spec = write_spec(tmp_path, {
        "name": "limits", "nodes": [{"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, WORLD, str(out)], "workdir": str(tmp_path)})
    run = subprocess.run(
        [PYTHON, "-m", "orchestrator", "submit", str(spec), "--wait"], cwd=tmp_path,
        env=shell_env(tmp_path, home), capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert run.returncode == 0, run.stderr
    assert load_worlds(out)[0]["rlimits"]["RLIMIT_NOFILE"] == [soft, hard]
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    assert_no_job_processes(job_id)


def test_every_documented_difference_is_in_the_readme():
    assert documented_in_readme() == []


def test_the_kept_world_is_private_and_never_shown(home, tmp_path):
    env = shell_env(tmp_path, home, MY_TOKEN="s3cret-value")
    out = tmp_path / "ours"
    out.mkdir()
    run = cli(["submit", str(job_spec(tmp_path, tmp_path, out)), "--wait"], env, tmp_path)
    assert run.returncode == 0, run.stderr
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    assert (home / "state.db").stat().st_mode & 0o777 == 0o600
    shown = cli(["status", job_id, "--json"], env, tmp_path).stdout
    assert "s3cret-value" not in shown and "s3cret-value" not in run.stdout + run.stderr
    wait_for(lambda: not orchestrator.status(job_id)["controller"]["alive"], 10)
    log = (home / "jobs" / job_id / "controller.log").read_text()
    assert "s3cret-value" not in log


def test_the_agent_raises_its_own_open_files_limit_and_its_workers_keep_the_shells(home,
                                                                                   tmp_path):
    # 1,024 local ranks hold more than 1,024 descriptors in their agent; never in a worker.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 1 << 20:
        hard = 1 << 20
    soft = min(1000, hard - 1)
    spec = write_spec(tmp_path, {
        "name": "limits", "nodes": [{"host": "local"}], "nproc_per_node": 1,
        "command": ["/bin/sh", "-c", "grep 'Max open files' /proc/$PPID/limits; ulimit -n"],
        "workdir": str(tmp_path)})
    run = subprocess.run(
        [PYTHON, "-m", "orchestrator", "submit", str(spec), "--wait"], cwd=tmp_path,
        env=shell_env(tmp_path, home), capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert run.returncode == 0, run.stderr
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    lines = list(orchestrator.logs(job_id))
    agent = next(ln for ln in lines if "Max open files" in ln)
    assert agent.split("Max open files")[1].split()[:2] == [str(hard)] * 2, agent  # raised
    assert any(ln.endswith(f" {soft}") for ln in lines), lines  # the worker's: the shell's
    assert_no_job_processes(job_id)
