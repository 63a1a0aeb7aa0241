"""The agent's commands, one handler each (``OPS``): ports and reachability (a run's master
port, and ``check``), stacks and flight recorder dumps (orchestrator/hang.py), code and setup
(orchestrator/prepare.py). Starting and stopping workers are the agent's own
(``Agent.op_start``, ``Agent.op_stop``). A handler that raises is answered ``failed``."""

from __future__ import annotations

import base64
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agents import cache, gpucheck, netcheck, setup, stacks
from agents import protocol as P
from agents.netinfo import free_port, interface_for
from agents.paths import traces
from agents.workers import prepare, worker_env

if TYPE_CHECKING:
    from agents.agent import Agent


# --- ports and reachability (run and preflight) ------------------------------------
def op_free_port(agent: Agent, msg: dict[str, Any]) -> None:
    """A port free now: ``port`` (0: any), or the first free one of ``range`` [lo, hi]."""
    low, high = (int(x) for x in (msg.get("range") or (msg.get("port", 0),) * 2))
    # From a random place in the range: jobs launching together on one master should
    # not all take its first port.
    start = secrets.randbelow(high - low + 1) if high > low else 0
    for i in range(high - low + 1):
        port, ok = free_port(low + (start + i) % (high - low + 1))
        if ok:
            break
    agent.reply(msg, P.PORT, port=port, ok=ok)


def op_listen(agent: Agent, msg: dict[str, Any]) -> None:
    """Hold listening sockets on ``port`` (0: any), or on every free port of ``ports``,
    so that peers can test that they reach them (preflight)."""
    for s in agent.preflight_listeners:
        s.close()
    agent.preflight_listeners = []
    wanted = msg.get("ports") or [msg.get("port", 0)]
    busy, error = [], None
    for port in wanted:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
            s.listen(64)
        except OSError as exc:
            s.close()
            busy.append(port)
            error = str(exc)
            continue
        agent.preflight_listeners.append(s)
    ports = [s.getsockname()[1] for s in agent.preflight_listeners]
    agent.reply(msg, P.LISTENING, port=ports[0] if ports else msg.get("port"),
                ports=ports, busy=busy, ok=bool(ports), error=error)


def op_probe(agent: Agent, msg: dict[str, Any]) -> None:
    """Report the interface toward ``address`` and whether ``address:port`` (or each of
    ``ports``) accepts TCP."""
    address = str(msg["address"])
    ports = [int(p) for p in (msg.get("ports") or [msg["port"]])]
    timeout = float(msg.get("timeout", 3))
    errors: dict[int, str] = {}

    def one(port: int) -> None:
        try:
            with socket.create_connection((address, port), timeout=timeout):
                pass
        except OSError as exc:
            errors[port] = str(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.reply(msg, P.PROBE_RESULT, interface=interface_for(address),
                reachable=not errors, unreachable=sorted(errors),
                error=next(iter(errors.values()), None))


# ---  stacks and flight recorder (see orchestrator/hang.py) -------------------------
def op_stacks(agent: Agent, msg: dict[str, Any]) -> None:
    """Each live rank's Python stack: py-spy (needs ptrace), else the faulthandler hook
    every worker registered at start. On a thread: py-spy takes its time."""
    agent.on_thread(lambda m: _stacks(agent, m), msg)


def _stacks(agent: Agent, msg: dict[str, Any]) -> None:
    targets = stacks.rank_pids(list(agent.workers), agent.token)
    wanted = bool(msg.get("flight_recorder")) and bool(targets)
    found: dict[str, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda r=r, p=p: found.__setitem__(
        str(r), stacks.one_stack(p, r, agent.directory, agent.attempt))) for r, p in targets]
    for t in threads:
        t.start()
    # One deadline for both, inside the controller's: a late reply is a lost one.
    deadline = time.monotonic() + float(msg.get("timeout", 15))
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    dumps = {}
    if wanted:
        # After the stacks: a rank's first dump imports parts of torch (a second or more
        # of CPU), which would show in them. Each rank's sampler looks for this file ten
        # times a second.
        asked_at = time.time()
        stack_dir = os.path.join(agent.directory, f"attempt-{agent.attempt}")
        with open(os.path.join(stack_dir, "flight-recorder-wanted"), "w"):
            pass
        dumps = stacks.trace_files(agent.traces_dir or "", stack_dir,
                                   [r for r, _ in targets], asked_at, deadline)
    agent.reply(msg, P.STACKS, stacks=found, traces=dumps)


