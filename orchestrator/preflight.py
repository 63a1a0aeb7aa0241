"""Preflight: can this job start? ``check`` talks to every node; ``quick_check`` is the cheap
part that ``submit`` runs before recording anything.

``check`` starts each node's agent (the real transport: SSH auth and host keys included),
asks for its versions and GPUs, has node 0 listen on the master port, and has every node
report the interface that routes to the master and whether it can open a TCP connection
to ``master_addr:master_port``. Nothing of the user's runs.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator import healthcheck, netcheck
from orchestrator.channel import Channel, R, ask
from orchestrator.errors import (
    AuthenticationError,
    HostKeyChanged,
    HostKeyError,
    LaunchError,
    OrchestratorError,
)
from orchestrator.loop import EventLoop
from orchestrator.nodepool import CONNECT_FANOUT
from orchestrator.plan import node_address, plan_attempt
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport import default_connect
from orchestrator.transport.base import ConnectionFactory, NodeConnection, attach_agent

AGENT_TIMEOUT = 15.0


@dataclass
class NodeReport:
    """What preflight learned about one node."""

    node_index: int
    host: str
    reachable: bool = False
    auth: bool | None = None
    host_key: str = "n/a"  # verified | unknown | changed | n/a (local)
    hostname: str | None = None
    python: str | None = None
    torch: str | None = None
    gpus: int | None = None
    interface: str | None = None
    master_port_reachable: bool | None = None
    unreachable_ports: list[int] = field(default_factory=list)
    health: list[str] = field(default_factory=list)  # health.node_check's problems, if asked
    health_tail: list[str] = field(default_factory=list)  # the check's last output lines
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.master_port_reachable is not False


@dataclass
class CheckReport:
    master_addr: str
    master_port: int | None
    nodes: list[NodeReport]
    warnings: list[str] = field(default_factory=list)
    controller_grace: float | None = None
    ports: list[int] = field(default_factory=list)  # every master port that was tested
    network: str | None = None  # the network check's summary, when the spec asks for it

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "master_addr": self.master_addr, "master_port": self.master_port,
                "controller_grace": self.controller_grace, "ports": self.ports,
                "network": self.network, "nodes": [asdict(n) for n in self.nodes],
                "warnings": self.warnings}


class _Session:
    """A short-lived agent for preflight (its own job id, shut down at the end)."""

    def __init__(self, conn: NodeConnection, node_index: int):
        secret = secrets.token_hex(16)
        hello, launched = attach_agent(conn, f"preflight-{secrets.token_hex(4)}", node_index,
                                       secret, launch=C.Launch(secret, controller_grace=60),
                                       timeout=AGENT_TIMEOUT)
        self.channel = Channel(node_index, conn, node_index, hello, launched)
        self.hello = hello

    def ask(self, request: C.Request[R], within: float = AGENT_TIMEOUT) -> R:
        reply = ask(self.channel, request, within)
        if reply is None or isinstance(reply, P.Failed):
            why = reply.error if isinstance(reply, P.Failed) else "did not answer"
            raise LaunchError(f"{self.channel.conn.host}: agent {why} ({request.OP})")
        return reply


class _Reader:
    """One thread that reads every session's channel (replies complete their requests)."""

    def __init__(self) -> None:
        self.loop = EventLoop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="preflight")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.loop.poll(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.loop.close()


def check(spec: JobSpec, *, connect: ConnectionFactory = default_connect,
          spec_dir: str = ".") -> CheckReport:
    """Reach every node and report; never raises for a node's fault (it is in the report).
    With ``health.node_check`` or ``health.min_free_bytes``, every node runs them too, as
    before an attempt (a synced job's tree is not there yet: they run in the home)."""
    reports = [NodeReport(i, n.host) for i, n in enumerate(spec.nodes)]
    sessions: dict[int, _Session] = {}
    report_network: str | None = None

    def open_one(i: int) -> None:
        node, report = spec.nodes[i], reports[i]
        conn = connect(node, spec)
        try:
            conn.open()
        except HostKeyError as exc:
            report.reachable, report.error = True, str(exc)
            report.host_key = "changed" if isinstance(exc, HostKeyChanged) else "unknown"
            return
        except AuthenticationError as exc:
            report.reachable, report.auth, report.error = True, False, str(exc)
            report.host_key = "verified"
            return
        except OrchestratorError as exc:
            report.error = str(exc)
            return
        report.reachable, report.auth = True, True
        report.host_key = "n/a" if node.is_local else "verified"
        try:
            session = _Session(conn, i)
        except OrchestratorError as exc:
            report.error = str(exc)
            conn.close()
            return
        reader.loop.call_later(0, lambda: reader.loop.watch(session.channel))
        hello = session.hello
        report.hostname, report.python, report.torch = hello.hostname, hello.python, hello.torch
        report.gpus = hello.gpus
        if spec.nproc_per_node == "gpu" and not report.gpus:
            report.error = f"nproc_per_node: gpu, but {node.host} has no GPU"
        sessions[i] = session

    reader = _Reader()
    with ThreadPoolExecutor(max_workers=min(CONNECT_FANOUT, len(spec.nodes))) as pool:
        list(pool.map(open_one, range(len(spec.nodes))))

    master = spec.nodes[0]
    master_addr = spec.rendezvous.master_addr or node_address(master)
    span = spec.rendezvous.port_range
    wanted = list(range(span[0], span[1] + 1)) if span else [0]
    master_port: int | None = None
    ports: list[int] = []
    busy: list[int] = []
    try:
        if 0 in sessions:
            try:
                listening = sessions[0].ask(C.Listen(ports=tuple(wanted)))
                ports, busy = list(listening.ports), list(listening.busy)
                if ports:
                    master_port = ports[0]
                else:
                    reports[0].error = (f"no free port in rendezvous.port "
                                        f"{spec.rendezvous.port}: {listening.error}")
            except OrchestratorError as exc:
                reports[0].error = str(exc)

        def probe(i: int) -> None:
            if not ports:
                return
            try:
                answer = sessions[i].ask(C.Probe(master_addr, tuple(ports),
                                                 3 if len(ports) == 1 else 1.5))
            except OrchestratorError as exc:
                reports[i].error = str(exc)
                return
            reports[i].interface = answer.interface
            reports[i].master_port_reachable = answer.reachable
            reports[i].unreachable_ports = list(answer.unreachable)
            if not answer.reachable:
                shown = ", ".join(map(str, reports[i].unreachable_ports[:10]))
                reports[i].error = (f"cannot reach {master_addr} on port(s) {shown}: "
                                    f"{answer.error}")

        def health(i: int) -> None:
            gpus = healthcheck.gpus_expected(spec.health, reports[i].gpus)
            if not spec.health.checks_nodes and gpus is None:
                return
            plan = plan_attempt(spec, "preflight", node_indices=[i], spec_dir=spec_dir).nodes[0]
            try:  # a synced job's tree is not there yet: the home instead of its workdir
                answer = sessions[i].ask(
                    healthcheck.check_command(spec, plan, gpus,
                                              "~" if spec.sync is not None else None),
                    spec.health.node_check_timeout + AGENT_TIMEOUT)
            except OrchestratorError as exc:
                reports[i].error = reports[i].error or str(exc)
                return
            if answer.problems:
                reports[i].health, reports[i].health_tail = list(answer.problems), \
                    list(answer.tail)
                reports[i].error = reports[i].error or healthcheck.verdict(answer.problems)

        with ThreadPoolExecutor(max_workers=min(CONNECT_FANOUT, len(spec.nodes))) as pool:
            list(pool.map(probe, sorted(sessions)))
            list(pool.map(health, sorted(sessions)))
        if spec.health.network_check is not None:
            report_network = _network(spec, sessions, reports)
        outside = _reachable_from_here(spec, master_addr, master_port)
    finally:
        for session in sessions.values():
            session.channel.send(C.Shutdown())
        deadline = time.monotonic() + 5.0  # until the agents have gone (channels closed)
        while time.monotonic() < deadline and not all(s.channel.closed
                                                      for s in sessions.values()):
            time.sleep(0.05)
        reader.close()
        for session in sessions.values():
            session.channel.conn.close()

    report = CheckReport(master_addr, master_port, reports,
                         controller_grace=spec.health.controller_grace, ports=ports,
                         network=report_network)
    if busy and ports:
        report.warnings.append(f"port(s) in use on node 0, not tested: "
                               f"{', '.join(map(str, busy[:20]))}")
    if outside:
        report.warnings.append(
            f"{master_addr}:{master_port} accepts connections from this machine, which is not "
            "one of the job's nodes: torch's rendezvous store has no authentication, so "
            "firewall the master port (range) to the nodes (see README, Network trust)")
    for key in ("torch", "python"):
        versions = {r.__dict__[key] for r in reports if r.reachable and r.auth}
        if len(versions) > 1:
            report.warnings.append(f"{key} versions differ between nodes: "
                                   f"{', '.join(sorted(str(v) for v in versions))}")
    if any(r.auth and r.torch is None for r in reports):
        report.warnings.append("torch not found by the agent's python on some node(s) "
                               "(the workers' python may differ)")
    return report


def _network(spec: JobSpec, sessions: dict[int, _Session], reports: list[NodeReport]) -> str:
    """The pairwise network check among the nodes that passed so far (orchestrator/netcheck.py);
    an unhealthy node's report says why. Returns the summary line."""
    assert spec.health.network_check is not None
    passed = [i for i in sorted(sessions) if reports[i].error is None]
    unhealthy, summary = netcheck.run(  # the reader thread completes the replies
        [sessions[i].channel for i in passed], [node_address(spec.nodes[i]) for i in passed],
        [f"node {i} ({spec.nodes[i].host})" for i in passed], spec.health.network_check, None)
    for position, problem in unhealthy.items():
        report = reports[passed[position]]
        report.health.append(problem)
        report.error = report.error or healthcheck.verdict([problem])
    return summary


def _reachable_from_here(spec: JobSpec, address: str, port: int | None) -> bool:
    """Can this machine (when it is not a node) open the master port? Then so can others
    outside the node list, most likely."""
    if port is None or any(n.is_local for n in spec.nodes):
        return False
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def quick_check(spec: JobSpec) -> None:
    """The cheap part of preflight, run by ``submit``: every SSH node resolves, accepts TCP
    on its SSH port within connect_timeout, has a known host key (unless accept-new), and
    its identity file exists. Raises LaunchError naming the first bad host."""
    remote = [n for n in spec.nodes if not n.is_local]
    if not remote:
        return
    from orchestrator.transport.ssh import known_host_names, resolve_target

    def one(node: NodeSpec) -> str | None:
        target = resolve_target(node, spec)
        where = f"{target['hostname']}:{target['port']}"
        key = target["key_filename"]
        if key and not os.path.exists(key):
            return f"{node.host}: identity file {key} does not exist"
        try:
            with socket.create_connection((target["hostname"], target["port"]),
                                          timeout=spec.ssh.connect_timeout):
                pass
        except TimeoutError:
            return f"{node.host}: cannot connect to {where}: timed out after " \
                   f"{spec.ssh.connect_timeout:g}s"
        except OSError as exc:
            return f"{node.host}: cannot connect to {where}: {exc.strerror or exc}"
        if spec.ssh.host_key_policy == "reject":
            if not known_host_names(spec, target["hostname"], target["port"]):
                return (f"{node.host}: host key for {where} is not in known_hosts "
                        "(add it, or set ssh.host_key_policy: accept-new)")
        return None

    with ThreadPoolExecutor(max_workers=min(CONNECT_FANOUT, len(remote))) as pool:
        problems = [p for p in pool.map(one, remote) if p]
    if problems:
        raise LaunchError(problems[0] + (f" (and {len(problems) - 1} more)"
                                         if len(problems) > 1 else ""))
