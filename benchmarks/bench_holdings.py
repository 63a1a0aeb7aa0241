"""What a round of saves costs the controller as the job grows: every node's ``Held`` report
through the controller's own handler (orchestrator/dispatch.py: the holdings, each node's
summary and those of the nodes it keeps copies of, the buddies, the retained step).

A job saving every step sends one ``Held`` per node per step, so the controller's time per
round is its share of each step. Nodes of 8 ranks each, every node holding its ranks' two
newest saves and its buddy's replicas of them; one round is every node reporting its next
save. The engine around the handler is a stand-in (no channels, no store): the cost measured
is the handler's. Times are CPU seconds per round, with the growth from one size to the next
(4x the nodes: linear is 4x, quadratic 16x).

    python3 benchmarks/bench_holdings.py [--nodes 32 128 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import commands as C  # noqa: E402
from agents import protocol as P  # noqa: E402
from orchestrator import events as E  # noqa: E402
from orchestrator.checkpoints import Holdings  # noqa: E402
from orchestrator.dispatch import dispatch  # noqa: E402
from orchestrator.nodebook import NodeInfo  # noqa: E402
from orchestrator.plan import LaunchPlan, NodePlan  # noqa: E402
from orchestrator.state import NodeState  # noqa: E402

RANKS = 8


def engine_of(nodes: int) -> SimpleNamespace:
    """A stand-in engine of ``nodes`` nodes running one attempt, 8 ranks each."""
    node_list = [SimpleNamespace(index=i, channel=SimpleNamespace(node_index=i), info=NodeInfo(),
                                 usable=True, state=NodeState.RUNNING, host=f"n{i}")
                 for i in range(nodes)]
    plans = tuple(NodePlan(i, i, f"n{i}", "/w", {"LOCAL_WORLD_SIZE": str(RANKS)}, ())
                  for i in range(nodes))
    attempt = SimpleNamespace(
        number=1, ended=False, participants=list(range(nodes)),
        node_plans={i: plan for i, plan in enumerate(plans)}, nprocs={},
        plan=LaunchPlan("j", 1, 0, "gloo", "n0", 29500, nodes * RANKS, plans),
        checkpoint=C.CheckpointConfig(), restored_step=None)
    spec = SimpleNamespace(nodes=[SimpleNamespace(address=f"10.0.{i // 250}.{i % 250}",
                                                  is_local=False, hostname=f"n{i}")
                                  for i in range(nodes)], nproc_per_node=RANKS)

    def note(node: SimpleNamespace, info: NodeInfo) -> None:
        node.info = info
    return SimpleNamespace(
        nodes=node_list, holdings=Holdings(), current=attempt, spec=spec,
        book=SimpleNamespace(note=note), pool=SimpleNamespace(send=lambda node, command: None),
        timeline=SimpleNamespace(mark=lambda *a: None))


def held(node: int, nodes: int, step: int) -> P.Held:
    """Node ``node``'s report after saving ``step``: its ranks' two newest saves, and its
    buddy's (the node before it in the ring) as replicas."""
    own = range(node * RANKS, (node + 1) * RANKS)
    buddy = (node - 1) % nodes
    steps = tuple(s for s in (step - 1, step) if s >= 0)
    return P.Held(1, {r: steps for r in own}, {}, 1 << 30, None,
                  {r: steps for r in range(buddy * RANKS, (buddy + 1) * RANKS)}, 7000 + node,
                  {r: (step, 1 << 26, 0.1) for r in own})


def round_seconds(nodes: int, rounds: int) -> tuple[float, float]:
    """CPU seconds of the first round of every node's report (each a node's first: a new
    port, its neighbour's buddy) and the median of the ``rounds`` after it."""
    engine = engine_of(nodes)
    times = []
    for step in range(rounds + 1):
        events = [E.Received(node.channel, held(node.index, nodes, step))
                  for node in engine.nodes]
        start = time.process_time()
        for event in events:
            dispatch(engine, event)  # type: ignore[arg-type]
        times.append(time.process_time() - start)
    summary = engine.nodes[0].info.checkpoint
    assert summary is not None and summary["newest_elsewhere"] == rounds, summary
    return times[0], statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| nodes | ranks | first round (s) | CPU s per round | per report (ms) | growth |")
    print("|---|---|---|---|---|---|")
    last = None
    for nodes in args.nodes:
        first, seconds = round_seconds(nodes, args.rounds)
        growth = f"{seconds / last:.1f}x" if last else ""
        print(f"| {nodes} | {nodes * RANKS} | {first:.4f} | {seconds:.4f} | "
              f"{1000 * seconds / nodes:.3f} | {growth} |", flush=True)
        last = seconds
    return 0


if __name__ == "__main__":
    sys.exit(main())
