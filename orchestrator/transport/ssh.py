"""SSHConnection: the node agent over an SSH exec channel (paramiko).

The agent's source travels over the channel, ahead of the JSON lines, to a short bootstrap
given to ``python3 -c`` (see ``base.BOOTSTRAP``): nothing is uploaded, and no environment
value or secret ever appears on a remote command line (only the interpreter and the
bootstrap). The channel runs the agent's relay; the agent itself outlives the session.

Host keys are verified against known_hosts and unknown keys are refused (paramiko's
RejectPolicy; fabric's default would add them). ``host_key_policy: accept-new`` accepts and
records a key never seen before, like OpenSSH's ``StrictHostKeyChecking=accept-new``; a
changed key is refused either way. Agent forwarding is never requested.

paramiko and socket exceptions are caught here only, and re-raised as ours with the host.
"""

from __future__ import annotations

import os
import shlex
import socket
import threading
from typing import Any

import paramiko

from agents.protocol import encode
from orchestrator.errors import (
    AgentError,
    AuthenticationError,
    ConnectError,
    HostKeyChanged,
    HostKeyError,
    HostKeyUnknown,
    TransportError,
)
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import AGENT_PYTHON_FLAGS, BOOTSTRAP, Framer, agent_payload
from orchestrator.transport.hosts import known_hosts_path, resolve_target

_known_hosts_lock = threading.Lock()


def _transport(sock: Any, **kwargs: Any) -> paramiko.Transport:
    """paramiko's transport, asking for AES-GCM first: it costs the controller 1.7-2.4 ms of
    CPU per MiB received against 4.0 ms for paramiko's first choice, aes128-ctr
    (benchmarks/handshake.md). Only the order changes: a server without GCM gets CTR.

    Its socket sends at once (TCP_NODELAY, as OpenSSH's client does for a session): with
    Nagle's algorithm a command written while a small one (an ack) was not yet acknowledged
    waited for the node's delayed ACK, 40 ms: every job's shutdown did, on the way to its end."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    gcm = tuple(c for c in ("aes256-gcm@openssh.com", "aes128-gcm@openssh.com")
                if c in options.ciphers)
    options.ciphers = gcm + tuple(c for c in options.ciphers if c not in gcm)
    return transport


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Accept a host never seen before and record its key; changed keys stay refused."""

    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        with _known_hosts_lock:
            client.get_host_keys().add(hostname, key.get_name(), key)
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """paramiko's RejectPolicy, raising our own type: an unknown key is told from a changed
    one by the exception, never by its message."""

    def __init__(self, host: str):
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        raise HostKeyUnknown(self.host, f"host key for {hostname} is not in known_hosts "
                                        "(add it, or set ssh.host_key_policy: accept-new)")


