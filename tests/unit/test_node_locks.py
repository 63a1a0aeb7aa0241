"""The node's lock files (agents/paths.py ``Lock``): one name means one lock even when its last
user removes the file, and a Slurm holder leaves nothing in the runtime directory when it
goes (it left an empty ``<job>.holder.<node>.sock.lock`` per job and node, forever)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading

import pytest

from agents.paths import Lock
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
