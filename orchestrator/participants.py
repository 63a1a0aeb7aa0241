"""Who runs the next attempt, and how: the nodes in their places (a spare in a failed one's),
the master port on node 0, and the workers per node. The controller asks; the health checks
and quarantine (orchestrator/healthcheck.py) have left out whom they must before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents import commands as C
from agents import protocol as P
from orchestrator.attempt import Attempt, Failure
from orchestrator.spec import JobSpec
from orchestrator.state import FailureCause

if TYPE_CHECKING:
    from orchestrator.engine import Engine
    from orchestrator.nodebook import Node


def pick_port(engine: Engine, spec: JobSpec, node: Node) -> int | None | Failure:
    """A master port that node 0 can bind now (the spec's own, if it fixed one), None when a
    stop reason came meanwhile, or a Failure when node 0 did not answer or has none."""
    wanted, span = spec.rendezvous.port, spec.rendezvous.port_range
    if span is not None and span[0] == span[1]:
        return span[0]  # a range of one port is that port
    request = C.FreePort(range=span) if span is not None else \
        C.FreePort(wanted if isinstance(wanted, int) else 0)
    for _ in range(1 if span is not None else 5):
        channel = node.channel
        reply = None if channel is None else engine.ask_all(
            {0: channel}, request, spec.launch_timeout)[0]
        if engine.stop is not None:
            return None
        if not isinstance(reply, P.PortReply):  # node 0 went away: a node failure
            return Failure(FailureCause.NODE_FAIL, f"{node.host}: no answer while picking "
                           "the master port", node_index=node.index, host=node.host)
        if reply.ok:
            return reply.port
        if span is not None:
            return Failure(FailureCause.LAUNCH_FAILED, f"no free port in rendezvous.port "
                           f"{wanted} on {node.host}", node_index=node.index, host=node.host)
        if isinstance(wanted, int):
            return Failure(FailureCause.LAUNCH_FAILED, f"rendezvous.port {wanted} is in "
                           f"use on {node.host}", node_index=node.index, host=node.host)
    return Failure(FailureCause.LAUNCH_FAILED, f"{node.host}: could not find a free port")


@dataclass(frozen=True)
class Placed:
    """An attempt that ended before this controller took over, as ``choose_participants``
    needs it: its nodes in node-rank order and its failure (from the store)."""

    participants: list[int]
    failure: Failure | None


def choose_participants(healthy: list[Node], last: Attempt | Placed | None,
                        most: int) -> list[Node]:
    """The first ``most`` healthy nodes, or, with spares (more healthy nodes than ``most``)
    after an attempt: its nodes in their places, but a spare in the place of the node its
    failure names (lost, or the failing rank's), which, back, is a spare; nobody else moves."""
    if last is None or len(healthy) <= most:
        return healthy[:most]
    by_index = {n.index: n for n in healthy}
    failed = last.failure.node_index if last.failure else None
    spares = [n for n in healthy if n.index not in last.participants and n.index != failed]
    spares += [by_index[failed]] if failed in by_index else []  # its own place, at worst
    chosen = []
    for index in last.participants:  # in node-rank order
        if index in by_index and index != failed:
            chosen.append(by_index[index])
        elif spares:
            chosen.append(spares.pop(0))
    return (chosen + spares)[:most]


def workers_per_node(spec: JobSpec, participants: list[Node]) -> dict[int, int] | Failure:
    """Workers per node for ``nproc_per_node: gpu|auto``, from what each agent reported."""
    mode = spec.nproc_per_node
    counts = {}
    for node in participants:
        if node.spec.slots or isinstance(mode, int):
            counts[node.index] = node.spec.slots or int(mode)
            continue
        gpus = node.info.gpus or 0
        if mode == "gpu" and gpus == 0:
            return Failure(FailureCause.LAUNCH_FAILED, f"nproc_per_node: gpu, but "
                           f"{node.host} has no GPU (use a number, or auto)",
                           node_index=node.index, host=node.host)
        counts[node.index] = gpus or 1
    return counts
