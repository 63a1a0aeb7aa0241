"""What the controller's loop does with each event of a turn (orchestrator/events.py): an
agent's message to the node book (order, gaps) and then to the attempt, an attached channel
to what the node must do (drain, start, stop, prepare), a closed or unavailable channel to the
node's state, a finished preparation to the node or the job. A node's message out of
protocol loses that node (``Engine.reject``); an error of ours while handling a good one is
never blamed on the node: it is the controller's (crash-only: it is replaced, and the agent
replays the message)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from agents import commands as C
from agents import protocol as P
from agents.fields import plain
from orchestrator import events as E
from orchestrator.attempt import Failure
from orchestrator.channel import Channel
from orchestrator.nodebook import LIVE, Node, NodeInfo, Order
from orchestrator.state import FailureCause, NodeState

if TYPE_CHECKING:
    from orchestrator.engine import Engine

log = logging.getLogger("orchestrator.controller")


def dispatch(engine: Engine, event: E.Event) -> None:
    """Handle one event of the turn (Engine.turn calls it for each)."""
    match event:
        case E.Received(channel, message):
            node = engine.nodes[channel.node_index]
            if node.channel is not channel:
                return  # a channel we already left
            if node.state == NodeState.UNREACHABLE:  # silent, its channel kept: busy, not cut
                engine.book.heard_again(node, engine.current)
            # A message that passed the door is the node's word; if handling it fails, the
            # error is ours (the store, the disk, a bug), never the node's: it propagates,
            # the controller is replaced, and the agent replays the message to the next one.
            _on_message(engine, node, message)
        case E.Rejected(channel, problem):
            if engine.nodes[channel.node_index].channel is channel:
                engine.reject(engine.nodes[channel.node_index], problem)
        case E.Attached(index, channel):
            engine.pool.settled(engine.nodes[index])  # before a handler may connect it anew
            if engine.on_attached is not None:
                engine.on_attached(engine.nodes[index], channel)
            _on_attached(engine, engine.nodes[index], channel)
        case E.Closed(channel):
            _on_closed(engine, channel)
        case E.Unavailable():
            engine.pool.settled(engine.nodes[event.node])
            _on_unavailable(engine, event)
        case E.Prepared(index, failure, interrupted):
            _on_prepared(engine, engine.nodes[index], failure, interrupted)
        case E.SyncProgress(index, progress):
            node = engine.nodes[index]
            engine.book.note(node, replace(node.info, sync=progress))
        case E.Wake():
            pass


def _on_message(engine: Engine, node: Node, message: P.Message) -> None:
    if isinstance(message, P.Sequenced):
        order = engine.book.order(node, message.seq)
        if order == Order.DUPLICATE:
            return
        if order == Order.GAP:
            if node.state in LIVE:
                engine.book.unreachable(node, "a message went missing")
            else:
                engine.pool.drop_channel(node)
                engine.pool.connect(node, launch=True, retry=True)
            return
    if isinstance(message, P.Output) and engine.current is not None and \
            message.attempt == engine.current.number:
        engine.timeline.mark("first_output", message.attempt)
    if isinstance(message, P.Held):
        engine.holdings.update(node.index, message)
        engine.book.note(node, replace(node.info,
                                       checkpoint=engine.holdings.summary(node.index)))
        for index in engine.holdings.keeping(node.index):  # their copies elsewhere changed
            other = engine.nodes[index]
            if (shown := engine.holdings.summary(index)) != other.info.checkpoint:
                engine.book.note(other, replace(other.info, checkpoint=shown))
        assign_buddies(engine)  # its replica port may be news to its neighbour
        attempt = engine.current
        if attempt is not None and message.restored and (step := engine.holdings.loaded_step(
                attempt.number, attempt.plan.world_size)) is not None:
            told = attempt.checkpoint.restore_step
            if step != attempt.restored_step and told is not None and step < told:
                resumed_older(engine, step)
            attempt.loaded(step)
        return
    if isinstance(message, P.Heartbeat):  # one with a notice (the loop): the node goes away
        given = message.notice
        if given is not None and node.info.notice != (notice := plain(given)):
            log.warning("%s: %s: its workers stop in %.0fs", node.host, given.source,
                        given.deadline - time.time())
            engine.book.note(node, replace(node.info, notice=notice))
        return
    if isinstance(message, P.ErrorReport):
        log.warning("%s: agent error: %s", node.host, message.message)
        return
    if isinstance(message, P.SetupOutput):
        sink = engine.setup_log()
        sink.write(engine.hosts[node.index], "setup", "stdout", list(message.lines))
        sink.flush()
        return
    if isinstance(message, P.Stopped) and engine.book.drained(node, message.attempt):
        attempt = engine.current
        if (attempt is not None and not attempt.ended and not attempt.stopping and
                node.index in attempt.node_plans and message.attempt != attempt.number):
            engine.book.set(node, NodeState.RUNNING)
            engine.send_start(node)  # a participant whose start waited for the drain
    for attempt in (engine.current, engine.previous):
        if attempt is None or (attempt is engine.previous and
                               getattr(message, "attempt", None) != attempt.number):
            continue
        problem = attempt.handle(node.index, message)
        if problem is not None:
            engine.reject(node, problem)
            return
        if isinstance(message, P.Started) and attempt is engine.current and attempt.all_started:
            engine.timeline.mark("started", attempt.number)


def resumed_older(engine: Engine, step: int) -> None:
    """The attempt's ranks resumed ``step``, older than they were told: every node lets go
    of its copies of later steps saved before the attempt (the old timeline's; a spare's
    replicas too), and what every rank could resume after a node's loss is found again."""
    engine.holdings.new_timeline()
    attempt = engine.current
    for node in engine.nodes:
        if node.channel is not None and attempt is not None:
            engine.pool.send(node, C.Resumed(step, attempt.number))


