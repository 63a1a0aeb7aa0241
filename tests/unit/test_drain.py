"""Planned moves off drained nodes, their pure parts (orchestrator/drain.py): which nodes a
drain holds, when every rank has saved the agreed step, and what the policy does then."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from agents import commands as C
from agents import protocol as P
from orchestrator.attempt import AttemptResult, Failure
from orchestrator.checkpoints import Holdings
from orchestrator.drain import Move, Mover, drained, matches
from orchestrator.policy import Preempted, Restart, decide
from orchestrator.spec import parse_jobspec
from orchestrator.state import (
    TRANSITIONS,
    AttemptOutcome,
    FailureCause,
    InvalidTransition,
    JobState,
    check_transition,
)


def drain(target, job_id=""):
    return {"target": target, "job_id": job_id, "since": 0.0, "reason": "r", "within": 60.0}


def test_a_drain_holds_a_host_in_every_job_or_a_node_of_one_job():
    hosts = {0: "root@10.0.0.1", 1: "10.0.0.2:2222", 2: "local"}
    assert matches(drain("10.0.0.1"), "j", 0, hosts[0])  # the host as `nodes` lists it
    assert matches(drain("root@10.0.0.1"), "j", 0, hosts[0])  # as the spec names it
    assert matches(drain("10.0.0.2"), "j", 1, hosts[1])
    assert not matches(drain("10.0.0.1", "other"), "j", 0, hosts[0])  # another job's drain
    assert matches(drain("2", "j"), "j", 2, hosts[2])  # a node index, for its job only
    assert not matches(drain("2"), "j", 2, hosts[2])
    assert drained([drain("10.0.0.2"), drain("0", "j")], "j", hosts) == {
        0: drain("0", "j"), 1: drain("10.0.0.2")}
    # --all: every node, of one job or of every job
    assert all(matches(drain("*", "j"), "j", i, h) for i, h in hosts.items())
    assert not matches(drain("*", "other"), "j", 0, hosts[0])
    assert matches(drain("*"), "j", 1, hosts[1])


def held(memory, replicas=None, port=None):
    return P.Held(1, {r: tuple(s) for r, s in memory.items()}, {}, 0, None,
                  {r: tuple(s) for r, s in (replicas or {}).items()}, port)


def test_a_move_waits_for_every_rank_in_memory_and_the_leaving_ranks_elsewhere():
    h = Holdings()
    placement = {0: 0, 1: 0, 2: 1, 3: 1}  # node 1 leaves
    assert h.newest_saved(placement) is None  # nothing saved: no step to agree on
    h.update(0, held({0: [8, 9], 1: [8, 9]}, {2: [8], 3: [8]}, port=4000))
    h.update(1, held({2: [8, 9], 3: [8]}))
    assert h.newest_saved(placement) == 9
    assert h.saved(8, placement, [1]) and not h.saved(9, placement, [1])
    h.update(1, held({2: [9], 3: [9]}))
    assert not h.saved(9, placement, [1])  # in memory everywhere, but node 1's only there
    h.update(2, held({}, {2: [9], 3: [9]}, port=4001))  # the spare holds replicas
    assert h.saved(9, placement, [1])


def test_a_planned_move_restarts_at_once_and_charges_nothing():
    spec = parse_jobspec("nodes: [{host: local}]\ncommand: [x]\nmax_restarts: 0\n"
                         "restart_backoff: {initial: 5}\n")
    failure = Failure(FailureCause.PREEMPTED, "node 1 drained (maintenance): every rank "
                      "saved step 9; the job goes on without it", node_index=1)
    decision = decide(AttemptResult(AttemptOutcome.FAILED, failure), 0, spec)
    assert decision == Restart(0.0, charged=False)
    assert (failure.failure_class, failure.decision) == (
        "preempted", "moved, not charged: a planned interruption")


def test_a_whole_job_stop_waits_for_every_rank_persisted_in_a_directory_a_node_reads():
    h = Holdings()
    placement = {0: 0, 1: 0, 2: 1, 3: 1}
    h.update(0, P.Held(1, {0: (9,), 1: (9,)}, {0: (9,), 1: (9,)}, 0, "disk-a"))
    h.update(1, P.Held(1, {2: (9,), 3: (9,)}, {2: (9,)}, 0, "disk-b"))
    assert h.saved(9, placement, ()) and not h.persisted(9, placement)  # rank 3's not yet
    h.update(1, P.Held(1, {2: (9,), 3: (9,)}, {2: (9,), 3: (9,)}, 0, "disk-b"))
    assert h.persisted(9, placement) and not h.persisted(8, placement)
    # A shared filesystem (the same store id): one node's report counts for the other.
    h.update(1, P.Held(1, {2: (9,), 3: (9,)}, {}, 0, "disk-a"))
    h.update(0, P.Held(1, {0: (9,), 1: (9,)}, {r: (9,) for r in range(4)}, 0, "disk-a"))
    assert h.persisted(9, placement)


def test_a_move_of_every_node_stops_the_job_preempted_until_resumed():
    spec = parse_jobspec("nodes: [{host: local}]\ncommand: [x]\nmax_restarts: 0\n")
    failure = Failure(FailureCause.PREEMPTED, "every node drained (maintenance): every rank "
                      "saved step 9, persisted in /ckpt; the job stops until `orchestrator "
                      "resume`")  # naming no node
    decision = decide(AttemptResult(AttemptOutcome.FAILED, failure), 0, spec)
    assert isinstance(decision, Preempted) and decision.state == JobState.PREEMPTED
    assert decision.failure["failure_class"] == "preempted"
    # At rest (no controller runs it, nothing restarts it unasked) but not ended for good:
    # resume (RESTARTING) or cancel take it from there.
    assert JobState.PREEMPTED.is_at_rest() and not JobState.PREEMPTED.is_terminal()
    assert all(s.is_at_rest() for s in JobState if s.is_terminal())
    assert TRANSITIONS[JobState.PREEMPTED] == {JobState.RESTARTING, JobState.CANCELLED}
    check_transition(JobState.RUNNING, JobState.PREEMPTED)
    with pytest.raises(InvalidTransition):
        check_transition(JobState.PREEMPTED, JobState.RUNNING)


def test_a_node_that_attaches_again_during_a_move_is_told_the_step_again():
    """A notice's SIGTERM can take a node's relay with it (Slurm's: the step's task): a
    ``save_at`` sent while its channel was down was lost, and the node never persisted the
    step (the job stopped "not every rank saved step 29"). Each node is told on the channel
    it has now, holding for what is left of the move."""
    sent: list[tuple[int, C.SaveAt]] = []
    nodes = [SimpleNamespace(index=i, host=f"n{i}", channel=object()) for i in range(3)]
    nodes[1].channel = None  # its relay went with the SIGTERM
    engine = SimpleNamespace(nodes=nodes, pool=SimpleNamespace(
        send=lambda node, command: sent.append((node.index, command)) or True))
    attempt = SimpleNamespace(participants=[0, 1, 2])
    move = Move(1, (1,), "SIGTERM", 29, time.monotonic() + 30, 30.0, whole=True,
                persist=True)
    Mover._tell_step(engine, attempt, move)  # type: ignore[arg-type]
    assert [i for i, _ in sent] == [0, 2]
    assert all(c.step == 29 and c.persist and not c.replicate for _, c in sent)
    sent.clear()
    Mover._tell_step(engine, attempt, move)  # type: ignore[arg-type]
    assert sent == []  # told once on each channel
    nodes[1].channel = object()  # attached again
    nodes[2].channel = object()  # and another one, on a new channel
    Mover._tell_step(engine, attempt, move)  # type: ignore[arg-type]
    assert [i for i, _ in sent] == [1, 2]
    assert all(c.step == 29 and c.persist and 29.0 < c.hold <= 30.0 for _, c in sent)


def test_only_the_leaving_nodes_replicate_during_a_move_the_job_survives():
    sent: list[tuple[int, C.SaveAt]] = []
    nodes = [SimpleNamespace(index=i, host=f"n{i}", channel=object()) for i in range(3)]
    engine = SimpleNamespace(nodes=nodes, pool=SimpleNamespace(
        send=lambda node, command: sent.append((node.index, command)) or True))
    move = Move(1, (2,), "maintenance", 7, time.monotonic() + 60, 60.0)
    Mover._tell_step(engine, SimpleNamespace(participants=[0, 1, 2]), move)  # type: ignore[arg-type]
    assert [(i, c.step, c.replicate, c.persist) for i, c in sent] == [
        (0, 7, False, False), (1, 7, False, False), (2, 7, True, False)]


def test_an_undrain_reaches_a_node_whose_channel_was_down_when_it_came():
    """A move undrained while a node's channel is down: its ranks would hold at the step
    until the move's deadline, and its agent send no replicas for the rest of the attempt
    (replication is deferred during a move). The end of the move is told again on the channel
    the node attaches on, as the step is, and not once a new move has begun."""
    sent: list[tuple[int, C.SaveAt]] = []
    nodes = [SimpleNamespace(index=i, host=f"n{i}", channel=object(), usable=True,
                             info=SimpleNamespace(notice=None)) for i in range(2)]
    holdings = Holdings()
    holdings.update(0, held({0: [9]}))
    holdings.update(1, held({1: [9]}))
    attempt = SimpleNamespace(number=1, participants=[0, 1], ended=False, failure=None,
                              stopping=False, last_steps={}, node_plans={0: None, 1: None},
                              held=lambda: None,
                              plan=SimpleNamespace(nodes=[SimpleNamespace(
                                  node_index=n, workers=[SimpleNamespace(rank=n)])
                                  for n in (0, 1)]), nprocs={0: 1, 1: 1})
    engine = SimpleNamespace(nodes=nodes, holdings=holdings, current=attempt,
                             state=JobState.RUNNING, spec=SimpleNamespace(
                                 checkpoint=SimpleNamespace(dir=None), min_nodes=1,
                                 nproc_per_node=1),
                             pool=SimpleNamespace(send=lambda node, command:
                                                  sent.append((node.index, command)) or True))
    drains = [drain("1", "j")]
    store = SimpleNamespace(drains=lambda: list(drains))
    mover = Mover("j", store, {0: "n0", 1: "n1"})  # type: ignore[arg-type]
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(0, 11), (1, 11)]  # the move: 9 + MARGIN
    sent.clear()
    nodes[0].channel = None  # its relay restarts
    drains.clear()  # undrained
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is None and [(i, c.step) for i, c in sent] == [(1, None)]
    sent.clear()
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == []  # told once on each channel
    nodes[0].channel = object()  # attached again
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(0, None)]
    # Drained again: a new move, whose step a node attaching again is told, not its end.
    sent.clear()
    drains.append(drain("1", "j"))
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(0, 11), (1, 11)]
    sent.clear()
    nodes[0].channel = object()
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(0, 11)]


def test_a_noticed_node_whose_agent_attaches_again_keeps_its_notice():
    """A notice's SIGTERM can take a node's relay with it: the same agent attaching again
    dropped its notice until its next heartbeat, and a look in between called the move off
    (every rank told to save nothing) and began another at a later step."""
    from orchestrator.nodebook import NodeBook

    spec = parse_jobspec("nodes: [{host: a}, {host: b}]\ncommand: [x]\n")
    book = NodeBook("j", spec, None, SimpleNamespace(adopt=lambda node, channel: None))  # type: ignore[arg-type]
    node = book.nodes[1]

    def attach(instance: str) -> None:
        hello = P.Hello(P.VERSION, 7, 0, instance=instance)
        book.attach(node, SimpleNamespace(hello=hello, launched=False), None,  # type: ignore[arg-type]
                    resuming=False, needs_prep=False)
    attach("agent-1")
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 60}
    node.info = dataclasses.replace(node.info, notice=notice)  # its heartbeat said so
    attach("agent-1")  # its channel went, and came back
    assert node.info.notice == notice
    node.info = dataclasses.replace(node.info, notice={**notice, "deadline": time.time() - 1})
    attach("agent-2")  # another agent, after the deadline: the host stayed; it says its own
    assert node.info.notice is None


def test_a_noticed_nodes_next_agent_keeps_the_notice_until_its_deadline():
    """A noticed node's agent leaves once its workers stop, and its transport starts another
    there: that one knew nothing of the notice, and the node, whose host still goes away by
    the deadline, was an ordinary spare again (the next failure could place ranks on it).
    Another agent keeps it until its deadline; past it, a look finds the node still here and
    usable again."""
    from orchestrator.nodebook import NodeBook

    spec = parse_jobspec("nodes: [{host: a}, {host: b}, {host: c}]\ncommand: [x]\n")
    book = NodeBook("j", spec, None, SimpleNamespace(adopt=lambda node, channel: None))  # type: ignore[arg-type]
    node = book.nodes[2]
    hello = P.Hello(P.VERSION, 7, 0, instance="agent-1")
    book.attach(node, SimpleNamespace(hello=hello, launched=False), None,  # type: ignore[arg-type]
                resuming=False, needs_prep=False)
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 60}
    node.info = dataclasses.replace(node.info, notice=notice)
    hello = P.Hello(P.VERSION, 8, 0, instance="agent-2")  # relaunched: a new agent
    book.attach(node, SimpleNamespace(hello=hello, launched=True), None,  # type: ignore[arg-type]
                resuming=False, needs_prep=False)
    assert node.info.notice is not None and node.info.notice["deadline"] == notice["deadline"]
    store = SimpleNamespace(drains=lambda: [])
    mover = Mover("j", store, {0: "a", 1: "b", 2: "c"})  # type: ignore[arg-type]
    engine = SimpleNamespace(nodes=book.nodes, book=book, holdings=Holdings(), current=None,
                             state=JobState.RUNNING)
    mover.look(engine)  # type: ignore[arg-type]
    assert list(mover.drained) == [2] and mover.drained[2]["notice"]  # no spare
    node.info = dataclasses.replace(node.info, notice={**node.info.notice,
                                                       "deadline": time.time() - 1})
    mover.look(engine)  # type: ignore[arg-type]
    assert node.info.notice is None and mover.drained == {}


def three_nodes():
    """Three usable nodes (n0-n2) attached, none noticed, as the mover sees them."""
    return [SimpleNamespace(index=i, host=f"n{i}", channel=object(), usable=True,
                            info=SimpleNamespace(notice=None)) for i in range(3)]


def engine_of(nodes, holdings, plan, nprocs, min_nodes, sent):
    """A running attempt of two participants (node 0 and 1) as the mover sees it; what it
    sends goes to ``sent``."""
    attempt = SimpleNamespace(number=1, participants=[0, 1], ended=False, failure=None,
                              stopping=False, last_steps={}, node_plans={0: None, 1: None},
                              plan=plan, nprocs=nprocs, held=lambda: None)
    return SimpleNamespace(
        nodes=nodes, holdings=holdings, current=attempt, state=JobState.RUNNING,
        spec=SimpleNamespace(checkpoint=SimpleNamespace(dir=None), min_nodes=min_nodes,
                             nproc_per_node=max(nprocs.values())),
        pool=SimpleNamespace(send=lambda node, command: sent.append((node.index, command))))


def one_rank_each(nodes, min_nodes, sent):
    """``engine_of`` two participants of one rank each (rank n on node n), every one of the
    three nodes holding step 9 of its rank and serving replicas."""
    h = Holdings()
    for i in range(3):
        h.update(i, held({i: [9]}, port=4000 + i))
    plan = SimpleNamespace(nodes=[SimpleNamespace(node_index=n,
                                                  workers=[SimpleNamespace(rank=n)])
                                  for n in (0, 1)])
    return engine_of(nodes, h, plan, {0: 1, 1: 1}, min_nodes, sent)


def test_a_move_of_a_job_whose_launch_names_no_rank_agrees_on_a_step():
    """torchrun-style and per-node launches name no worker's rank: a move found no rank of
    the job in memory, agreed on no step, and a whole-job stop stopped it without a save."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    h = Holdings()
    h.update(0, held({0: [9], 1: [9]}, port=4000))
    h.update(1, held({2: [9], 3: [9]}, port=4001))
    plan = SimpleNamespace(nodes=[SimpleNamespace(node_index=n, env={"LOCAL_WORLD_SIZE": "2"},
                                                  workers=[SimpleNamespace(rank=None)])
                                  for n in (0, 1)])
    engine = engine_of(nodes, h, plan, {0: 2, 1: 2}, 1, sent)
    store = SimpleNamespace(drains=lambda: [drain("1", "j")])
    mover = Mover("j", store, {0: "n0", 1: "n1", 2: "n2"})  # type: ignore[arg-type]
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is not None and mover.move.nodes == (1,) and mover.move.step > 9
    assert {i for i, c in sent if isinstance(c, C.SaveAt) and c.step == mover.move.step} \
        == {0, 1}