class SSHConnection:
    """One node's agent over SSH."""

    def __init__(self, node: NodeSpec, spec: JobSpec):
        self.host = node.host
        self._node = node
        self._spec = spec
        self._client: paramiko.SSHClient | None = None
        self._channel: paramiko.Channel | None = None
        self._fd = -1
        self._write_lock = threading.Lock()
        self._stderr_carry = b""
        self.framer = Framer()

    # --- connecting -------------------------------------------------------------------
    def connect(self) -> paramiko.SSHClient:
        """An authenticated SSH client for the node, host key verified."""
        opts = self._spec.ssh
        target = resolve_target(self._node, self._spec)
        known_hosts = known_hosts_path(self._spec)
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(known_hosts)
        except FileNotFoundError:
            pass
        except (OSError, paramiko.SSHException) as exc:
            raise HostKeyError(self.host, f"cannot read known_hosts {known_hosts}: {exc}") from exc
        if opts.host_key_policy == "accept-new":
            client.set_missing_host_key_policy(_AcceptNewPolicy(known_hosts))
        else:
            client.set_missing_host_key_policy(_RejectUnknown(self.host))
        timeout = opts.connect_timeout
        try:
            client.connect(
                target["hostname"], port=target["port"], username=target["username"],
                key_filename=target["key_filename"],
                look_for_keys=target["key_filename"] is None,
                allow_agent=target["key_filename"] is None,
                timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                channel_timeout=timeout, transport_factory=_transport,
            )
        except Exception as exc:
            client.close()
            raise self._translate(exc, target) from exc
        return client

    def _translate(self, exc: Exception, target: dict[str, Any]) -> TransportError:
        where = f"{target['username']}@{target['hostname']}:{target['port']}"
        if isinstance(exc, HostKeyUnknown):
            return HostKeyUnknown(self.host, f"host key for {where} is not in known_hosts "
                                             "(add it, or set ssh.host_key_policy: accept-new)")
        if isinstance(exc, paramiko.BadHostKeyException):
            return HostKeyChanged(self.host, f"host key for {where} does not match known_hosts "
                                             "(changed host key: refusing to connect)")
        if isinstance(exc, paramiko.AuthenticationException):
            return AuthenticationError(self.host, f"authentication failed for {where}: {exc}")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return ConnectError(self.host, f"connection to {where} timed out after "
                                           f"{self._spec.ssh.connect_timeout:g}s")
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            return ConnectError(self.host, f"cannot connect to {where}: connection refused")
        if isinstance(exc, (OSError, paramiko.SSHException, EOFError)):
            return ConnectError(self.host, f"cannot connect to {where}: {exc}")
        return ConnectError(self.host, f"cannot connect to {where}: {exc!r}")

    # --- the NodeConnection protocol -----------------------------------------------------
    def open(self) -> None:
        self._client = self.connect()
        try:
            transport = self._client.get_transport()
            assert transport is not None
            transport.set_keepalive(15)
            channel = transport.open_session(timeout=self._spec.ssh.connect_timeout)
            command = shlex.join([self._spec.python, *AGENT_PYTHON_FLAGS, "-c", BOOTSTRAP])
            channel.exec_command(command)
            channel.sendall(agent_payload())
            self._fd = channel.fileno()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.close()
            raise AgentError(self.host, f"cannot start the agent: {exc}") from exc
        self._channel = channel

    def send(self, message: dict[str, Any]) -> None:
        channel = self._channel
        if channel is None:
            raise AgentError(self.host, "not open")
        data = encode(message)
        with self._write_lock:
            try:
                channel.sendall(data)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise AgentError(self.host, f"agent channel closed: {exc}") from exc

    def fileno(self) -> int:
        return self._fd

    def read(self) -> bytes:
        """The channel's fileno is readable for its stdout and its stderr alike: the relay's
        stderr (a traceback, "python3: not found", a login script's noise) is drained here,
        in bounded pieces, its last lines kept as the framer's noise to explain a failed
        start; BlockingIOError when that was all there was."""
        channel = self._channel
        if channel is None:
            return b""
        try:
            while channel.recv_stderr_ready():
                self._stderr(channel.recv_stderr(65536))
            if channel.recv_ready() or channel.eof_received or channel.closed:
                return channel.recv(65536)
        except (paramiko.SSHException, OSError, EOFError):
            return b""
        raise BlockingIOError("only stderr")

    def _stderr(self, data: bytes) -> None:
        lines = (self._stderr_carry + data).split(b"\n")
        self._stderr_carry = lines.pop()[-300:]  # a line without end: its last part
        for raw in lines[-20:]:
            if raw.strip():
                self.framer.noise.append(raw[:300].decode("utf-8", "replace").rstrip())

    def close(self) -> None:
        channel, client = self._channel, self._client
        self._channel = self._client = None
        if channel is not None:
            try:
                channel.shutdown_write()  # EOF: the relay exits; the agent lives on
                channel.status_event.wait(5)  # set when the remote exit status arrives
            except (paramiko.SSHException, OSError, EOFError):
                pass
            channel.close()
        if client is not None:
            client.close()
