"""The index of who holds what (orchestrator/holders.py) answers as a look at every node's
report does, whatever the reports, forgets and leaving nodes that came before: the
controller asks it at each report instead of that look (a round of saves cost O(nodes^3))."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents import commands as C
from agents import protocol as P
from orchestrator.checkpoints import NOWHERE, Holdings

NODES, RANKS = range(4), range(6)
steps = st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True).map(tuple)
per_rank = st.dictionaries(st.sampled_from(RANKS), steps, max_size=4)
held = st.builds(lambda memory, persisted, store, replicas, port: P.Held(
    1, memory, persisted, 1, store, replicas, port),
    per_rank, per_rank, st.sampled_from([None, "a", "b"]), per_rank,
    st.sampled_from([None, 7000]))
op = st.one_of(
    st.tuples(st.just("update"), st.sampled_from(NODES), held),
    st.tuples(st.just("forget"), st.sampled_from(NODES)),
    st.tuples(st.just("leaving"), st.frozensets(st.sampled_from(NODES)),
              st.frozensets(st.sampled_from(NODES))),
    st.tuples(st.just("buddies"), st.permutations(NODES).flatmap(
        lambda order: st.integers(1, len(order)).map(lambda k: (order[:k], order[k:])))),
    st.tuples(st.just("again")))  # the last question of buddies again (its nodes' news only)
ADDRESSES = {index: f"10.0.0.{index}" for index in NODES}


def told(h: Holdings, ring: list[int], spares: list[int]) -> dict[int, C.ReplicateTo]:
    """What each node of ``ring`` sends where, from nothing but the reports."""
    def server(index: int) -> tuple[str, int] | None:
        report = h._nodes.get(index)
        return None if report is None or report.port is None else (ADDRESSES[index], report.port)
    spares = [i for i in spares if i not in h._leaving]
    also = server(spares[0]) if spares else None
    out = {}
    for i, index in enumerate(ring):
        after = ring[(i + 1) % len(ring)]
        buddy = server(after)
        out[index] = C.ReplicateTo(*(buddy if buddy and after != index else ("", 0)),
                                   (also,) if also else ())
    return out


def replicated(h: Holdings, rank: int) -> dict[int, int]:
    gone = h._leaving - h._up
    return {step: index for index, report in sorted(h._nodes.items())
            if report.port is not None and index not in gone
            for step in report.replicas.get(rank, ())}


def newest_elsewhere(h: Holdings, index: int) -> int | None:
    report = h._nodes.get(index)
    if report is None or not report.memory:
        return None
    shared = report.store is not None and any(
        other.store == report.store for i, other in h._nodes.items() if i != index)
    common: set[int] | None = None
    for rank in report.memory:
        found = {s for s, i in replicated(h, rank).items() if i != index}
        if shared:
            found.update(report.persisted.get(rank, ()))
        common = found if common is None else common & found
        if not common:
            return None
    return max(common) if common else None


def everywhere(h: Holdings, ranks) -> int | None:
    common: set[int] | None = None
    for rank in ranks:
        found = set(replicated(h, rank))
        common = found if common is None else common & found
        if not common:
            return None
    return max(common) if common else None


def stored(h: Holdings, rank: int, index: int) -> set[int]:
    report = h._nodes.get(index)
    if report is None:
        return set()
    found = set(report.persisted.get(rank, ()))
    for other in h._nodes.values():
        if report.store is not None and other.store == report.store:
            found.update(other.persisted.get(rank, ()))
    return found


@settings(max_examples=400, deadline=None)
@given(st.lists(op, max_size=30))
def test_the_index_answers_as_a_look_at_every_report(ops):
    h = Holdings()
    asked = None
    for kind, *args in ops:
        if kind == "again":
            if asked is None:
                continue
            kind, args = "buddies", [asked]
        if kind == "update":
            h.update(*args)
        elif kind == "forget":
            h.forget(*args)
        elif kind == "leaving":
            h.set_leaving(args[0], args[0] & args[1])
        else:
            asked = args[0]
            ring, spares = map(list, asked)
            h.buddies(ring, ADDRESSES, spares)
            # Told only news, each node at each question: it holds what it was last told.
            expected = told(h, ring, spares)
            assert {i: h._buddies.get(i, NOWHERE) for i in NODES} == {
                i: expected.get(i, NOWHERE) for i in NODES}
        for index in NODES:
            report = h._nodes.get(index)
            assert h.keeping(index) == ([] if report is None else [
                i for i, other in sorted(h._nodes.items())
                if i != index and not other.memory.keys().isdisjoint(report.replicas)])
            assert h._newest_elsewhere(index) == newest_elsewhere(h, index)
            for rank in RANKS:
                assert h._stored(rank, index) == stored(h, rank, index)
        for rank in RANKS:
            assert h._replicated(rank) == replicated(h, rank)
        # The same ranks at each report (counted as they come), other ranks now and then.
        assert h._holders.newest_everywhere(RANKS) == everywhere(h, RANKS)
    for ranks in (range(2), (3,), RANKS):
        assert h._holders.newest_everywhere(ranks) == everywhere(h, ranks)


def test_the_same_question_of_buddies_twice_is_no_news_and_a_new_port_is():
    h = Holdings()
    addresses = {0: "a", 1: "b"}
    for index in (0, 1):
        h.update(index, P.Held(1, {index: (1,)}, {}, 1, None, {}, 4000 + index))
    told = h.buddies([0, 1], addresses)
    assert set(told) == {0, 1}
    assert h.buddies([0, 1], addresses) == {}
    h.update(1, P.Held(1, {1: (2,)}, {}, 1, None, {}, 4001))  # the same port: no news
    assert h.buddies([0, 1], addresses) == {}
    h.update(1, P.Held(1, {1: (2,)}, {}, 1, None, {}, 4009))  # a new agent's port
    assert h.buddies([0, 1], addresses)[0].port == 4009
    addresses = {**addresses, 2: "c"}
    h.update(2, P.Held(1, {}, {}, 1, None, {}, None))  # a spare with no server yet
    assert h.buddies([0, 1], addresses, [2]) == {}
    h.update(2, P.Held(1, {}, {}, 1, None, {}, 4002))  # now with one: every node sends there
    assert h.buddies([0, 1], addresses, [2]) == {
        0: C.ReplicateTo("b", 4009, (("c", 4002),)), 1: C.ReplicateTo("a", 4000, (("c", 4002),))}
    h.update(2, P.Held(1, {}, {}, 1, None, {}, 4012))  # the spare's agent again, a new port
    assert h.buddies([0, 1], addresses, [2]) == {
        0: C.ReplicateTo("b", 4009, (("c", 4012),)), 1: C.ReplicateTo("a", 4000, (("c", 4012),))}
    h.forget(0)  # its channel closed: node 1 sends to nobody, node 0 is told again
    assert h.buddies([0, 1], addresses, [2]) == {
        0: C.ReplicateTo("b", 4009, (("c", 4012),)), 1: C.ReplicateTo("", 0, (("c", 4012),))}


def test_rounds_of_reports_through_the_handler_tell_each_buddy_once_and_each_new_step():
    """bench_holdings.py's job of 6 nodes through the controller's handler: each node is told
    its buddy once (at its neighbour's first report), the retained step as each round of
    saves reaches every node's buddy, and each node shows what its loss costs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_holdings import engine_of, held

    from orchestrator import events as E
    from orchestrator.dispatch import dispatch

    engine = engine_of(6)
    sent: list[tuple[int, object]] = []
    engine.pool.send = lambda node, command: sent.append((node.index, command))
    for step in range(4):
        for node in engine.nodes:
            dispatch(engine, E.Received(node.channel, held(node.index, 6, step)))
        assert [n.info.checkpoint["newest_elsewhere"] for n in engine.nodes] == [step] * 6
    told = [(i, c) for i, c in sent if isinstance(c, C.ReplicateTo) and c.port]
    assert sorted(i for i, _ in told) == list(range(6))  # once each
    assert all(c.port == 7000 + (i + 1) % 6 for i, c in told)
    retains = [c.step for i, c in sent if isinstance(c, C.Retain) and i == 0]
    assert retains == [0, 1, 2, 3]
