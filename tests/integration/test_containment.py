"""No process of a job survives it, whatever its workers' descendants do: double-fork,
``setsid``, ``env -i`` (no job id or token left to find them by) and ignoring SIGTERM. Counted
by the pids the escapees recorded, not by their environment; after ``cancel``, after a
failure, and after the agent and its watchdog are both SIGKILLed. The bodies are shared with
the SSH and Slurm tests (tests/cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import orchestrator
from agents import containment
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)

ESCAPER = [PYTHON, str(WORKERS / "escaper.py")]


def escapees(directory: Path) -> dict[str, int]:
    """What each rank's escapee recorded: "<attempt>-<rank>" -> its pid."""
    return {p.stem: int(p.read_text()) for p in directory.glob("*.pid")}


def still_running(pids) -> list[int]:
    """Those of ``pids`` that are still an escapee (``sleep 1001``), not a zombie."""
    left = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == b"sleep\x001001\x00" and state != b"Z":
            left.append(pid)
    return left


def escaped(job_id: str, directory: Path, nranks: int, running: bool = True
            ) -> dict[str, int]:
    """Wait until every rank's escapee started (and, with ``running``, runs); all of them,
    counted."""
    wait_for_output(job_id, "escaped", nranks)
    found = escapees(directory)
    assert len(found) == nranks, found
    if running:
        assert sorted(still_running(found.values())) == sorted(found.values()), found
    return found


