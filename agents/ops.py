"""The agent's commands, one handler each (``OPS``, by command class): ports and
reachability (a run's master port, and ``check``), stacks and flight recorder dumps
(orchestrator/hang.py), code and setup (orchestrator/prepare.py), hot spares. Starting and
stopping workers are the agent's own (``Agent.op_start``, ``Agent.op_stop``). Every handler
gets its command parsed at the door (agents/commands.py) and the request's ``req``; a
handler that raises is answered ``failed``."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from agents import cache, gpucheck, netcheck, setup, stacks
from agents import commands as C
from agents import protocol as P
from agents.checkpoints import Store
from agents.netinfo import free_port, interface_for
from agents.outbox import Outbox
from agents.standby import Standbys
from agents.workers import Worker, prepare, worker_env


class Sockets:
    """What the checks hold open between two commands: preflight's listening sockets, and
    the network check's receiver (a new one replaces the last)."""

    def __init__(self) -> None:
        self.listeners: list[socket.socket] = []
        self.receiver: netcheck.Receiver | None = None


class Agent(Protocol):
    """What the handlers use of the agent (agents/agent.py): its identity and attempt, its
    workers and standbys, and how it answers and runs slow work."""

    directory: str
    job_id: str
    token: str
    attempt: int
    traces_dir: str | None
    workers: list[Worker]
    standbys: Standbys
    outbox: Outbox
    sockets: Sockets  # the agent keeps them; only these handlers use them
    checkpoints: Store

    def reply(self, reply: P.Reply) -> None: ...
    def aside(self, handler: Callable[[], None], command: C.Command,
              req: int | None) -> None: ...
    def on_thread(self, handler: Callable[[], None], command: C.Command,
                  req: int | None) -> None: ...
    def op_start(self, start: C.Start) -> None: ...
    def op_stop(self, stop: C.Stop) -> None: ...


# --- ports and reachability (run and preflight) ------------------------------------
def op_free_port(agent: Agent, ask: C.FreePort, req: int) -> None:
    """A port free now: ``port`` (0: any), or the first free one of ``range`` [lo, hi]."""
    low, high = ask.range or (ask.port, ask.port)
    # From a random place in the range: jobs launching together on one master should
    # not all take its first port.
    start = secrets.randbelow(high - low + 1) if high > low else 0
    for i in range(high - low + 1):
        port, ok = free_port(low + (start + i) % (high - low + 1))
        if ok:
            break
    agent.reply(P.PortReply(req, port, ok))


def op_listen(agent: Agent, ask: C.Listen, req: int) -> None:
    """Hold listening sockets on ``port`` (0: any), or on every free port of ``ports``,
    so that peers can test that they reach them (preflight)."""
    held = agent.sockets
    for s in held.listeners:
        s.close()
    held.listeners = []
    busy, error = [], None
    for port in ask.ports or (ask.port,):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(64)
        except OSError as exc:
            s.close()
            busy.append(port)
            error = str(exc)
            continue
        held.listeners.append(s)
    ports = tuple(s.getsockname()[1] for s in held.listeners)
    agent.reply(P.Listening(req, ports, tuple(busy), bool(ports), error))


