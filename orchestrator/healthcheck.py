"""Node health checks before each attempt: every participant-to-be runs the job's
``health.node_check`` command, the free-space check (agents/setup.py: run_check) and, on a
node with GPUs, the GPU check (agents/gpucheck.py) at once, bounded by
``health.node_check_timeout``; then the nodes that passed run the pairwise network check
(orchestrator/netcheck.py) where the spec asks for it. The controller leaves unhealthy nodes
out where ``nnodes`` MIN allows (orchestrator/controller.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from agents import commands as C
from agents import protocol as P
from orchestrator import netcheck, reputation
from orchestrator.attempt import Failure
from orchestrator.channel import Channel, ask_each
from orchestrator.plan import node_address, plan_attempt
from orchestrator.state import FailureCause

if TYPE_CHECKING:
    from orchestrator.engine import Engine
    from orchestrator.nodebook import Node
    from orchestrator.plan import NodePlan
    from orchestrator.spec import JobSpec
    from orchestrator.specparts import HealthSpec

log = logging.getLogger("orchestrator.controller")

ANSWER_MARGIN = 15.0  # seconds past node_check_timeout before a silent agent counts as failed


def gpus_expected(health: HealthSpec, counted: int | None) -> int | None:
    """The GPUs a node whose agent counted ``counted`` must show, or None: no GPU check
    there (a CPU node, or off)."""
    if not health.gpu_check:
        return None
    return health.gpus_per_node or counted or None


def verdict(problems: Sequence[str]) -> str:
    """A node's error once it failed its health checks, as ``status`` and ``check`` show it:
    ``unhealthy: PROBLEM; PROBLEM``."""
    return f"unhealthy: {'; '.join(problems)}"


def check_command(spec: JobSpec, node: NodePlan, gpus: int | None,
                  workdir: str | None = None) -> C.CheckNode:
    """The ``node_check`` request for a node (``workdir``: instead of the plan's)."""
    health = spec.health
    return C.CheckNode(tuple(health.node_check), workdir or node.workdir,
                       {k: node.env[k] for k in spec.env if k in node.env},
                       health.node_check_timeout, health.min_free_bytes, gpus is not None, gpus)


def wanted(engine: Engine, nodes: list[Node]) -> bool:
    """Whether these nodes have anything to check before an attempt."""
    health = engine.spec.health
    return (health.checks_nodes or (health.network_check is not None and len(nodes) > 1)
            or any(gpus_expected(health, n.info.gpus) for n in nodes))


def check_nodes(engine: Engine, nodes: list[Node]
                ) -> dict[int, tuple[list[str], tuple[str, ...]]]:
    """node index -> (problems, the check's last output lines) for each of ``nodes``; no
    problems: healthy. Turns the controller's loop while the checks run."""
    spec, health = engine.spec, engine.spec.health
    tree = engine.preparer.tree().tree if spec.sync is not None else None
    asked: dict[int, tuple[Channel, C.CheckNode]] = {}
    for node in nodes:
        gpus = gpus_expected(health, node.info.gpus)
        if not health.checks_nodes and gpus is None:
            continue
        assert node.channel is not None
        plan = plan_attempt(spec, engine.job_id, node_indices=[node.index],
                            spec_dir=engine.preparer.spec_dir, sync_tree=tree).nodes[0]
        asked[node.index] = (node.channel, check_command(spec, plan, gpus))
    within = health.node_check_timeout + ANSWER_MARGIN
    replies = ask_each(asked, within, engine.wait)  # a cancel comes first
    out: dict[int, tuple[list[str], tuple[str, ...]]] = {n.index: ([], ()) for n in nodes}
    for index, reply in replies.items():
        if isinstance(reply, P.Checked):
            out[index] = (list(reply.problems), reply.tail)
        elif isinstance(reply, P.Failed):
            out[index] = ([f"health check: {reply.error}"], ())
        elif asked[index][0].closed:
            out[index] = (["its channel ended during the health check"], ())
        else:
            out[index] = ([f"no answer to the health check within {within:g}s"], ())
    passed = [n for n in nodes if not out[n.index][0]]
    if health.network_check is not None and len(passed) > 1:
        unhealthy, summary = netcheck.run(
            [n.channel for n in passed], [node_address(n.spec) for n in passed],
            [f"node {n.index} ({n.host})" for n in passed], health.network_check, engine.wait,
            lambda: engine.stop is not None)
        log.info("%s", summary)
        for position, problem in unhealthy.items():
            out[passed[position].index][0].append(problem)
    return out


def leave_out_unhealthy(engine: Engine, healthy: list[Node]) -> list[Node] | Failure:
    """The nodes that pass their health check. Unhealthy ones are left out where nnodes MIN
    allows, and count against their host across jobs, unless every node failed: a check
    that fails everywhere says more about the check or the network than about any node;
    where MIN does not allow it, the job fails at once, naming the first and its check."""
    results = check_nodes(engine, healthy)
    bad = [n for n in healthy if results[n.index][0]]
    blame = len(bad) < len(healthy)
    for node in healthy:
        problems, _ = results[node.index]
        if problems and verdict(problems) != node.info.error:
            engine.book.note(node, replace(node.info, error=verdict(problems),
                                           health_problems=list(problems)))
        elif not problems and node.info.health_problems:  # healthy again: the verdict goes
            engine.book.note(node, replace(node.info, error=None, health_problems=None))
        if problems:
            log.warning("%s: health check failed: %s", node.host, "; ".join(problems))
        if problems and blame:
            try:
                reputation.record(engine.store, node.host, engine.job_id, "CHECK_FAILED",
                                  "; ".join(problems))
            except Exception:  # the store is busy or gone: the check's verdict stands
                log.exception("%s: could not keep the failed check", node.host)
    least = engine.spec.min_nodes
    if not bad:
        return healthy
    if len(healthy) - len(bad) >= least:
        return [n for n in healthy if n not in bad]
    first = bad[0]
    problems, tail = results[first.index]
    return Failure(FailureCause.NODE_UNHEALTHY,
                   f"{first.host} failed its health check: {'; '.join(problems)} "
                   f"({len(bad)} unhealthy node(s); nnodes MIN is {least})",
                   node_index=first.index, host=first.host, stderr_tail=list(tail))


def leave_out_quarantined(engine: Engine, healthy: list[Node]) -> list[Node]:
    """Leave quarantined hosts out where nnodes MIN allows (orchestrator/reputation.py);
    where it does not, they run, and the log says so."""
    held = reputation.quarantined(engine.store)
    out = [n for n in healthy if reputation.host_key(n.host) in held]
    if not out:
        return healthy
    names = ", ".join(n.host for n in out)
    if len(healthy) - len(out) >= engine.spec.min_nodes:
        log.warning("leaving out quarantined node(s) %s (see `orchestrator nodes`)", names)
        return [n for n in healthy if n not in out]
    log.warning("quarantined node(s) %s run all the same: without them fewer than nnodes "
                "MIN (%d) are left", names, engine.spec.min_nodes)
    return healthy
