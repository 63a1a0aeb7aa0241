"""A node's setup (agents/setup.py) as the agent runs it: from a 0600 file, never on a command
line; stopped past its time limit, whatever holds its output; cached once it succeeded."""

from __future__ import annotations

import os
import secrets
import threading
import time

import pytest

from agents import setup
from tests.helpers import command_lines


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    private = tmp_path / "agent"
    private.mkdir(mode=0o700)
    return private


def run(node, script, timeout=None, seen=None):
    key = secrets.token_hex(16)
    return setup.run_setup(key, script, str(node), {"A_TOKEN": "t0ken"}, "tok",
                           (seen if seen is not None else []).extend, 8192, str(node),
                           timeout)


def test_the_script_runs_from_a_private_file_and_is_on_no_command_line(node):
    secret = f"pypi-{secrets.token_hex(8)}"
    seen: list[str] = []
    scanned: list[bytes] = []

    def scan():
        time.sleep(0.5)
        scanned.extend(command_lines())

    scanner = threading.Thread(target=scan)
    scanner.start()
    done = run(node, f"X={secret}\necho ${{#X}} $A_TOKEN\nsleep 1\n", seen=seen)
    scanner.join()
    assert done.exit_code == 0 and not done.timed_out and seen == ["21 t0ken"]
    assert scanned and not [c for c in scanned if secret.encode() in c]
    assert any(b"/bin/sh " + str(node).encode() in c for c in scanned)  # it ran from there
    assert os.listdir(node) == []  # and the file is gone


@pytest.mark.parametrize("script", [
    "echo started\nsleep {nap}\n",
    "echo started\nexec >/dev/null 2>&1\nsleep {nap}\n",  # its output ends before it does
    "echo started\nsleep {nap} &\nexit 0\n",  # a child it left holds the pipe
])
def test_a_setup_past_its_time_is_stopped_whatever_holds_its_output(node, script):
    nap = f"600.{secrets.randbelow(10**6):06d}"
    started = time.monotonic()
    done = run(node, script.format(nap=nap), timeout=1.0)
    assert done.timed_out and done.tail == ("started",)
    assert time.monotonic() - started < 1.0 + setup.STOP_GRACE + 2
    time.sleep(0.2)
    assert not [c for c in command_lines() if f"sleep {nap}".encode() in c]


def test_a_success_is_remembered_and_a_failure_is_not(node):
    key = secrets.token_hex(16)
    count = node / "count"

    def once(script):
        return setup.run_setup(key, script, str(node), {}, "tok", lambda _: None, 8192,
                               str(node), None)

    failed = once(f"echo x >> {count}\nexit 3\n")
    assert failed.exit_code == 3 and not failed.cached
    first, again = once(f"echo x >> {count}\n"), once(f"echo x >> {count}\n")
    assert first.exit_code == 0 and not first.cached and again.cached
    assert count.read_text().count("x") == 2


def test_free_space_is_checked_in_the_workdir_and_in_the_cache(node, tmp_path):
    """The cache (synced trees) on a filesystem of its own, 4 MiB: too little for 1 GiB."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("needs root to mount a small tmpfs")
        pytest.skip("needs root to mount a small tmpfs")
    import subprocess

    cache = tmp_path / "home" / ".cache" / "orchestrator"
    cache.mkdir(parents=True, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(cache)],
                   check=True)
    try:
        problems, _ = setup.run_check([], str(node), {}, "tok", 8192, 5, 2**30)
        (problem,) = problems
        assert problem.endswith(f"GiB free in {cache}, fewer than health.min_free_bytes "
                                "(1.00 GiB)"), problem
        assert setup.run_check([], str(node), {}, "tok", 8192, 5, 2**20)[0] == []
    finally:
        subprocess.run(["umount", str(cache)], check=True)