def op_probe(agent: Agent, ask: C.Probe, req: int) -> None:
    """Report the interface toward ``address`` and whether each of ``ports`` there accepts
    TCP."""
    errors: dict[int, str] = {}

    def one(port: int) -> None:
        try:
            with socket.create_connection((ask.address, port), timeout=ask.timeout):
                pass
        except OSError as exc:
            errors[port] = str(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in ask.ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.reply(P.ProbeResult(req, interface_for(ask.address), not errors,
                              tuple(sorted(errors)), next(iter(errors.values()), None)))


# ---  stacks and flight recorder (see orchestrator/hang.py) -------------------------
def op_stacks(agent: Agent, ask: C.GetStacks, req: int) -> None:
    """Each live rank's Python stack: py-spy (needs ptrace), else the faulthandler hook
    every worker registered at start. On a thread: py-spy takes its time."""
    agent.on_thread(lambda: _stacks(agent, ask, req), ask, req)


def _stacks(agent: Agent, ask: C.GetStacks, req: int) -> None:
    targets = stacks.rank_pids(list(agent.workers), agent.token)
    wanted = ask.flight_recorder and bool(targets)
    found: dict[int, P.Stack] = {}

    def one(rank: int, pid: int) -> None:
        found[rank] = P.Stack(**stacks.one_stack(pid, rank, agent.directory, agent.attempt))

    threads = [threading.Thread(target=one, args=(r, p)) for r, p in targets]
    for t in threads:
        t.start()
    # One deadline for both, inside the controller's: a late reply is a lost one.
    deadline = time.monotonic() + ask.timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    dumps: dict[str, str] = {}
    refused: dict[str, str] = {}
    if wanted:
        # After the stacks: a rank's first dump imports parts of torch (a second or more
        # of CPU), which would show in them. Each rank's sampler looks for this file ten
        # times a second.
        asked_at = time.time()
        stack_dir = os.path.join(agent.directory, f"attempt-{agent.attempt}")
        with open(os.path.join(stack_dir, "flight-recorder-wanted"), "w"):
            pass
        dumps, refused = stacks.trace_files(agent.traces_dir or "", stack_dir,
                                            [r for r, _ in targets], asked_at, deadline)
    agent.reply(P.Stacks(req, dict(found), {int(r): p for r, p in dumps.items()},
                         {int(r): why for r, why in refused.items()}))


def op_read_trace(agent: Agent, ask: C.ReadTrace, req: int) -> None:
    """A piece (up to 1 MiB) of a flight recorder dump under this user's traces directory;
    nothing else is readable this way: no symlink is followed, and only a regular file is
    opened (on the main loop: a FIFO must not block it). See stacks.open_trace."""
    fd = stacks.open_trace(ask.path)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, 1024 * 1024, ask.offset)
    finally:
        os.close(fd)
    agent.reply(P.TraceChunk(req, data, size))


# ---  code and setup on the node (see orchestrator/prepare.py) ----------------------
def op_sync_missing(agent: Agent, ask: C.MissingBlobs, req: int) -> None:
    agent.aside(lambda: agent.reply(P.SyncMissing(req, tuple(
        cache.missing_blobs(list(ask.blobs))))), ask, req)


def op_sync_put(agent: Agent, ask: C.PutChunk, req: int) -> None:
    def put() -> None:
        error = cache.put_chunk(ask.sha, ask.offset, ask.data, ask.last)
        agent.reply(P.SyncPut(req, error is None, error))

    agent.aside(put, ask, req)


def op_sync_build(agent: Agent, ask: C.BuildTree, req: int) -> None:
    agent.aside(lambda: agent.reply(P.SyncBuilt(req, cache.build_tree(
        ask.tree, [list(f) for f in ask.files], ask.keep))), ask, req)


def op_setup(agent: Agent, ask: C.RunSetup, req: int) -> None:
    """Run the job's setup script once per key on this machine (skipped when that key
    succeeded before); its output streams as ``setup_output`` while it runs."""
    def run() -> None:
        done = setup.run_setup(
            ask.key, ask.script, ask.workdir or ".", dict(ask.env), agent.token,
            lambda lines: agent.outbox.put_live(P.SETUP_OUTPUT, lines), P.MAX_LINE,
            agent.directory, ask.timeout)
        agent.reply(P.SetupDone(req, done.exit_code, done.cached, tuple(done.tail),
                                done.timed_out))

    agent.on_thread(run, ask, req)


def op_node_check(agent: Agent, ask: C.CheckNode, req: int) -> None:
    """The health check before an attempt (agents/setup.py: run_check)."""
    def run() -> None:
        problems, tail = setup.run_check(
            list(ask.argv), ask.workdir or ".", dict(ask.env), agent.token, P.MAX_LINE,
            ask.timeout, ask.min_free_bytes)
        if ask.gpu_check:
            problems += gpucheck.check(ask.gpus, ask.timeout)
        agent.reply(P.Checked(req, tuple(problems), tuple(tail)))

    agent.on_thread(run, ask, req)


