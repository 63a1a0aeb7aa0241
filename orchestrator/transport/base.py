"""The NodeConnection protocol: how the controller reaches one node's agent.

A connection is a *channel* to a node: it starts the relay of the agent (``agents/``,
shipped over the channel itself, so nothing is installed on the node) and carries JSON
lines both ways. Closing a channel ends the relay, never the agent: the agent lives on its
node until the controller tells it to shut down, or until no controller has attached for
``health.controller_grace``. The controller receives a factory
and never knows whether a node is a local subprocess or an SSH session; tests pass their own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import os
import select
import subprocess
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from types import CodeType
from typing import Any, Protocol

import agents
from agents import commands as C
from agents import protocol as P
from agents.protocol import MAX_MESSAGE, decode, encode
from orchestrator.errors import AgentError
from orchestrator.spec import JobSpec, NodeSpec

# Run by ``python3 -I -u -c``: reads the agent's modules from stdin (a line "count magic
# size", then ``size`` bytes of zlib holding, for each module, "name length codelength", its
# source and its code as the controller's Python compiled it), serves them to ``import`` from
# memory ahead of anything installed on the node (another version of this package, say), and
# runs agents.main. A node whose Python reads that code (the same bytecode magic) runs it;
# any other compiles the source (a compile is a fifth of the agent's start). The rest of
# stdin is then the channel's JSON lines.
BOOTSTRAP = """import sys,io,zlib,marshal,importlib.util as u
i=sys.stdin.buffer;m={};c={};h=i.readline().split();o=h[1]==u.MAGIC_NUMBER.hex().encode()
b=io.BytesIO(zlib.decompress(i.read(int(h[2]))))
for _ in range(int(h[0])):
 n,k,j=b.readline().split();n=n.decode();m[n]=b.read(int(k));c[n]=b.read(int(j))
P={n.rpartition('.')[0] for n in m}
class F:
 def find_spec(s,n,p=None,t=None):
  return u.spec_from_loader(n,s,is_package=n in P)if n in m else None
 def create_module(s,spec):return None
 def exec_module(s,d):
  n=d.__name__;d.__shipped__=m;f=n.replace('.','/')+'.py'
  exec(marshal.loads(c[n])if o and c[n]else compile(m[n],f,'exec'),d.__dict__)
sys.meta_path.insert(0,F());sys.argv=['orchestrator-agent']
import agents.main;sys.exit(agents.main.main())"""


# How the agent's interpreter runs on every transport: isolated (-I: no PYTHON* variables,
# no user site, no current directory on sys.path, so nothing in a home or a PYTHONPATH
# shadows the stdlib modules the agent imports) and unbuffered. Only the agent's own
# interpreter: its environment, which workers start from, is left as it is.
AGENT_PYTHON_FLAGS = ("-I", "-u")


class NodeConnection(Protocol):
    """One channel to a node's agent: bytes both ways, readable through a file descriptor,
    so that one event loop serves every channel (orchestrator/loop.py)."""

    host: str
    framer: Framer  # what was read and not yet taken, as messages

    def open(self) -> None:
        """Open the channel and start the relay (raises a TransportError naming the host)."""

    def send(self, message: dict[str, Any]) -> None:
        """Send one message; raises AgentError if the channel is gone."""

    def fileno(self) -> int:
        """Readable when ``read`` has something (or the end) for us."""

    def read(self) -> bytes:
        """What the channel has now (after ``fileno`` was readable), b"" at its end;
        BlockingIOError when what was readable was not for us (an SSH channel's stderr)."""

    def close(self) -> None:
        """Close the channel (the agent lives on) and release its resources."""


ConnectionFactory = Callable[[NodeSpec, JobSpec], NodeConnection]


class Framer:
    """Bytes to messages: every complete JSON line, decoded, waits in ``pending``; a line
    that is not one of ours (a login banner, the relay's traceback on a merged stderr) is
    kept in ``noise``, the last few, to explain a failure; a line longer than MAX_MESSAGE is
    dropped whole."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False  # inside a line too long to keep
        self.pending: deque[dict[str, Any]] = deque()
        self.noise: deque[str] = deque(maxlen=20)

    def feed(self, data: bytes) -> None:
        self._buf += data
        end = self._buf.rfind(b"\n")
        if end < 0:
            if len(self._buf) > MAX_MESSAGE:
                self._buf.clear()
                self._skipping = True
            return
        chunk = bytes(self._buf[:end])
        del self._buf[:end + 1]
        for raw in chunk.split(b"\n"):
            if self._skipping:
                self._skipping = False
                continue
            message = decode(raw)
            if message is not None:
                self.pending.append(message)
            elif raw.strip():
                self.noise.append(raw[:300].decode("utf-8", "replace").rstrip())

    def take(self) -> list[dict[str, Any]]:
        out = list(self.pending)
        self.pending.clear()
        return out


def receive(conn: NodeConnection, timeout: float | None = None) -> dict[str, Any] | None:
    """Block for the channel's next message (the handshake, before the channel joins the
    event loop); None at the channel's end or after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not conn.framer.pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        try:  # poll, not select: descriptors above 1023 are common at scale
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            ready = poller.poll(None if left is None else max(0, int(left * 1000)))
        except (OSError, ValueError):
            return None
        if not ready:
            return None
        try:
            data = conn.read()
        except BlockingIOError:  # something else was readable (an SSH channel's stderr)
            continue
        except (OSError, EOFError, ValueError):
            return None
        if not data:
            return None
        conn.framer.feed(data)
    return conn.framer.pending.popleft()