def op_read_trace(agent: Agent, msg: dict[str, Any]) -> None:
    """A piece (up to 1 MiB, base64) of a flight recorder dump under this user's traces
    directory; nothing else is readable this way."""
    root = os.path.realpath(traces()) + os.sep
    path = os.path.realpath(str(msg.get("path")))
    if not path.startswith(root):
        raise PermissionError(f"not a flight recorder dump: {msg.get('path')!r}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(int(msg.get("offset") or 0))
        data = f.read(1024 * 1024)
    agent.reply(msg, P.TRACE_CHUNK, data=base64.b64encode(data).decode(), size=size)


# ---  code and setup on the node (see orchestrator/prepare.py) ----------------------
def op_sync_missing(agent: Agent, msg: dict[str, Any]) -> None:
    agent.aside(lambda m: agent.reply(m, P.SYNC_MISSING,
                                     missing=cache.missing_blobs(list(m.get("blobs", [])))),
               msg)


def op_sync_put(agent: Agent, msg: dict[str, Any]) -> None:
    def put(m: dict[str, Any]) -> None:
        error = cache.put_chunk(str(m["sha"]), int(m["offset"]), m["data"],
                                bool(m.get("last")), m.get("part", 0))
        agent.reply(m, P.SYNC_PUT, ok=error is None,
                    **({"error": error} if error else {}))

    agent.aside(put, msg)


def op_sync_build(agent: Agent, msg: dict[str, Any]) -> None:
    agent.aside(lambda m: agent.reply(m, P.SYNC_BUILT, path=cache.build_tree(
        str(m["tree"]), m["files"], int(m.get("keep", 5)))), msg)


def op_setup(agent: Agent, msg: dict[str, Any]) -> None:
    """Run the job's setup script once per key on this machine (skipped when that key
    succeeded before); its output streams as ``setup_output`` while it runs."""
    def run(m: dict[str, Any]) -> None:
        timeout = m.get("timeout")
        done = setup.run_setup(
            str(m["key"]), str(m["script"]), str(m.get("workdir") or "."),
            dict(m.get("env") or {}), agent.token,
            lambda lines: agent.outbox.put_live(P.SETUP_OUTPUT, lines), P.MAX_LINE,
            agent.directory, None if timeout is None else float(timeout))
        agent.reply(m, P.SETUP_DONE, exit_code=done.exit_code, cached=done.cached,
                    tail=list(done.tail), timed_out=done.timed_out)

    agent.on_thread(run, msg)


def op_node_check(agent: Agent, msg: dict[str, Any]) -> None:
    """The health check before an attempt (agents/setup.py: run_check)."""
    def run(m: dict[str, Any]) -> None:
        free, gpus = m.get("min_free_bytes"), m.get("gpus")
        problems, tail = setup.run_check(
            [str(a) for a in m.get("argv") or ()], str(m.get("workdir") or "."),
            {str(k): str(v) for k, v in (m.get("env") or {}).items()}, agent.token, P.MAX_LINE,
            float(m["timeout"]), None if free is None else int(free))
        if m.get("gpu_check"):
            problems += gpucheck.check(None if gpus is None else int(gpus),
                                       float(m["timeout"]))
        agent.reply(m, P.CHECKED, problems=problems, tail=list(tail))

    agent.on_thread(run, msg)


def op_net_listen(agent: Agent, msg: dict[str, Any]) -> None:
    """The receiving end of the network check (agents/netcheck.py) for ``timeout`` seconds;
    answers with its port. A new one replaces the last."""
    if agent.net_receiver is not None:
        agent.net_receiver.close()
    agent.net_receiver = netcheck.Receiver(bytes.fromhex(str(msg["token"])), int(msg["bytes"]),
                                           float(msg["timeout"]))
    agent.reply(msg, P.NET_LISTENING, port=agent.net_receiver.port)


def op_net_close(agent: Agent, msg: dict[str, Any]) -> None:
    if agent.net_receiver is not None:
        agent.net_receiver.close()
        agent.net_receiver = None


def op_net_send(agent: Agent, msg: dict[str, Any]) -> None:
    """One link of the network check: ``bytes`` to a peer's receiver, timed."""
    def run(m: dict[str, Any]) -> None:
        try:
            seconds = netcheck.send(str(m["address"]), int(m["port"]),
                                    bytes.fromhex(str(m["token"])), int(m["bytes"]),
                                    float(m["timeout"]))
        except OSError as exc:
            agent.reply(m, P.NET_SENT, error=str(exc) or type(exc).__name__)
            return
        agent.reply(m, P.NET_SENT, seconds=seconds)

    agent.on_thread(run, msg)


# ---  hot spares (see agents/standby.py) ---------------------------------------------
def op_warm(agent: Agent, msg: dict[str, Any]) -> None:
    """A spare node (it runs no worker): standbys, at once, for the workers a start like
    ``msg`` would run here, so that taking over a lost node's place is warm too."""
    if agent.workers:
        return  # a participant keeps its own standbys
    workdir = os.path.expanduser(msg.get("workdir") or ".")
    base_env, _ = worker_env(msg, agent.token, agent.directory, agent.job_id, workdir)
    attempt_dir = os.path.join(agent.directory, f"attempt-{int(msg['attempt'])}-spare")
    imports = tuple(str(m) for m in (msg.get("warm") or {}).get("imports") or ())
    refills = []
    for given in msg["workers"]:
        spec = prepare(given, base_env, attempt_dir)
        refills.append((int(given.get("local_rank") or 0), list(spec["argv"]), spec["env"],
                        workdir, imports))
    agent.standbys.schedule(refills, 0.0)  # nothing of the job runs here to slow down


#: The controller's commands (protocol.py), one handler each; shutdown ends the main loop.
OPS: dict[str, Callable[[Agent, dict[str, Any]], None]] = {
    P.START: lambda agent, msg: agent.op_start(msg),
    P.WARM: op_warm,
    P.STOP: lambda agent, msg: agent.op_stop(msg),
    P.FREE_PORT: op_free_port, P.LISTEN: op_listen, P.PROBE: op_probe,
    P.STACKS_OP: op_stacks, P.READ_TRACE: op_read_trace, P.SYNC_MISSING: op_sync_missing,
    P.SYNC_PUT: op_sync_put, P.SYNC_BUILD: op_sync_build, P.SETUP: op_setup,
    P.NODE_CHECK: op_node_check, P.NET_LISTEN: op_net_listen, P.NET_SEND: op_net_send,
    P.NET_CLOSE: op_net_close,
}