def op_net_listen(agent: Agent, ask: C.NetListen, req: int) -> None:
    """The receiving end of the network check (agents/netcheck.py) for ``timeout`` seconds;
    answers with its port. A new one replaces the last."""
    held = agent.sockets
    if held.receiver is not None:
        held.receiver.close()
    held.receiver = netcheck.Receiver(bytes.fromhex(ask.token), ask.bytes, ask.timeout)
    agent.reply(P.NetListening(req, held.receiver.port))


def op_net_close(agent: Agent, ask: C.NetClose, req: None) -> None:
    held = agent.sockets
    if held.receiver is not None:
        held.receiver.close()
        held.receiver = None


def op_net_send(agent: Agent, ask: C.NetSend, req: int) -> None:
    """One link of the network check: ``bytes`` to a peer's receiver, timed."""
    def run() -> None:
        try:
            seconds = netcheck.send(ask.address, ask.port, bytes.fromhex(ask.token),
                                    ask.bytes, ask.timeout)
        except OSError as exc:
            agent.reply(P.NetSent(req, None, str(exc) or type(exc).__name__))
            return
        agent.reply(P.NetSent(req, seconds))

    agent.on_thread(run, ask, req)


# ---  hot spares (see agents/standby.py) ---------------------------------------------
def op_warm(agent: Agent, warm: C.Warm, req: None) -> None:
    """A spare node (it runs no worker): standbys, at once, for the workers a start like
    ``warm`` would run here, so that taking over a lost node's place is warm too."""
    if agent.workers:
        return  # a participant keeps its own standbys
    workdir = os.path.expanduser(warm.workdir or ".")
    base_env, _ = worker_env(warm, agent.token, agent.directory, agent.job_id, workdir)
    attempt_dir = os.path.join(agent.directory, f"attempt-{warm.attempt}-spare")
    imports = warm.warm.imports if warm.warm is not None else ()
    refills = []
    for given in warm.workers:
        spec = prepare(given, base_env, attempt_dir)
        refills.append((given.local_rank, list(spec.argv), spec.env, workdir, imports))
    agent.standbys.schedule(refills, 0.0)  # nothing of the job runs here to slow down


Handler = Callable[[Agent, Any, Any], None]

#: The controller's commands (agents/commands.py), one handler each; ``shutdown`` ends the
#: main loop, and the reader thread takes the session's own (ack, spool, ping).
OPS: dict[type[C.Command], Handler] = {
    C.Start: lambda agent, start, _req: agent.op_start(start),
    C.Warm: op_warm,
    C.ReplicateTo: lambda agent, buddy, _req: agent.checkpoints.replicate_to(buddy),
    C.Retain: lambda agent, keep, _req: agent.checkpoints.retain(keep),
    C.SaveAt: lambda agent, at, _req: agent.checkpoints.save_at(at),
    C.Release: lambda agent, _release, _req: agent.checkpoints.release(),
    C.Resumed: lambda agent, resumed, _req: agent.checkpoints.resumed(resumed),
    C.Stop: lambda agent, stop, _req: agent.op_stop(stop),
    C.FreePort: op_free_port, C.Listen: op_listen, C.Probe: op_probe,
    C.GetStacks: op_stacks, C.ReadTrace: op_read_trace, C.MissingBlobs: op_sync_missing,
    C.PutChunk: op_sync_put, C.BuildTree: op_sync_build, C.RunSetup: op_setup,
    C.CheckNode: op_node_check, C.NetListen: op_net_listen, C.NetSend: op_net_send,
    C.NetClose: op_net_close,
}
#: What the agent's door takes: the commands above, shutdown, and the session's.
_SESSION: tuple[type[C.Command], ...] = (C.Shutdown, C.Ack, C.Spool, C.Ping)
TAKEN: dict[str, type[C.Command]] = {c.OP: c for c in (*OPS, *_SESSION)}
