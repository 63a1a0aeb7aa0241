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
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator import events as E
from orchestrator import healthcheck, netcheck
from orchestrator.channel import Channel, R, ask_each
from orchestrator.errors import (
    AgentError,
    AuthenticationError,
    HostKeyChanged,
    HostKeyError,
    LaunchError,
)
from orchestrator.loop import EventLoop
from orchestrator.nodebook import Node
from orchestrator.nodepool import CONNECT_FANOUT, NodePool
from orchestrator.plan import node_address, plan_attempt
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport import default_connect
from orchestrator.transport.base import ConnectionFactory

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
    containment: str | None = None  # what keeps its workers' descendants (agents/containment)
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


class _Bringup:
    """The job's own way to bring agents up, for a check: the node pool (its connects, the
    handshake, the launch), channels read by one event loop, and requests whose replies
    arrive while ``wait`` turns that loop. The agents belong to a job id of their own and
    are shut down at the end."""

    def __init__(self, spec: JobSpec, connect: ConnectionFactory):
        # An agent of a check whose controller vanished stops after a minute, whatever the
        # job's own controller_grace.
        spec = spec.model_copy(update={"health": spec.health.model_copy(
            update={"controller_grace": 60.0})})
        self.loop = EventLoop()
        self.pool = NodePool(f"preflight-{secrets.token_hex(4)}", spec, secrets.token_hex(16),
                             connect, self.loop)
        self.nodes = [Node(i, n) for i, n in enumerate(spec.nodes)]
        self.failed: dict[int, E.Unavailable] = {}

    def up(self) -> None:
        """Start every node's agent and wait for each outcome."""
        for node in self.nodes:
            self.pool.connect(node, launch=True)
        self.wait(lambda: not any(n.connecting for n in self.nodes), None)

    def wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Turn the loop until ``done()`` (True) or ``timeout`` seconds (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            for event in self.loop.poll(0.05 if left is None else min(0.05, left)):
                match event:
                    case E.Attached(index, channel):
                        self.pool.settled(self.nodes[index])
                        self.pool.adopt(self.nodes[index], channel)
                    case E.Unavailable():
                        self.pool.settled(self.nodes[event.node])
                        self.failed[event.node] = event
                    case E.Closed(channel) | E.Rejected(channel, _):
                        node = self.nodes[channel.node_index]
                        if node.channel is channel:
                            self.pool.drop_channel(node)
        return True

    def channels(self, indices: Iterable[int]) -> dict[int, Channel]:
        return {i: c for i in indices if (c := self.nodes[i].channel) is not None}

    def ask(self, requests: Mapping[int, C.Request[R]], within: float = AGENT_TIMEOUT
            ) -> dict[int, R | LaunchError]:
        """Every request at once; each node's reply, or the error that names it."""
        channels = self.channels(requests)
        replies = ask_each({i: (channels[i], requests[i]) for i in channels}, within,
                           self.wait)
        out: dict[int, R | LaunchError] = {}
        for i, request in requests.items():
            reply = replies.get(i)
            if reply is None or isinstance(reply, P.Failed):
                why = reply.error if isinstance(reply, P.Failed) else "did not answer"
                out[i] = LaunchError(f"{self.nodes[i].host}: agent {why} ({request.OP})")
            else:
                out[i] = reply
        return out

    def down(self) -> None:
        """Shut every agent down, wait (up to 5 s) for their channels to close, let go."""
        attached = [n for n in self.nodes if n.channel is not None]
        for node in attached:
            self.pool.send(node, C.Shutdown())
        self.wait(lambda: all(n.channel is None for n in attached), 5.0)
        for node in attached:
            self.pool.drop_channel(node)
        self.pool.close()
        self.loop.close()


def check(spec: JobSpec, *, connect: ConnectionFactory = default_connect,
          spec_dir: str = ".") -> CheckReport:
    """Reach every node and report; never raises for a node's fault (it is in the report).
    With ``health.node_check`` or ``health.min_free_bytes``, every node runs them too, as
    before an attempt (a synced job's tree is not there yet: they run in the home)."""
    reports = [NodeReport(i, n.host) for i, n in enumerate(spec.nodes)]
    report_network: str | None = None
    bringup = _Bringup(spec, connect)
    try:
        bringup.up()
        for node in bringup.nodes:
            _connected(spec, node, bringup.failed.get(node.index), reports[node.index])
        up = sorted(bringup.channels(range(len(spec.nodes))))
        master = spec.nodes[0]
        master_addr = spec.rendezvous.master_addr or node_address(master)
        span = spec.rendezvous.port_range
        wanted = list(range(span[0], span[1] + 1)) if span else [0]
        master_port: int | None = None
        ports: list[int] = []
        busy: list[int] = []
        if 0 in up:
            listening = bringup.ask({0: C.Listen(ports=tuple(wanted))})[0]
            if isinstance(listening, LaunchError):
                reports[0].error = str(listening)
            else:
                ports, busy = list(listening.ports), list(listening.busy)
                if ports:
                    master_port = ports[0]
                else:
                    reports[0].error = (f"no free port in rendezvous.port "
                                        f"{spec.rendezvous.port}: {listening.error}")
        if ports:
            probe = C.Probe(master_addr, tuple(ports), 3 if len(ports) == 1 else 1.5)
            for i, answer in bringup.ask({i: probe for i in up}).items():
                if isinstance(answer, LaunchError):
                    reports[i].error = str(answer)
                    continue
                reports[i].interface = answer.interface
                reports[i].master_port_reachable = answer.reachable
                reports[i].unreachable_ports = list(answer.unreachable)
                if not answer.reachable:
                    shown = ", ".join(map(str, reports[i].unreachable_ports[:10]))
                    reports[i].error = (f"cannot reach {master_addr} on port(s) {shown}: "
                                        f"{answer.error}")
        _health(spec, spec_dir, bringup, up, reports)
        if spec.health.network_check is not None:
            report_network = _network(spec, bringup, up, reports)
        outside = _reachable_from_here(spec, master_addr, master_port)
    finally:
        bringup.down()

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
            "firewall the master port (range) to the nodes (see docs/guides/security.md, "
            "'Other hosts on the network')")
    for key in ("torch", "python"):
        versions = {r.__dict__[key] for r in reports if r.reachable and r.auth}
        if len(versions) > 1:
            report.warnings.append(f"{key} versions differ between nodes: "
                                   f"{', '.join(sorted(str(v) for v in versions))}")
    if any(r.auth and r.torch is None for r in reports):
        report.warnings.append("torch not found by the agent's python on some node(s) "
                               "(the workers' python may differ)")
    return report


