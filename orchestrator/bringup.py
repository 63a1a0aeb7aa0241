"""Bringing a job's agents up: every node's agent started (or found) in parallel through the
node pool, the hellos awaited on the engine's loop, and the launch failed, naming the first
node that did not come up, when fewer than ``min_nodes`` answer.

Called by the controller (a launch, a resume with nodes that never came up, the nodes to try
again between attempts). It may call the engine, its node pool and its node book.
"""

from __future__ import annotations

from orchestrator.attempt import Failure
from orchestrator.engine import Engine
from orchestrator.state import FailureCause, NodeState


def connect_all(engine: Engine) -> Failure | None:
    """Start (or find) every node's agent in parallel and wait for their hello. Fewer than
    ``min_nodes`` answering fails the launch, naming the first node that did not."""
    nodes, spec = engine.nodes, engine.spec
    engine.timeline.mark("connect")
    for node in nodes:
        engine.pool.connect(node, launch=True)
    answered = engine.wait(lambda: all(n.state != NodeState.PENDING for n in nodes),
                           spec.launch_timeout)
    engine.timeline.mark("hello")
    if not answered:
        if engine.stop is not None or engine.launch_failure is not None:
            return engine.launch_failure
        for n in nodes:
            if n.state == NodeState.PENDING:
                engine.book.lose(n, f"{n.host}: agent did not answer within "
                                    f"{spec.launch_timeout:g}s", retry=False)
    failed = [n for n in nodes if n.state == NodeState.FAILED]
    if len(nodes) - len(failed) < spec.min_nodes:
        first = failed[0]
        return Failure(FailureCause.LAUNCH_FAILED, str(first.info.error),
                       node_index=first.index, host=first.host)
    return None


def reconnect_absent(engine: Engine) -> None:
    """Keep trying, in the background, nodes that never came up or were lost: those that
    answer before an attempt starts take part in it."""
    for node in engine.nodes:
        if node.state in (NodeState.FAILED, NodeState.LOST) and node.channel is None \
                and not node.setup_failed:
            engine.pool.connect(node, launch=True, retry=True)
