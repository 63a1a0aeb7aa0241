"""The controller's checkpoint: what it has handled, recorded at one moment, and only then
acknowledged to the agents, which forget it.

A checkpoint is cut on the loop's thread in one go: each open attempt's log sizes once the
lines waiting now are written (logfiles.LogSink.cut), the attempt's exits and failure, and
every node's last message handled. Its files are written and synced on a thread of its own
while the loop goes on turning (lines that arrive meanwhile wait for the next cut); a later
turn records it in the store and acknowledges it to the agents. So the loop never waits on
the disk for it: a 4,000-rank job's first checkpoint creates and syncs 4,000 files, seconds
on a busy machine, during which a loop that waited heard nobody (benchmarks/scale.md). A
controller that dies before the record leaves the checkpoint before it, whose sizes its
successor cuts the files back to, and the agents replay everything after what that one
acknowledged. One checkpoint at a time; ``force`` records the one being written and takes
and writes another at once (an attempt's end, a shutdown: every line kept before the
agents are let go).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from agents import commands as C
from orchestrator.attempt import Attempt
from orchestrator.logfiles import SinkCut
from orchestrator.nodebook import Node, NodeBook
from orchestrator.store import Store

CHECKPOINT_EVERY = 0.05  # seconds between checkpoints while messages arrive

_writer: ThreadPoolExecutor | None = None


def _writer_thread() -> ThreadPoolExecutor:
    """The thread that writes checkpoints' files (made at first use: never before the
    supervisor forks the controller)."""
    global _writer
    if _writer is None:
        _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
    return _writer


class _Cut:
    """One checkpoint, from its cut to its record."""

    def __init__(self, attempt: int, state: dict[str, Any], sinks: list[SinkCut],
                 received: dict[int, tuple[int, int]], warm_starts: int):
        self.attempt, self.state, self.sinks = attempt, state, sinks
        self.received = received  # node index -> (its numbering, last message handled)
        self.warm_starts = warm_starts
        self.began = time.monotonic()
        self.future: Future[None] | None = None

    def write(self) -> None:
        """Every sink's part, even when one fails (a sink waits for its part to be done
        before it closes): then the first error."""
        error: BaseException | None = None
        for sink in self.sinks:  # the attempt before's late lines first
            try:
                sink.write()
            except BaseException as exc:  # noqa: BLE001 (raised below)
                error = error or exc
        if error is not None:
            raise error

    def written(self) -> bool:
        return self.future is None or self.future.done()


class Keeper:
    """Takes the controller's checkpoints (see the module's docstring); the engine calls
    :meth:`checkpoint` on every turn."""

    def __init__(self, store: Store, job_id: str, book: NodeBook,
                 send: Callable[[Node, C.Command], object]):
        self.store, self.job_id, self.book, self._send = store, job_id, book, send
        self._cut: _Cut | None = None  # being written
        self._recorded = 0.0
        # A checkpoint syncs every log written since the last one: with thousands of ranks
        # that is most of them, so its writer may be busy at most a fifth of the time.
        self._every = CHECKPOINT_EVERY

    def checkpoint(self, current: Attempt, previous: Attempt | None,
                   more: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Record the checkpoint being written once it is; take the next when one is due
        (messages handled since the last, ``CHECKPOINT_EVERY`` or more ago) or ``force``d.
        ``more``: what else the record holds of the attempt."""
        cut = self._cut
        if cut is not None:
            if not (force or cut.written()):
                return
            self._record(cut)
        nodes = self.book.nodes
        if not force and (time.monotonic() - self._recorded < self._every
                          or not any(n.received > n.acked for n in nodes)):
            return
        sinks = [previous.sink.cut()] if previous is not None else []
        try:
            sink = current.sink.cut()
            sinks.append(sink)
            cut = _Cut(current.number, {**current.snapshot(sink.sizes), **more()}, sinks,
                       {n.index: (n.numbering, n.received) for n in nodes},
                       len(current.warm_started))
        except BaseException:
            for taken in sinks:  # written by nobody: their sinks must not wait for them
                taken.abandon()
            raise
        if force:
            cut.write()
            self._record(cut)
        else:
            self._cut = cut
            cut.future = _writer_thread().submit(cut.write)

    def _record(self, cut: _Cut) -> None:
        """Once its files are on disk: the record, then the acknowledgements."""
        self._cut = None
        if cut.future is not None:
            cut.future.result()  # its writer's error is the controller's (crash-only)
        acked = {}
        for node in self.book.nodes:  # an agent that came since numbers its messages anew
            numbering, received = cut.received[node.index]
            acked[node.index] = received if numbering == node.numbering else node.acked
        self.store.checkpoint(self.job_id, cut.attempt, cut.state, acked, cut.warm_starts)
        self._recorded = time.monotonic()
        self._every = max(CHECKPOINT_EVERY, 4 * (self._recorded - cut.began))
        for node in self.book.kept(acked):
            self._send(node, C.Ack(node.acked))