class PipeConnection:
    """send() over a writable byte stream and read() over a readable pipe: the relay as a
    child process (local) or as srun's (Slurm)."""

    host: str
    framer: Framer
    _proc: subprocess.Popen[bytes] | None = None

    def _attach_pipes(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self.framer = Framer()
        self._write_lock = threading.Lock()
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()

    def send(self, message: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise AgentError(self.host, "not open")
        data = encode(message)
        with self._write_lock:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (OSError, ValueError) as exc:
                raise AgentError(self.host, f"agent channel closed: {exc}") from exc

    def fileno(self) -> int:
        return self._fd

    def read(self) -> bytes:
        return os.read(self._fd, 65536)


class AgentGone(AgentError):
    """The relay found no agent of this job on the node (it died, or gave up)."""

    def __init__(self, host: str, gone: P.Gone):
        reason = gone.reason
        super().__init__(host, "the agent is gone" + (f" ({reason})" if reason else ""))
        self.outcome = gone.outcome
        self.reason = reason


class ProtocolViolation(AgentError):
    """The node said something out of protocol (``problem`` names the field)."""

    def __init__(self, host: str, problem: str):
        super().__init__(host, f"malformed message from the agent ({problem})")
        self.problem = problem


class WrongVersion(AgentError):
    """The agent speaks another protocol version (another orchestrator's agent)."""

    def __init__(self, host: str, theirs: Any):
        super().__init__(host, f"the agent speaks protocol {theirs!r}, this controller speaks "
                               f"{P.VERSION} (an agent of another orchestrator version)")


def attach_agent(conn: NodeConnection, job_id: str, node_index: int, secret: str, *,
                 launch: C.Launch | None = None, ack: int = 0,
                 timeout: float | None = None) -> tuple[P.Hello, bool]:
    """The handshake on a fresh channel: ``connect`` to the relay (which starts the agent
    when ``launch`` says how and none answers), then ``attach`` with the job's secret.
    Returns (hello, launched); raises AgentGone, WrongVersion, ProtocolViolation, or
    AgentError naming the host. The channel is closed when it fails."""
    try:
        conn.send(C.wire(C.Connect(job_id, node_index, launch)))
        raw = receive(conn, timeout)
        reply = P.parse(raw) if raw is not None else None
        if isinstance(reply, P.Gone):
            raise AgentGone(conn.host, reply)
        if not isinstance(reply, P.Relay):
            tail = list(conn.framer.noise)[-3:]
            what = reply.message if isinstance(reply, P.ErrorReport) else \
                "the agent's relay exited"
            raise AgentError(conn.host, f"{what}" + (": " + " | ".join(tail) if tail else ""))
        conn.send(C.wire(C.Attach(secret, ack)))
        try:
            hello = P.parse_hello(receive(conn, timeout))
        except P.OtherVersion as exc:
            raise WrongVersion(conn.host, exc.theirs) from None
        if hello is None:
            raise AgentError(conn.host, "the agent refused the attach (wrong job secret?)")
        return hello, reply.launched
    except P.ProtocolError as exc:
        conn.close()
        raise ProtocolViolation(conn.host, str(exc)) from None
    except AgentError:
        conn.close()
        raise


def agent_payload() -> bytes:
    """What BOOTSTRAP reads from stdin: every module of the agent, named and length-prefixed,
    its source and its code (none for agents.TEXT_ONLY: compiled if ever imported; read once
    per process: they do not change under a running controller)."""
    global _payload
    if _payload is None:
        out = []
        for name in agents.MODULES:
            text = agents.source(name)
            code = b"" if name in agents.TEXT_ONLY else marshal.dumps(_compiled(name, text))
            source = text.encode()
            out.append(b"%s %d %d\n" % (name.encode(), len(source), len(code)) + source + code)
        # Level 4: 4% fewer bytes than 3 for 7 ms more, once per controller process (the
        # shipped code objects compress poorly; a node decompresses either as fast).
        packed = zlib.compress(b"".join(out), 4)
        _payload = b"%d %s %d\n" % (len(agents.MODULES), importlib.util.MAGIC_NUMBER.hex().encode(),
                                    len(packed)) + packed
    return _payload


def _compiled(name: str, text: str) -> CodeType:
    """A module of the agent compiled as an import would compile it (no inherited
    ``__future__``), from Python's own cache of it where it has one (``__pycache__``, checked
    against the source as an import checks it): compiling them all took 0.07 s of every
    submit's way to its first node. Compiled here, where none is kept."""
    try:
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if isinstance(loader, importlib.machinery.SourceFileLoader):
            code = loader.get_code(name)
            if code is not None:
                return code
    except (ImportError, OSError, SyntaxError, ValueError):
        pass
    return compile(text, name.replace(".", "/") + ".py", "exec", dont_inherit=True)


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
