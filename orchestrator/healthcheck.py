"""Node health checks before each attempt: every participant-to-be runs the job's
``health.node_check`` command and the free-space check (agents/setup.py: run_check) at once,
bounded by ``health.node_check_timeout``; the controller leaves unhealthy nodes out where
``nnodes`` MIN allows (orchestrator/controller.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agents import protocol as P
from orchestrator.plan import plan_attempt

if TYPE_CHECKING:
    from orchestrator.engine import Engine
    from orchestrator.nodebook import Node

ANSWER_MARGIN = 15.0  # seconds past node_check_timeout before a silent agent counts as failed


def check_nodes(engine: Engine, nodes: list[Node]) -> dict[int, tuple[list[str], tuple[str, ...]]]:
    """node index -> (problems, the check's last output lines) for each of ``nodes``; no
    problems: healthy. Turns the controller's loop while the checks run."""
    spec, health = engine.spec, engine.spec.health
    tree = engine.preparer.tree().tree if spec.sync is not None else None
    futures: dict[int, Any] = {}
    for node in nodes:
        assert node.channel is not None
        plan = plan_attempt(spec, engine.job_id, node_indices=[node.index],
                            spec_dir=engine.preparer.spec_dir, sync_tree=tree).nodes[0]
        futures[node.index] = node.channel.request(
            P.NODE_CHECK, argv=list(health.node_check), workdir=plan.workdir,
            env={k: plan.env[k] for k in spec.env if k in plan.env},
            timeout=health.node_check_timeout, min_free_bytes=health.min_free_bytes)
    engine.wait(lambda: all(f.done() for f in futures.values()),
                health.node_check_timeout + ANSWER_MARGIN, interruptible=False)
    out: dict[int, tuple[list[str], tuple[str, ...]]] = {}
    by_index = {n.index: n for n in nodes}
    for index, future in futures.items():
        reply = future.result() if future.done() else None
        if not future.done():
            channel = by_index[index].channel
            if channel is not None:
                channel.forget(future)
            out[index] = ([f"no answer to the health check within "
                           f"{health.node_check_timeout + ANSWER_MARGIN:g}s"], ())
        elif isinstance(reply, P.Checked):
            out[index] = (list(reply.problems), reply.tail)
        elif isinstance(reply, P.Failed):
            out[index] = ([f"health check: {reply.error}"], ())
        else:
            out[index] = (["its channel ended during the health check"], ())
    return out