def assert_all_gone(found: dict[str, int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while still_running(found.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = still_running(found.values())
    for pid in left:  # ours to end: this test's escapees, by the pid each recorded
        os.kill(pid, signal.SIGKILL)
    assert not left, f"escaped the job: {left} of {found}"


def cancel_leaves_nothing(job_id: str, directory: Path, nranks: int) -> None:
    found = escaped(job_id, directory, nranks)
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_all_gone(found)
    assert_no_job_processes(job_id)


def failure_leaves_nothing(job_id: str, directory: Path, nranks: int) -> None:
    found = escaped(job_id, directory, nranks, running=False)  # the failure may be quicker
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["exit_code"] == 3, result
    assert_all_gone(found)
    assert_no_job_processes(job_id)


def watchdog_of(agent_pid: int) -> int:
    """The agent's watchdog: its child in a session of its own, running what the agent runs."""
    cmdline = Path(f"/proc/{agent_pid}/cmdline").read_bytes()
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        for child in Path(f"/proc/{agent_pid}/task/{task}/children").read_text().split():
            fields = Path(f"/proc/{child}/stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(fields[3]) == int(child) and \
                    Path(f"/proc/{child}/cmdline").read_bytes() == cmdline:
                return int(child)
    raise AssertionError(f"agent {agent_pid} has no watchdog")


def killed_agent_and_watchdog_leave_nothing(job_id: str, directory: Path, nranks: int,
                                            node: int = 1) -> None:
    """SIGKILL one node's agent and its watchdog together: its workers die with the agent
    (PDEATHSIG); their escapees, orphaned to init, are still in the attempt's cgroup, which
    the node's next agent kills as it starts (the controller starts one on a lost node at
    once, for it to rejoin; here the job restarts there). Then a cancel."""
    found = escaped(job_id, directory, nranks)
    agent = orchestrator.status(job_id)["nodes"][node]["agent_pid"]
    watchdog = watchdog_of(agent)
    os.kill(watchdog, signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: orchestrator.status(job_id)["attempt"] == 2, 60, what="attempt 2")
    second = {}
    wait_for(lambda: len(second.update({k: v for k, v in escapees(directory).items()
                                        if k.startswith("2-")}) or second) == nranks, 60,
             what="attempt 2's escapees")
    assert_all_gone(found, within=15)  # attempt 1's, on every node
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_all_gone(second)
    assert_no_job_processes(job_id)


def _spec(tmp_path, **extra):
    directory = tmp_path / "escapees"
    directory.mkdir()
    env = {"ESCAPE_DIR": str(directory), **extra.pop("env", {})}
    spec = write_spec(tmp_path, {
        "name": "contain", "nodes": [{"host": "local"}] * 2, "nproc_per_node": 2,
        "command": ESCAPER, "workdir": str(tmp_path), "stop_grace_period": 1,
        "max_restarts": 0, "env": env, **extra})
    return spec, directory


def test_cancel_leaves_no_descendant_of_any_worker(home, tmp_path):
    spec, directory = _spec(tmp_path)
    cancel_leaves_nothing(orchestrator.submit(spec), directory, 4)


def test_a_failure_leaves_no_descendant_of_any_worker(home, tmp_path):
    spec, directory = _spec(tmp_path, env={"EXIT_AFTER": "3"})
    failure_leaves_nothing(orchestrator.submit(spec), directory, 4)


def test_agent_and_watchdog_sigkilled_leave_no_descendant(home, tmp_path):
    spec, directory = _spec(tmp_path, max_restarts=1)
    job_id = orchestrator.submit(spec)
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 60, what="RUNNING")
    killed_agent_and_watchdog_leave_nothing(job_id, directory, 4)


def test_agent_and_watchdog_sigkilled_in_a_job_that_then_fails_leave_nothing(home, tmp_path):
    # No restart: the fresh agent the controller starts on the lost node (for it to rejoin)
    # kills what was left, and is shut down with the job.
    spec, directory = _spec(tmp_path)
    job_id = orchestrator.submit(spec)
    found = escaped(job_id, directory, 4)
    agent = orchestrator.status(job_id)["nodes"][1]["agent_pid"]
    os.kill(watchdog_of(agent), signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
    assert orchestrator.wait(job_id, timeout=60)["state"] == "FAILED"
    assert_all_gone(found, within=15)
    assert_no_job_processes(job_id)


# --- each mechanism alone, on real processes --------------------------------------------------
ESCAPE = ('setsid env -i /bin/sh -c \'trap "" TERM HUP; echo $$ > {record}.tmp; '
          'mv {record}.tmp {record}; exec sleep 1001\' </dev/null >/dev/null 2>&1 &')


def _escape_from(record: Path, preexec=None) -> int:
    """Start a shell that leaves an escapee behind and exits; the escapee's pid."""
    subprocess.run(["/bin/sh", "-c", ESCAPE.format(record=record)], check=True,
                   preexec_fn=preexec)
    wait_for(record.exists, 10, what="the escapee")
    return int(record.read_text())


@pytest.mark.parametrize("kind", ["v2", "v1"])
def test_killing_an_attempts_cgroup_kills_what_left_the_session(tmp_path, kind):
    # These machines have both: v1 controllers and a v2 unified mount beside them.
    mounts = containment._cgroup_mounts()
    root = mounts["v2" if kind == "v2" else "freezer"]
    cgroups = containment.Cgroups(f"test-{os.getpid()}", 0, "a", parent=root, kind=kind)
    path = cgroups.attempt(1)
    assert path is not None and os.path.isdir(path)
    pid = _escape_from(tmp_path / "pid", preexec=lambda: containment.join(path))
    assert still_running([pid]) == [pid]
    assert str(pid) in Path(path, "cgroup.procs").read_text().split()
    # An agent's successor kills what it left (its watchdog would, its own only).
    successor = containment.Cgroups(f"test-{os.getpid()}", 0, "b", parent=root, kind=kind)
    assert successor.kill_all() == [] and still_running([pid]) == [pid]
    assert successor.kill_predecessors() == []
    assert still_running([pid]) == [] and not os.path.exists(cgroups.base or "")


def test_without_cgroups_the_subreaper_adopts_and_kills_the_orphans(tmp_path):
    record = tmp_path / "pid"
    script = (
        "import os, subprocess, sys, time\n"
        "from agents import containment\n"
        "assert containment.become_subreaper()\n"
        f"subprocess.run(['/bin/sh', '-c', {ESCAPE.format(record=record)!r}], check=True)\n"
        f"while not os.path.exists({str(record)!r}): time.sleep(0.02)\n"
        f"pid = int(open({str(record)!r}).read())\n"
        "parent = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "print(pid, parent == os.getpid(), flush=True)\n"
        "containment.kill_adopted()\n"
        "print(os.path.exists(f'/proc/{pid}'), flush=True)\n")
    done = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    pid, adopted = first.split()
    assert adopted == "True" and second == "False", done.stdout  # adopted, killed and reaped
    assert still_running([int(pid)]) == []
