"""The node's lock files (agents/paths.py ``Lock``): one name means one lock even when its last
user removes the file, and a Slurm holder leaves nothing in the runtime directory when it
goes (it left an empty ``<job>.holder.<node>.sock.lock`` per job and node, forever), nor does
an agent's watchdog when the agent was killed (it left ``<job>.<node>.lock``); an agent's
directory is removed under its lock, and never while an agent serves there; an outcome no
controller came back to read goes after a month (they stayed forever)."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from agents.paths import OUTCOME_KEPT, Lock, bind_unix, clear_agent_directory, sweep_outcomes
from tests.helpers import ROOT


def test_a_lock_removed_by_its_holder_is_taken_again_at_its_name(tmp_path):
    """The second waits on the file the first removes; it then holds the file now at the
    name, so that a third is kept out (on the removed file it would keep nobody out)."""
    path = str(tmp_path / "x.lock")
    taken, release = threading.Event(), threading.Event()

    def second() -> None:
        with Lock(path):
            taken.set()
            release.wait(10)

    thread = threading.Thread(target=second)
    with Lock(path) as first:
        thread.start()
        assert not taken.wait(0.3)  # the first holds it
        first.remove()
    try:
        assert taken.wait(5)
        third = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(third)
    finally:
        release.set()
        thread.join(5)


def test_a_holder_that_leaves_removes_its_socket_and_its_lock(tmp_path):
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SLURMD_NODENAME": "n0",
           "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from agents.holder import holder_main; "
         "sys.exit(holder_main('job-abc123', lambda m: print(m, flush=True)))"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    assert holder.stdout is not None and holder.stdin is not None
    assert "'standby': False" in holder.stdout.readline()  # it holds the node's socket
    names = sorted(os.listdir(runtime / "orchestrator"))
    assert names == ["job-abc123.holder.n0.sock", "job-abc123.holder.n0.sock.lock"], names
    holder.stdin.close()  # its controller is gone, and it started no agent
    assert holder.wait(10) == 0
    assert os.listdir(runtime / "orchestrator") == []


def _agent_directory(tmp_path) -> tuple[str, str]:
    directory = tmp_path / "run" / "job-abc123.0"
    directory.mkdir(parents=True)
    (directory / "spool").write_text("x")
    lock = str(directory) + ".lock"
    open(lock, "w").close()
    return str(directory), lock


def test_an_agents_directory_is_removed_with_its_lock_once_nobody_holds_it(tmp_path):
    directory, lock = _agent_directory(tmp_path)
    done = threading.Event()
    with Lock(lock):  # a relay launching an agent for the same job and node
        thread = threading.Thread(target=lambda: (clear_agent_directory(directory),
                                                  done.set()))
        thread.start()
        assert not done.wait(0.3) and os.path.isdir(directory)
    assert done.wait(5)
    thread.join(5)
    assert os.listdir(tmp_path / "run") == []


def test_an_agents_directory_is_left_to_the_agent_that_serves_there(tmp_path):
    directory, lock = _agent_directory(tmp_path)
    served = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a new agent listening
    bind_unix(served, os.path.join(directory, "agent.sock"))
    served.listen(1)
    try:
        clear_agent_directory(directory)
        assert sorted(os.listdir(directory)) == ["agent.sock", "spool"]
        assert os.path.exists(lock)
    finally:
        served.close()


def test_a_killed_agents_watchdog_leaves_nothing_in_the_runtime_directory(tmp_path):
    """The watchdog outlives the agent (SIGKILLed, here: exited) and removes what it kept
    there; it left the lock file behind, one per job and node."""
    directory, _ = _agent_directory(tmp_path)
    agent = subprocess.run(
        [sys.executable, "-c", "import sys; from agents.processes import start_watchdog; "
         f"start_watchdog('test-watchdog-{os.getpid()}', sys.argv[1])", directory],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=30)
    assert agent.returncode == 0
    deadline = time.monotonic() + 10
    while os.listdir(tmp_path / "run") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(tmp_path / "run") == []


def test_outcomes_nobody_came_back_for_are_swept_after_a_month(tmp_path):
    old = time.time() - OUTCOME_KEPT - 60
    names = {"job-a.0.outcome": old, "job-a.1.outcome": time.time() - 3600,
             "job-b.0.outcome.tmp": old, "notes.outcome": old, "job-c.0": old}
    for name, mtime in names.items():
        path = tmp_path / name
        path.write_text("{}")
        os.utime(path, (mtime, mtime))
    assert sweep_outcomes(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(set(names) - {"job-a.0.outcome"})


@pytest.mark.parametrize("owned", [False, True])
def test_the_watchdog_removes_what_its_agent_left_in_its_memory_unless_an_agent_owns_it(
        tmp_path, owned):
    """An agent that ended normally cleared its directory, but something of it wrote into its
    checkpoint memory after the store removed it (a buddy's copy finishing: CI found a job's
    memory on /dev/shm 15 s after its agents were gone). Its watchdog, which outlives it,
    removes the memory too, unless an agent owns it (a new agent of the same job and node
    holds its owner file locked)."""
    from agents.paths import OWNER_NAME, own_memory

    (tmp_path / "run").mkdir()
    directory = str(tmp_path / "run" / "job-abc123.0")  # gone: cleared by the agent's end
    memory = tmp_path / "memory" / "job-abc123.0"
    (memory / "replicas" / "rank-0").mkdir(parents=True)
    (memory / "replicas" / "rank-0" / "step-11.manifest").write_text("{}")
    owner = own_memory(str(memory)) if owned else None
    try:
        agent = subprocess.run(
            [sys.executable, "-c", "import sys; from agents.processes import start_watchdog; "
             f"start_watchdog('test-watchdog-{os.getpid()}', sys.argv[1], sys.argv[2])",
             directory, str(memory)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=30)
        assert agent.returncode == 0
        deadline = time.monotonic() + (3 if owned else 10)
        while memory.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert memory.exists() == owned
        if owned:
            assert (memory / OWNER_NAME).exists()
            assert (memory / "replicas" / "rank-0" / "step-11.manifest").exists()
    finally:
        if owner is not None:
            os.close(owner)
    assert not os.path.exists(directory + ".lock")
