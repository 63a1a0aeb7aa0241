"""The NodeConnection protocol: how the controller reaches one node's agent.

A connection is a *channel* to a node: it starts the relay of the agent (``agents/``,
shipped over the channel itself, so nothing is installed on the node) and carries JSON
lines both ways. Closing a channel ends the relay, never the agent: the agent lives on its
node until the controller tells it to shut down, or until no controller has attached for
``health.controller_grace``. The controller receives a factory
and never knows whether a node is a local subprocess or an SSH session; tests pass their own.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from typing import IO, Any, Protocol

import agents
from agents import protocol as P
from agents.protocol import MAX_MESSAGE, decode, encode
from orchestrator.errors import AgentError
from orchestrator.spec import JobSpec, NodeSpec

# Run by ``python3 -I -u -c``: reads the agent's modules from stdin (a count, then for each
# "name length" and its source), serves them to ``import`` from memory ahead of anything
# installed on the node (another version of this package, say), and runs agents.main. The
# rest of stdin is then the channel's JSON lines.
BOOTSTRAP = """import sys,importlib.util as u
b=sys.stdin.buffer;m={}
for _ in range(int(b.readline())):n,k=b.readline().split();m[n.decode()]=b.read(int(k))
P={n.rpartition('.')[0] for n in m}
class F:
 def find_spec(s,n,p=None,t=None):
  return u.spec_from_loader(n,s,is_package=n in P)if n in m else None
 def create_module(s,spec):return None
 def exec_module(s,d):
  d.__shipped__=m;exec(compile(m[d.__name__],d.__name__.replace('.','/')+'.py','exec'),d.__dict__)
sys.meta_path.insert(0,F());sys.argv=['orchestrator-agent']
import agents.main;sys.exit(agents.main.main())"""


# How the agent's interpreter runs on every transport: isolated (-I: no PYTHON* variables,
# no user site, no current directory on sys.path, so nothing in a home or a PYTHONPATH
# shadows the stdlib modules the agent imports) and unbuffered. Only the agent's own
# interpreter: its environment, which workers start from, is left as it is.
AGENT_PYTHON_FLAGS = ("-I", "-u")


class NodeConnection(Protocol):
    """One channel to a node's agent."""

    host: str

    def open(self) -> None:
        """Open the channel and start the relay (raises a TransportError naming the host)."""

    def send(self, message: dict[str, Any]) -> None:
        """Send one message; raises AgentError if the channel is gone."""

    def receive(self) -> dict[str, Any] | None:
        """Block for the next message; None once the channel is closed."""

    def close(self) -> None:
        """Close the channel (the agent lives on) and release its resources."""


ConnectionFactory = Callable[[NodeSpec, JobSpec], NodeConnection]


class Reader(Protocol):
    """What JsonLines reads from: a pipe, or a paramiko channel file."""

    def readline(self, size: int | None = ...) -> bytes: ...


class Writer(Protocol):
    def write(self, data: bytes) -> Any: ...

    def flush(self) -> Any: ...


class JsonLines:
    """JSON-lines framing over a pair of byte streams, shared by the real transports."""

    def __init__(self, host: str, reader: Reader | IO[bytes], writer: Writer | IO[bytes]):
        self.host = host
        self._reader = reader
        self._writer = writer
        self._write_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._write_lock:
            try:
                self._writer.write(data)
                self._writer.flush()
            except (OSError, ValueError, EOFError) as exc:
                raise AgentError(self.host, f"agent channel closed: {exc}") from exc

    def receive(self) -> dict[str, Any] | None:
        while True:
            try:
                raw = self._reader.readline(MAX_MESSAGE)
            except (OSError, ValueError, EOFError):
                return None
            if not raw:
                return None
            message = decode(raw)
            if message is not None:  # else not ours (e.g. a login banner): skip it
                return message


class LineConnection:
    """send() and receive() over the JsonLines that a transport's open() sets up."""

    host: str
    _lines: JsonLines | None = None

    def send(self, message: dict[str, Any]) -> None:
        if self._lines is None:
            raise AgentError(self.host, "not open")
        self._lines.send(message)

    def receive(self) -> dict[str, Any] | None:
        return self._lines.receive() if self._lines else None


class AgentGone(AgentError):
    """The relay found no agent of this job on the node (it died, or gave up)."""

    def __init__(self, host: str, outcome: dict[str, Any] | None):
        reason = (outcome or {}).get("reason")
        super().__init__(host, "the agent is gone" + (f" ({reason})" if reason else ""))
        self.outcome = outcome


def attach_agent(conn: NodeConnection, job_id: str, node_index: int, secret: str, *,
                 launch: dict[str, Any] | None = None, ack: int = 0
                 ) -> tuple[dict[str, Any], bool]:
    """The handshake on a fresh channel: ``connect`` to the relay (which starts the agent
    when ``launch`` says how and none answers), then ``attach`` with the job's secret.
    Returns (hello, launched); raises AgentGone, or AgentError naming the host. The channel
    is closed when it fails."""
    conn.send(P.connect(job_id, node_index, launch))
    reply = conn.receive()
    if reply is None or reply.get("type") not in (P.RELAY, P.GONE):
        conn.close()
        tail = list(getattr(conn, "stderr_tail", []) or [])[-3:]
        what = reply.get("message") if reply else "the agent's relay exited"
        raise AgentError(conn.host, f"{what}" + (": " + " | ".join(tail) if tail else ""))
    if reply["type"] == P.GONE:
        conn.close()
        raise AgentGone(conn.host, reply.get("outcome"))
    conn.send(P.attach(secret, ack))
    hello = conn.receive()
    if hello is None or hello.get("type") != P.HELLO:
        conn.close()
        raise AgentError(conn.host, "the agent refused the attach (wrong job secret?)")
    return hello, bool(reply.get("launched"))


def agent_payload() -> bytes:
    """What BOOTSTRAP reads from stdin: every module of the agent, named and length-prefixed
    (read once per process: they do not change under a running controller)."""
    global _payload
    if _payload is None:
        out = [b"%d\n" % len(agents.MODULES)]
        for name in agents.MODULES:
            source = agents.source(name).encode()
            out.append(b"%s %d\n" % (name.encode(), len(source)) + source)
        _payload = b"".join(out)
    return _payload


_payload: bytes | None = None


def end_relay_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Close a relay child's stdin (EOF: the relay exits; the agent, a daemon, lives on),
    wait up to ``timeout``, kill it if it lingers, and close its stdout."""
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()
