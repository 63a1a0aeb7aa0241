"""A controller that cannot write pauses: it never stops a worker, and it loses no line.

When a write under ``$ORCHESTRATOR_HOME`` fails because its disk is full (or the quota), or
the home is read-only or gone (a stale NFS handle, an I/O error), or its filesystem has less
than ``logs.min_free_bytes`` free, the controller **holds**:

- every agent is told to ``spool`` (agents/outbox.py): its sequenced messages (output,
  starts, exits) go to its spool, within ``spool_max_bytes``, as while no controller is
  attached, while it stays attached, so that ``controller_grace`` never runs out;
- the controller writes nothing, reads only the agents' live news (heartbeats keep them
  attached), and looks once a second whether it can write again;
- the pause is in the controller's log (once it can be written), a ``paused`` notification,
  and ``status`` (``paused: {since, reason}``), written into the store with the help of a
  small reserve file the home keeps for this (``.reserve``, freed for the note).

When writes work again it hands the job over: it exits, and its supervisor starts a fresh
controller at once (orchestrator/supervisor.py), which truncates the logs to the last
checkpoint and has the agents replay everything they kept, in order. Nothing is ever written
from memory that a failed write may have left half-done. A cancel during the pause stops the
workers at once (every agent is told to shut down); the next controller records it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from agents import commands as C
from orchestrator import events as E
from orchestrator.errors import StoreUnwritable
from orchestrator.store import Store, unwritable

if TYPE_CHECKING:
    from orchestrator.engine import Engine
    from orchestrator.notify import Notifier

log = logging.getLogger("orchestrator.controller")

LOOK_EVERY = 1.0  # seconds between two looks at whether the home can be written again


def problem(exc: BaseException, store: Store, job_id: str, floor: int) -> str | None:
    """What could not be written under the home and why, when ``exc`` (or what caused it)
    says so and the home indeed cannot be written now; None for anything else (a bug, a
    full disk elsewhere: the controller crashes, and is replaced)."""
    home = os.path.realpath(store.home)
    seen: BaseException | None = exc
    found = None
    while seen is not None and found is None:
        reason = unwritable(seen)
        where = getattr(seen, "path", None) or getattr(seen, "filename", None)
        if reason is not None and isinstance(where, str) and \
                os.path.realpath(where).startswith(home):
            found = f"{where}: {reason}"
        seen = seen.__cause__ or seen.__context__
    if found is None:
        return None
    try:  # gone already (or never the home's own trouble): then it is no pause
        store.check_room(floor)
        store.note_pause(job_id, None, strict=True)
    except StoreUnwritable:
        return found
    return None


def hold(engine: Engine, notifier: Notifier, reason: str, floor: int) -> bool:
    """Hold the job until the home can be written again (True: hand over to a fresh
    controller) or the controller is told to exit (False). A cancel comes through the
    store, or, when not even its flag can be written, as SIGUSR1 (``cancel_requested``)."""
    store, job_id = engine.store, engine.job_id
    since = time.time()
    log.error("cannot write: %s; paused: the workers go on and their output waits in the "
              "agents' spools (spool_max_bytes) until there is room again", reason)
    for node in engine.nodes:
        engine.pool.send(node, C.Spool())
    notifier.event("paused", f"paused: cannot write {reason}; the workers go on, their "
                   "output waits on their nodes", f"{since:.0f}", reason=reason, since=since)
    store.note_pause(job_id, {"since": since, "reason": reason})
    stopping = False
    next_look = 0.0
    while True:
        engine.pool.main_tick = time.monotonic()  # the pinger keeps the agents attached
        for event in engine.loop.poll(0.5):
            _on_event(engine, event, stopping)
        if time.monotonic() < next_look and not engine.exit_requested:
            continue
        next_look = time.monotonic() + LOOK_EVERY
        _reconnect_silent(engine)
        try:
            cancelled = store.job_state(job_id)[1] or engine.cancel_requested
        except Exception:  # noqa: BLE001 (a home gone: reading fails too; look again)
            cancelled = engine.cancel_requested
        if cancelled and not stopping:
            log.warning("cancel requested while paused: every agent stops its workers; the "
                        "job is recorded CANCELLED once the home can be written")
            stopping = True
            for node in engine.nodes:
                engine.pool.send(node, C.Shutdown())
        if engine.exit_requested and not cancelled:
            return False
        try:
            if not store.room_again(job_id, floor):
                continue
            if stopping:  # the next controller must know: it records the cancel
                store.request_cancel(job_id)
        except StoreUnwritable:
            continue
        log.warning("paused from %s to now (%s): the home can be written again; a fresh "
                    "controller carries on", time.strftime("%H:%M:%S", time.localtime(since)),
                    reason)
        return True


def _reconnect_silent(engine: Engine) -> None:
    """A channel silent for node_timeout (its link cut: nothing ends it) is let go and the
    node's agent reached again, as one that ended."""
    now = time.monotonic()
    for node in engine.nodes:
        channel = node.channel
        if channel is not None and now - channel.heard > engine.spec.health.node_timeout:
            engine.pool.drop_channel(node)
            engine.pool.connect(node, launch=False, retry=True)


def _on_event(engine: Engine, event: E.Event, stopping: bool) -> None:
    """While holding: channels that attach are told to spool too (or, after a cancel, to
    shut down); a channel that ends is let go and its agent reached again (never launched):
    a pause lasts as long as the disk stays full, and an agent left without a controller
    stops its workers after controller_grace. Messages are left to the agents, which keep
    every one not acknowledged and replay it to the next controller."""
    match event:
        case E.Attached(index, channel):
            node = engine.nodes[index]
            engine.pool.settled(node)
            engine.pool.adopt(node, channel)
            engine.pool.send(node, C.Shutdown() if stopping else C.Spool())
        case E.Unavailable(index):
            engine.pool.settled(engine.nodes[index])  # the next controller tries it again
        case E.Closed(channel):
            node = engine.nodes[channel.node_index]
            if node.channel is channel:
                engine.pool.drop_channel(node)
                engine.pool.connect(node, launch=False, retry=True)
