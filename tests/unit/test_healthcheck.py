"""A node's health verdict is data (``NodeInfo.health_problems``), not a prefix read back
from its error: a node that passes again loses the verdict, and no other error; ``check``
shows the same one line."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator import healthcheck, preflight
from orchestrator.nodebook import Node, NodeInfo
from orchestrator.preflight import NodeReport
from orchestrator.spec import NodeSpec, parse_jobspec


class Book:
    def __init__(self) -> None:
        self.noted: list[int] = []

    def note(self, node: Node, info: NodeInfo) -> None:
        node.info = info
        self.noted.append(node.index)


def leave_out(monkeypatch, nodes: list[Node], problems: dict[int, list[str]]) -> Book:
    monkeypatch.setattr(healthcheck, "check_nodes", lambda engine, checked: {
        n.index: (list(problems.get(n.index, [])), ()) for n in checked})
    monkeypatch.setattr(healthcheck.reputation, "record", lambda *args, **kwargs: None)
    book = Book()
    engine = SimpleNamespace(book=book, store=None, job_id="j-1",
                             spec=SimpleNamespace(min_nodes=1))
    healthcheck.leave_out_unhealthy(engine, nodes)  # type: ignore[arg-type]
    return book


def test_a_node_healthy_again_loses_the_verdict_and_no_other_error(monkeypatch):
    # A host named "unhealthy": its own errors begin like a verdict, and are not one.
    theirs = Node(0, NodeSpec(host="unhealthy"),
                  info=NodeInfo(error="unhealthy: agent did not answer within 5s"))
    verdict = Node(1, NodeSpec(host="b"), info=NodeInfo(
        error="unhealthy: health.node_check failed (exit code 4)",
        health_problems=["health.node_check failed (exit code 4)"]))
    sick = Node(2, NodeSpec(host="c"))
    book = leave_out(monkeypatch, [theirs, verdict, sick], {2: ["disk full", "no GPU"]})
    assert theirs.info.error == "unhealthy: agent did not answer within 5s"
    assert verdict.info.error is None and verdict.info.health_problems is None
    assert sick.info.error == "unhealthy: disk full; no GPU"
    assert sick.info.health_problems == ["disk full", "no GPU"]
    assert book.noted == [1, 2]
    # The same verdict again is no news: nothing is written.
    assert leave_out(monkeypatch, [sick], {2: ["disk full", "no GPU"]}).noted == []
    # A node that passed keeps a verdict kept in the store (a list from JSON) as data too.
    stored = Node(3, NodeSpec(host="d"), info=NodeInfo.from_dict(sick.info.to_dict()))
    assert stored.info.health_problems == ["disk full", "no GPU"]
    leave_out(monkeypatch, [stored], {})
    assert stored.info.error is None


def test_check_shows_the_network_checks_verdict_in_one_line(monkeypatch):
    spec = parse_jobspec("nodes: [{host: local}, {host: local}]\ncommand: [python, t.py]\n"
                         "health: {network_check: true}\n")
    reports = [NodeReport(0, "local"), NodeReport(1, "local", error="cannot reach it")]
    monkeypatch.setattr(preflight.netcheck, "run", lambda *args: (
        {0: "network check: every link of this node is slow"}, "network check: summary"))
    bringup = SimpleNamespace(channels=lambda indices: {}, wait=None)
    assert preflight._network(spec, bringup, [0, 1], reports) == "network check: summary"  # type: ignore[arg-type]
    assert reports[0].error == "unhealthy: network check: every link of this node is slow"
    assert reports[0].health == ["network check: every link of this node is slow"]
    assert reports[1].error == "cannot reach it" and reports[1].health == []



def test_check_reports_a_node_it_could_not_bring_up_by_the_errors_type():
    """check brings agents up through the node pool: what stopped a node arrives as the
    exception its connect raised, and the report says how far it got by that type."""
    from orchestrator import events as E
    from orchestrator.errors import (
        AgentError,
        AuthenticationError,
        ConnectError,
        HostKeyChanged,
        HostKeyUnknown,
    )

    spec = parse_jobspec("nodes: [{host: a}]\ncommand: [python, t.py]\n")
    node = Node(0, spec.nodes[0])
    seen = {}
    for cause in (ConnectError("a", "timed out"), AuthenticationError("a", "denied"),
                  HostKeyUnknown("a", "not known"), HostKeyChanged("a", "changed!"),
                  AgentError("a", "the agent did not start")):
        report = NodeReport(0, "a")
        preflight._connected(spec, node, E.Unavailable(0, str(cause), cause=cause), report)
        assert report.error == str(cause) and not report.ok
        seen[type(cause).__name__] = (report.reachable, report.auth, report.host_key)
    assert seen == {"ConnectError": (False, None, "n/a"),
                    "AuthenticationError": (True, False, "verified"),
                    "HostKeyUnknown": (True, None, "unknown"),
                    "HostKeyChanged": (True, None, "changed"),
                    "AgentError": (True, True, "verified")}
