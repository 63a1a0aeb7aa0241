"""What every submit goes through before its first node answers, kept short: paramiko leaves
invoke until a config needs it, and the controller's SSH socket sends at once
(benchmarks/latency.md)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from orchestrator.transport import ssh


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


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