def test_a_notice_on_a_drained_node_moves_by_the_notices_deadline():
    """An operator drained a node that then got a notice: the drain's 120 s and its stay-up
    (the next attempt pulls from its memory) won, though the node goes away at its deadline."""
    sent: list[tuple[int, C.Command]] = []
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 20}
    nodes = [SimpleNamespace(index=i, host=f"n{i}", channel=object(), usable=True,
                             info=SimpleNamespace(notice=notice if i == 1 else None))
             for i in range(3)]
    engine = one_rank_each(nodes, 2, sent)
    h = engine.holdings
    drains = [{**drain("1", "j"), "within": 120.0, "reason": "maintenance"}]
    mover = Mover("j", SimpleNamespace(drains=lambda: drains),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is not None and mover.move.within <= 20 and not mover.move.pull
    assert 1 not in h._up  # its memory serves no pull: it goes away


def test_a_notice_during_a_drains_move_moves_by_the_notices_deadline():
    """A drain's move under way (120 s; the node to stay up for the next attempt's pulls,
    nothing replicated), then the host SIGTERMs the node's agent: the move kept the drain's
    time and its pull, though the node goes away by the notice's deadline (its workers
    stopped then: a failure charged; or the next attempt pulled from a node gone). Found by a
    reading helper."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    engine = one_rank_each(nodes, 2, sent)
    drains = [{**drain("1", "j"), "within": 120.0, "reason": "maintenance"}]
    mover = Mover("j", SimpleNamespace(drains=lambda: drains),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    move = mover.move
    assert move is not None and move.pull and move.within == 120.0
    sent.clear()
    nodes[1].info.notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 20}
    mover.look(engine)  # type: ignore[arg-type]
    noticed = mover.move
    assert noticed is not None and noticed.nodes == (1,) and noticed.step == move.step
    assert not noticed.pull and noticed.deadline < move.deadline - 90
    assert 1 not in engine.holdings._up  # its memory serves no pull: it goes away
    assert sorted((i, c.step, c.replicate) for i, c in sent) == [
        (0, move.step, False), (1, move.step, True)]  # its copies go elsewhere now
    sent.clear()
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == [] and mover.move is noticed  # told once


def test_a_move_whose_attempt_failed_otherwise_ends_with_it():
    """A drain's move under way, and a rank fails: the attempt ends without the move, whose
    Move stayed for good (its attempt gone), and the drained node out of the next attempt
    was never told to let go of its checkpoint memory. Found by a reading helper."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    engine = one_rank_each(nodes, 2, sent)
    engine.holdings.update(1, P.Held(1, {1: (9,)}, {}, 1 << 20, None, {}, 4001))
    mover = Mover("j", SimpleNamespace(drains=lambda: [drain("1", "j")]),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is not None and mover.move.attempt == 1
    engine.current.failure = Failure(FailureCause.WORKER_FAILED, "rank 0 exited 1")
    mover.look(engine)  # type: ignore[arg-type]
    sent.clear()
    engine.current = SimpleNamespace(**{**vars(engine.current), "number": 2,
                                        "participants": [0, 2], "failure": None,
                                        "node_plans": {0: None, 2: None},
                                        "restored_step": None, "last_steps": {}})
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is None
    assert [(i, type(c).__name__) for i, c in sent] == [(1, "Release")]


def test_a_step_every_rank_had_passed_when_told_is_agreed_again_once():
    """Fast steps just after a start (no pace known yet): every rank was past the agreed
    step when told, none saved it, and the move waited for its deadline (120 s) to fall back.
    Once every rank reported a later step, another is agreed and told, once."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    engine = one_rank_each(nodes, 1, sent)
    mover = Mover("j", SimpleNamespace(drains=lambda: [drain("1", "j")]),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    first = mover.move.step
    engine.current.last_steps = {0: first + 3, 1: first + 4}  # both went past it
    sent.clear()
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is not None and mover.move.step > first + 4
    assert sorted((i, c.step) for i, c in sent) == [(0, mover.move.step), (1, mover.move.step)]
    again = mover.move.step
    engine.current.last_steps = {0: again + 1, 1: again + 1}  # and past that one too
    sent.clear()
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move.step == again and sent == []  # once: then its deadline, as before


def test_nodes_noticed_after_a_move_began_leave_with_it_and_a_whole_job_stop_persists():
    """The notices of one preemption reach the nodes a heartbeat apart: a move begun for the
    first noticed node went on without the others, and a job with a spare whose every node
    was noticed moved onto it instead of stopping PREEMPTED with the step persisted. Nodes
    noticed later join the move at its step, and every participant is told again what it
    persists (a step it sealed already included)."""
    sent: list[tuple[int, C.Command]] = []
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 30}
    nodes = three_nodes()
    engine = one_rank_each(nodes, 2, sent)
    engine.spec.checkpoint.dir = "/ckpt"
    engine.current.fail = lambda failure: setattr(engine.current, "failure", failure)
    mover = Mover("j", SimpleNamespace(drains=lambda: []),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    nodes[0].info.notice = notice
    mover.look(engine)  # type: ignore[arg-type]
    move = mover.move
    assert move is not None and move.nodes == (0,) and not move.whole and not move.persist
    assert sorted((i, c.step, c.persist, c.replicate) for i, c in sent) == [
        (0, move.step, False, True), (1, move.step, False, False)]
    sent.clear()
    nodes[1].info.notice = {**notice, "deadline": time.time() + 20}  # a heartbeat later
    nodes[2].info.notice = notice  # the spare too
    mover.look(engine)  # type: ignore[arg-type]
    widened = mover.move
    assert widened is not None and widened.nodes == (0, 1) and widened.whole
    assert widened.persist and widened.step == move.step and widened.deadline < move.deadline
    assert sorted((i, c.step, c.persist, c.replicate) for i, c in sent) == [
        (0, move.step, True, False), (1, move.step, True, False)]
    # Every rank saved the step and persisted it: the job stops PREEMPTED, naming no node.
    h = engine.holdings
    for i in (0, 1):
        h.update(i, P.Held(1, {i: (move.step,)}, {i: (move.step,)}, 0, "disk", {}, 4000 + i))
    mover.look(engine)  # type: ignore[arg-type]
    failure = engine.current.failure
    assert mover.move is None and failure is not None and failure.node_index is None
    assert f"every rank saved step {move.step}, persisted in /ckpt" in failure.message


def test_a_spare_noticed_after_a_move_began_onto_it_makes_the_move_a_whole_job_stop():
    """Node 0 noticed, the move onto the spare begun; then the spare is noticed too (the same
    preemption), and node 1 cannot go on alone (nnodes MIN 2). The move went on as it was:
    not whole, nothing persisted, the next attempt on the doomed nodes. It becomes a
    whole-job stop at its step, persisted. Found by a reading helper."""
    sent: list[tuple[int, C.Command]] = []
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 30}
    nodes = three_nodes()
    engine = one_rank_each(nodes, 2, sent)
    engine.spec.checkpoint.dir = "/ckpt"
    mover = Mover("j", SimpleNamespace(drains=lambda: []),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    nodes[0].info.notice = notice
    mover.look(engine)  # type: ignore[arg-type]
    move = mover.move
    assert move is not None and move.nodes == (0,) and not move.whole
    sent.clear()
    nodes[2].info.notice = notice  # the spare
    mover.look(engine)  # type: ignore[arg-type]
    whole = mover.move
    assert whole is not None and whole.nodes == (0,) and whole.whole and whole.persist
    assert whole.step == move.step
    assert sorted((i, c.step, c.persist) for i, c in sent) == [
        (0, move.step, True), (1, move.step, True)]
    sent.clear()
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == [] and mover.move is whole  # told once


@pytest.mark.parametrize("drained_first", [False, True])
def test_a_drain_the_job_cannot_do_without_beside_a_notice_waits_and_the_notice_moves(
        caplog, drained_first):
    """Node 0 noticed (its host goes away), node 1 drained by an operator, one spare, nnodes
    MIN 2: both leaving leaves one node, so the move became a whole-job stop (PREEMPTED,
    the user to resume) though the noticed node had a spare to go to. The noticed node goes
    onto the spare; the drain, which the job cannot do without, keeps running there and says
    so, as a drain alone does. Either order. Found by a reading helper."""
    sent: list[tuple[int, C.Command]] = []
    notice = {"source": "SIGTERM to the agent", "deadline": time.time() + 30}
    nodes = three_nodes()
    engine = one_rank_each(nodes, 2, sent)
    drains: list[dict] = []
    mover = Mover("j", SimpleNamespace(drains=lambda: drains),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    def notice_0():
        nodes[0].info.notice = notice

    def drain_1():
        drains.append(drain("1", "j"))

    first, second = (drain_1, notice_0) if drained_first else (notice_0, drain_1)
    first()
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is not None and not mover.move.whole
    assert mover.move.nodes == ((1,) if drained_first else (0,))
    second()
    with caplog.at_level("WARNING", logger="orchestrator.controller"):
        mover.look(engine)  # type: ignore[arg-type]
        mover.look(engine)  # type: ignore[arg-type]
    move = mover.move
    assert move is not None and move.nodes == (0,) and not move.whole and not move.pull
    said = [r.getMessage() for r in caplog.records if "cannot go on without it" in r.getMessage()]
    assert said == ["node 1 (n1) drained, but the job cannot go on without it (nnodes MIN 2, 1 "
                    "spare(s)): it keeps running there"], said


def test_a_controller_that_takes_over_tells_off_a_move_it_knows_nothing_of():
    """A move undrained while its controller was being replaced: the new one knew no move,
    so nothing told the ranks held at the step to go on, and they held until the move's time
    ran out (their agents sending no replicas meanwhile). A controller that takes over tells
    every participant once that no step is asked, unless it begins a move of its own."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    nodes[1].channel = None  # not attached again yet
    engine = one_rank_each(nodes, 1, sent)
    drains: list[dict] = []
    mover = Mover("j", SimpleNamespace(drains=lambda: list(drains)),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"}, taken_over=True)
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(0, None)]
    sent.clear()
    nodes[1].channel = object()
    mover.look(engine)  # type: ignore[arg-type]
    mover.look(engine)  # type: ignore[arg-type]
    assert [(i, c.step) for i, c in sent] == [(1, None)]  # once each
    # Still drained when it took over: the move it begins is what the nodes are told.
    sent.clear()
    drains.append(drain("1", "j"))
    again = Mover("j", SimpleNamespace(drains=lambda: list(drains)),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"}, taken_over=True)
    again.look(engine)  # type: ignore[arg-type]
    assert again.move is not None
    assert sorted((i, c.step) for i, c in sent) == [(0, again.move.step), (1, again.move.step)]
    # A controller that started the job has no move to tell off.
    sent.clear()
    Mover("j", SimpleNamespace(drains=lambda: []),  # type: ignore[arg-type]
          {0: "n0", 1: "n1", 2: "n2"}).look(engine)  # type: ignore[arg-type]
    assert sent == []


def test_a_node_drained_again_after_an_undrain_lets_go_of_its_memory_again():
    """Released, undrained (a spare again: it takes replicas), drained again on the same
    channel: it was never told again, and kept the replicas for the job's life. Found by a
    reading helper."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    engine = one_rank_each(nodes, 1, sent)
    engine.current.number, engine.current.restored_step = 2, None  # nothing to pull
    h = engine.holdings
    h.update(2, dataclasses.replace(held({1: [9]}, port=4002), bytes=1 << 30))
    drains = [drain("2", "j")]
    mover = Mover("j", SimpleNamespace(drains=lambda: list(drains)),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == [(2, C.Release())]
    sent.clear()
    drains.clear()  # undrained: a spare again, holding replicas
    mover.look(engine)  # type: ignore[arg-type]
    drains.append(drain("2", "j"))
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == [(2, C.Release())]


def test_a_drained_node_out_of_the_job_lets_go_of_its_memory_once_its_ranks_loaded():
    """A drained node stays up while the nodes that take its place pull its ranks' copies;
    after that it kept them, and its buddy's replicas, for as long as the job ran: gigabytes
    of shared memory on a node the operator wants back. Once every rank of the attempt that
    goes on without it loaded, it is told to let go, once."""
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    engine = one_rank_each(nodes, 1, sent)  # node 2 held rank 1's copies: it was drained
    attempt = engine.current
    attempt.number, attempt.restored_step = 2, 9
    h = engine.holdings
    h.update(2, dataclasses.replace(held({1: [9]}, port=4002), bytes=1 << 30))
    mover = Mover("j", SimpleNamespace(drains=lambda: [drain("2", "j")]),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == []  # rank 1's copy may still be pulled from it
    for i in (0, 1):  # every rank of attempt 2 loaded step 9
        h.update(i, dataclasses.replace(held({i: [9]}, port=4000 + i),
                                        restored={i: (2, 9, "buddy", 0.1, 0)}))
    mover.look(engine)  # type: ignore[arg-type]
    mover.look(engine)  # type: ignore[arg-type]
    assert sent == [(2, C.Release())]
    sent.clear()
    nodes[0].channel = object()  # a participant, and one not drained, are never told
    engine.spec.min_nodes = 2
    Mover("j", SimpleNamespace(drains=lambda: [drain("0", "j")]),  # type: ignore[arg-type]
          {0: "n0", 1: "n1", 2: "n2"}).look(engine)  # type: ignore[arg-type]
    assert not any(isinstance(c, C.Release) for _, c in sent)


def test_a_drain_seen_before_any_save_waits_for_a_first_save_again_in_the_next_attempt(
        monkeypatch):
    """A drain seen while an attempt had saved nothing waits NO_SAVES_WAIT for a first save;
    that wait began once per set of nodes for the job's life, so the same drain in a later
    attempt (its ranks not saved yet, 20 s on) ended that attempt at once, without a save.
    Found by a reading helper."""
    from orchestrator import drain as drain_module

    now = [1000.0]
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: now[0])
    sent: list[tuple[int, C.Command]] = []
    nodes = three_nodes()
    plan = SimpleNamespace(nodes=[SimpleNamespace(node_index=n,
                                                  workers=[SimpleNamespace(rank=n)])
                                  for n in (0, 1)])
    engine = engine_of(nodes, Holdings(), plan, {0: 1, 1: 1}, 1, sent)  # nothing saved
    failed: list = []
    engine.current.fail = failed.append
    engine.current.node_ranks = {0: 0, 1: 1}
    mover = Mover("j", SimpleNamespace(drains=lambda: [drain("1", "j")]),  # type: ignore[arg-type]
                  {0: "n0", 1: "n1", 2: "n2"})
    mover.look(engine)  # type: ignore[arg-type]
    assert mover.move is None and failed == []  # it waits for a first save
    now[0] += 20.0  # attempt 1 ended meanwhile (another failure); attempt 2 has just started
    engine.current = SimpleNamespace(**{**vars(engine.current), "number": 2})
    mover.look(engine)  # type: ignore[arg-type]
    assert failed == []  # waits again for attempt 2's first save
    now[0] += drain_module.NO_SAVES_WAIT
    mover.look(engine)  # type: ignore[arg-type]
    assert len(failed) == 1 and "keep no checkpoint" in failed[0].message
