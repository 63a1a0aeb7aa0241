"""What every submit goes through before its first node answers, kept short: the command
forks its supervisor before it imports the API, the public package imports on first use,
paramiko leaves invoke until a config needs it, and the controller's SSH socket sends at
once (benchmarks/latency.md)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from orchestrator.entry import submits
from orchestrator.transport import ssh


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(("argv", "expected"), [
    (["submit", "job.yaml"], True),
    (["submit", "job.yaml", "--wait", "--set", "max_restarts=2"], True),
    (["--debug", "submit", "job.yaml", "-f"], True),
    (["run", "--nproc-per-node", "2", "train.py"], True),
    (["submit", "job.yaml", "--dry-run"], False),
    (["submit", "--help"], False),
    (["run", "-h"], False),
    (["status", "job-1"], False),
    (["logs", "submit"], False),
    ([], False),
])
def test_the_command_forks_its_supervisor_first_only_when_it_submits(argv, expected):
    assert submits(argv) is expected


def test_the_command_forks_before_it_imports_anything_heavy():
    # What the command has imported when it forks is what the fork begins with; all else it
    # imports beside the command (the spec's models, the store, the controller, paramiko).
    loaded = _run("""
        import sys
        import orchestrator.entry, orchestrator.spawn
        heavy = ("orchestrator", "agents", "pydantic", "paramiko", "yaml", "sqlite3", "typer")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
    """)
    assert loaded == str(["orchestrator", "orchestrator.entry", "orchestrator.spawn"])


def test_the_public_package_imports_each_name_when_it_is_first_used():
    said = _run("""
        import sys
        import orchestrator
        before = "orchestrator.api" in sys.modules
        from orchestrator import JobSpec, JobState, submit
        print(before, "orchestrator.api" in sys.modules, submit.__module__, JobSpec.__name__,
              JobState.SUCCEEDED.value, "wait" in dir(orchestrator))
        try:
            orchestrator.no_such_name
        except AttributeError as exc:
            print(exc)
    """)
    assert said.splitlines() == [
        "False True orchestrator.api JobSpec SUCCEEDED True",
        "module 'orchestrator' has no attribute 'no_such_name'"]


def test_every_public_name_has_one_place_to_come_from():
    # The names are listed thrice (for type checkers, for the lazy import, for ``*``): kept
    # the same, or a name would be typed but missing, or importable but not exported.
    import orchestrator

    assert set(orchestrator._WHERE) == set(orchestrator.__all__)
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name).__name__ == name


def test_paramiko_loads_invoke_only_when_an_ssh_config_runs_a_command():
    said = _run("""
        import sys
        from orchestrator.transport import ssh
        import paramiko
        print("invoke.collection" in sys.modules)
        config = paramiko.SSHConfig.from_text('Match exec "true"\\n  User matched\\n')
        print(config.lookup("node-1").get("user"), "invoke.collection" in sys.modules)
    """)
    assert said.splitlines() == ["False", "matched True"]


def test_the_controllers_ssh_socket_sends_at_once():
    # Nagle's algorithm held a command written while an ack was unacknowledged until the
    # node's delayed ACK: 40 ms of every job's shutdown.
    server = socket.create_server(("127.0.0.1", 0))
    sock = socket.create_connection(server.getsockname())
    try:
        transport = ssh._transport(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        transport.close()
    finally:
        sock.close()
        server.close()
