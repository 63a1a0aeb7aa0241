"""The pairwise network check among a job's nodes (``health.network_check``), before each
attempt, over the agents' own sockets (agents/netcheck.py): every node sends
``network_check.bytes`` to its ring neighbour (all at once: each node sends one transfer and
receives one) and then to node 0 (one node at a time, so that node 0's link is not shared).

A link is bad when its transfer fails or is slower than ``min_mb_per_s``. A node is
unhealthy when every link it is part of is bad while some link elsewhere is good: one slow
link alone cannot tell which of its two ends is at fault, and a node whose every link is slow
is the one. When no link is good at all, every node is. The slowest link is named in the
controller's log either way. ``links`` and ``judge`` are pure (tests/unit/test_netcheck.py).
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents import commands as C
from agents import protocol as P
from orchestrator.channel import Channel, Waiter, ask_all, ask_each

if TYPE_CHECKING:
    from orchestrator.specparts import NetworkCheckSpec

ANSWER_MARGIN = 5.0  # seconds past a transfer's timeout before its silent sender counts


@dataclass
class Link:
    src: int  # positions in the checked nodes' list
    dst: int
    seconds: float | None = None
    error: str | None = None

    def mb_per_s(self, size: int) -> float | None:
        if self.seconds is None:
            return None
        return size / 1e6 / max(self.seconds, 1e-6)


def links(n: int) -> list[Link]:
    """The links of ``n`` nodes: the ring (i -> i+1) first, then each node -> node 0."""
    if n < 2:
        return []
    ring = [Link(i, (i + 1) % n) for i in range(n)]
    seen = {(link.src, link.dst) for link in ring}
    return ring + [Link(i, 0) for i in range(1, n) if (i, 0) not in seen]


def judge(measured: list[Link], n: int, size: int, min_mb_per_s: float | None,
          names: list[str]) -> tuple[dict[int, str], str]:
    """Unhealthy positions with the problem to show, and a line naming the slowest link."""
    def bad(link: Link) -> bool:
        rate = link.mb_per_s(size)
        return rate is None or (min_mb_per_s is not None and rate < min_mb_per_s)

    def shown(link: Link) -> str:
        rate = link.mb_per_s(size)
        how = f"{rate:.1f} MB/s" if rate is not None else f"failed ({link.error})"
        return f"{names[link.src]} -> {names[link.dst]} {how}"

    rates = [r for r in (link.mb_per_s(size) for link in measured) if r is not None]
    failed = [link for link in measured if link.seconds is None]
    if not measured:
        summary = "network check: nothing to check"
    else:
        slowest = failed[0] if failed else min(measured,
                                               key=lambda link: link.mb_per_s(size) or 0.0)
        summary = (f"network check: {len(measured)} link(s) of {size / 2**20:g} MiB, "
                   f"slowest {shown(slowest)}"
                   + (f", median {statistics.median(rates):.1f} MB/s" if rates else ""))
    limit = f" (below health.network_check.min_mb_per_s {min_mb_per_s:g})" \
        if min_mb_per_s is not None else ""
    unhealthy: dict[int, str] = {}
    for node in range(n):  # with no good link anywhere, this is every node
        own = [link for link in measured if node in (link.src, link.dst)]
        if own and all(bad(link) for link in own):
            unhealthy[node] = (f"network check: every link of this node is slow or broken{limit}: "
                               + "; ".join(shown(link) for link in own))
    return unhealthy, summary


def run(channels: list[Channel | None], addresses: list[str], names: list[str],
        spec: NetworkCheckSpec, wait: Waiter | None,
        stopped: Callable[[], bool] = lambda: False) -> tuple[dict[int, str], str]:
    """Check the links among these nodes (their channels, the addresses peers reach them at,
    their names as shown): the unhealthy positions with their problem, and the summary line.
    ``wait`` turns the caller's event loop while the replies come (None: this thread blocks;
    see orchestrator/channel.py)."""
    if len(channels) < 2:
        return judge([], len(channels), spec.bytes, spec.min_mb_per_s, names)
    token = secrets.token_hex(32)
    todo = links(len(channels))
    ring, to_first = todo[:len(channels)], todo[len(channels):]
    lifetime = spec.timeout * (1 + len(to_first)) + ANSWER_MARGIN * 2
    within = spec.timeout + ANSWER_MARGIN
    listening = ask_all({i: c for i, c in enumerate(channels) if c is not None},
                        C.NetListen(token, spec.bytes, lifetime), within, wait)
    ports = {i: r.port for i, r in listening.items() if isinstance(r, P.NetListening)}

    def send_all(batch: list[Link]) -> None:
        asked: dict[int, tuple[Channel, C.NetSend]] = {}
        for n, link in enumerate(batch):
            sender = channels[link.src]
            if link.dst not in ports or sender is None:
                link.error = "its receiver did not start"
                continue
            asked[n] = (sender, C.NetSend(addresses[link.dst], ports[link.dst], token,
                                          spec.bytes, spec.timeout))
        for n, reply in ask_each(asked, within, wait).items():
            if isinstance(reply, P.NetSent):
                batch[n].seconds, batch[n].error = reply.seconds, reply.error
            else:
                batch[n].error = reply.error if isinstance(reply, P.Failed) else "no answer"

    try:
        send_all(ring)
        for link in to_first:
            if stopped():
                break
            send_all([link])
    finally:
        for c in channels:
            if c is not None:
                c.send(C.NetClose())
    measured = [link for link in todo if link.seconds is not None or link.error is not None]
    return judge(measured, len(channels), spec.bytes, spec.min_mb_per_s, names)