def _connected(spec: JobSpec, node: Node, failed: E.Unavailable | None,
               report: NodeReport) -> None:
    """What the connect said of a node: reachable, authenticated, its host key, its agent's
    versions and GPUs, or the error that stopped it (by its type)."""
    local = node.spec.is_local
    channel = node.channel
    if channel is None:
        cause = failed.cause if failed is not None else None
        report.error = failed.error if failed is not None else f"{node.host}: not reached"
        if isinstance(cause, HostKeyError):
            report.reachable = True
            report.host_key = "changed" if isinstance(cause, HostKeyChanged) else "unknown"
        elif isinstance(cause, AuthenticationError):
            report.reachable, report.auth, report.host_key = True, False, "verified"
        elif isinstance(cause, AgentError):  # the login worked; the agent did not
            report.reachable, report.auth = True, True
            report.host_key = "n/a" if local else "verified"
        return
    report.reachable, report.auth = True, True
    report.host_key = "n/a" if local else "verified"
    hello = channel.hello
    report.hostname, report.python, report.torch = hello.hostname, hello.python, hello.torch
    report.gpus = hello.gpus
    report.containment = hello.containment
    if spec.nproc_per_node == "gpu" and not report.gpus:
        report.error = f"nproc_per_node: gpu, but {node.host} has no GPU"


def _health(spec: JobSpec, spec_dir: str, bringup: _Bringup, up: list[int],
            reports: list[NodeReport]) -> None:
    """Each node's health checks, as before an attempt, all at once."""
    asked = {}
    for i in up:
        gpus = healthcheck.gpus_expected(spec.health, reports[i].gpus)
        if not spec.health.checks_nodes and gpus is None:
            continue
        plan = plan_attempt(spec, "preflight", node_indices=[i], spec_dir=spec_dir).nodes[0]
        # A synced job's tree is not there yet: the home instead of its workdir.
        asked[i] = healthcheck.check_command(spec, plan, gpus,
                                             "~" if spec.sync is not None else None)
    answers = bringup.ask(asked, spec.health.node_check_timeout + AGENT_TIMEOUT)
    for i, answer in answers.items():
        if isinstance(answer, LaunchError):
            reports[i].error = reports[i].error or str(answer)
        elif answer.problems:
            reports[i].health, reports[i].health_tail = list(answer.problems), \
                list(answer.tail)
            reports[i].error = reports[i].error or healthcheck.verdict(answer.problems)


def _network(spec: JobSpec, bringup: _Bringup, up: list[int],
             reports: list[NodeReport]) -> str:
    """The pairwise network check among the nodes that passed so far (orchestrator/netcheck.py);
    an unhealthy node's report says why. Returns the summary line."""
    assert spec.health.network_check is not None
    passed = [i for i in up if reports[i].error is None]
    channels = bringup.channels(passed)
    unhealthy, summary = netcheck.run(
        [channels.get(i) for i in passed], [node_address(spec.nodes[i]) for i in passed],
        [f"node {i} ({spec.nodes[i].host})" for i in passed], spec.health.network_check,
        bringup.wait)
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
    from orchestrator.transport.hosts import known_host_names, resolve_target

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