def spares_resume(engine: Engine) -> None:
    """A starting attempt's step, told to the nodes that run none of it: the participants
    drop their copies of later steps as they start, and a spare kept them (after a fall back
    below a step that failed, the attempt after resumed that step again from the spare's
    replicas, and failed the same way)."""
    attempt = engine.current
    if attempt is None or attempt.checkpoint.restore_step is None:
        return
    told = C.Resumed(attempt.checkpoint.restore_step, attempt.number)
    for node in engine.nodes:
        if node.index not in attempt.node_plans and node.channel is not None:
            engine.pool.send(node, told)


def assign_buddies(engine: Engine) -> None:
    """Tell the running attempt's nodes where their checkpoints go (their buddy, and the
    spare that would take their place) and which steps they and the spares keep (what
    changed)."""
    attempt = engine.current
    if attempt is None or attempt.ended:
        return
    spares = [n.index for n in engine.nodes if n.usable and n.index not in attempt.node_plans]
    addresses = engine.holdings.addresses(engine.spec.nodes)
    news: list[tuple[int, C.Command]] = list(
        engine.holdings.buddies(attempt.participants, addresses, spares).items())
    per_node = engine.spec.nproc_per_node
    keep = engine.holdings.retained(engine.holdings.placed(
        attempt.plan, attempt.nprocs, per_node if isinstance(per_node, int) else 1))
    if keep is not None:
        news += [(index, keep) for index in [*attempt.participants, *spares]]
    for index, command in news:
        if engine.nodes[index].channel is not None:
            engine.pool.send(engine.nodes[index], command)


def _on_attached(engine: Engine, node: Node, channel: Channel) -> None:
    if engine.lingering:
        engine.pool.adopt(node, channel)
        engine.pool.send(node, C.Shutdown())
        return
    attempt = engine.current
    plan = engine.book.attach(node, channel, attempt, resuming=engine.resuming,
                            needs_prep=engine.preparer.needed)
    stop_grace = engine.spec.stop_grace_period
    if plan.drain is not None:
        engine.pool.send(node, C.Stop(plan.drain, stop_grace))
    elif plan.start:
        engine.send_start(node)
    elif plan.stop is not None:
        engine.pool.send(node, C.Stop(plan.stop, stop_grace))
    if plan.prepare:
        engine.preparer.start(node.index, node.host, node.spec.is_local, channel)


def _on_closed(engine: Engine, channel: Channel) -> None:
    node = engine.nodes[channel.node_index]
    if node.channel is not channel:
        return
    engine.pool.drop_channel(node)
    engine.holdings.forget(node.index)  # its agent says again what it holds, if it lives
    if engine.lingering:
        return
    if node.state in LIVE:
        engine.book.unreachable(node, "agent channel closed")
    elif node.state in (NodeState.LOST, NodeState.FAILED):
        engine.pool.connect(node, launch=True, retry=True)


def _on_unavailable(engine: Engine, event: E.Unavailable) -> None:
    node, error = engine.nodes[event.node], event.error
    if engine.lingering:
        if event.gone:
            engine.pool.give_up(node)
        return
    if event.refused is not None:  # another version, or out of protocol: not retried
        log.error("%s", error)
        was_running = node.state in (NodeState.RUNNING, NodeState.UNREACHABLE)
        engine.book.lose(node, error, retry=False)
        if was_running:
            engine.fail_participant(node, FailureCause.LAUNCH_FAILED
                                  if event.refused == "version" else FailureCause.NODE_FAIL,
                                  error)
        return
    if event.gone:
        engine.book.note(node, replace(node.info, gone_reason=event.reason))
        if engine.resuming and node.state != NodeState.PENDING:
            # Its workers died with it while no controller was there: resume decides.
            engine.book.lose(node, error, retry=False)
            return
    if node.state == NodeState.PENDING:
        engine.book.set(node, NodeState.FAILED, error, info=NodeInfo(error=error))
    elif node.state in LIVE or node.state == NodeState.UNREACHABLE:
        if event.gone:
            engine.lose(node, error)
        else:  # a resumed controller could not reach it yet
            engine.book.unreachable(node, error)
    elif node.state in (NodeState.LOST, NodeState.FAILED, NodeState.DONE):
        if not engine.resuming:  # gone for good: a fresh agent may rejoin later
            engine.pool.connect(node, launch=True, retry=True)


def _on_prepared(engine: Engine, node: Node, failure: Failure | None, interrupted: bool) -> None:
    if interrupted:
        if node.channel is not None and not node.prepared and engine.preparer.needed:
            # The channel it ran on dropped, and a newer one is already attached.
            engine.book.preparing(node)
            engine.preparer.start(node.index, node.host, node.spec.is_local, node.channel)
        else:
            engine.book.prepared(node, False)
    elif failure is None:
        engine.book.prepared(node, True)
        log.info("%s: prepared (sync, setup)", node.host)
    elif engine.current is None and not engine.ending and not _can_go_on_without(engine, node):
        engine.book.prepared(node, False)
        engine.fail_launch(failure)  # the job's own setup: it would fail again
    else:
        # Enough nodes without it (nnodes MIN:MAX, spares), or a node rejoining while the
        # job runs: that node stays out of the job (its setup would fail again), the job
        # goes on.
        log.error("%s: %s; the job goes on without it", node.host, failure.message)
        engine.book.setup_failed(node, failure.message)


def _can_go_on_without(engine: Engine, node: Node) -> bool:
    return sum(1 for n in engine.nodes if n is not node and not n.setup_failed) >= \
        engine.spec.min_nodes
