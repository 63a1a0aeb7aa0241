"""Liveness without false alarms, and without late ones: an agent that just said something
sends no heartbeat (agents/agent.py), and the controller forgives nodes' silence only for
the time its whole process was not running, not for a loop that was only busy
(orchestrator/engine.py: Ticker)."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from agents import protocol as P
from agents.agent import Agent
from orchestrator.engine import Ticker


def test_an_agent_that_just_said_something_sends_no_heartbeat_unless_it_has_a_notice():
    sent: list[dict] = []
    turns = iter(range(6))

    class Outbox:
        sent_at = 0.0

        @property
        def closed(self):
            return next(turns, None) is None

        def current(self):
            return object()

        def put(self, message):
            sent.append(message)

        def detach(self, conn):
            raise AssertionError("the controller was heard from")

    agent = SimpleNamespace(outbox=Outbox(), heartbeat_interval=0.01, node_timeout=60.0,
                            last_heard=time.monotonic(), notice=None, attempt=3)

    def beat(talking: bool, notice=None) -> int:
        nonlocal turns
        sent.clear()
        turns = iter(range(5))
        agent.notice = notice
        agent.outbox.sent_at = time.monotonic() + (60 if talking else -60)
        Agent._beat(agent)  # type: ignore[arg-type]
        return len(sent)

    assert beat(talking=False) == 5  # quiet: one every period
    assert beat(talking=True) == 0  # its output said it is alive
    notice = P.Notice("SIGTERM", time.time() + 60)
    assert beat(talking=True, notice=notice) == 5  # a notice always goes


def test_a_busy_loop_is_not_a_stopped_process():
    """The loop's thread busy (here: blocked, as in a checkpoint's fsyncs, and then
    holding the GIL) while the rest of the process runs: nothing to forgive."""
    ticker = Ticker()
    ticker.start()
    try:
        since = time.monotonic()
        time.sleep(1.0)  # blocked
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # busy in Python
            pass
        assert ticker.stopped(since, time.monotonic()) == 0.0
    finally:
        ticker.close()


def test_a_stopped_process_is_forgiven_the_time_it_was_stopped():
    """SIGSTOP for 1.5 s (a paused VM, a long swap): the ticks say so, also when the loop
    looks before the ticker had its first tick after the SIGCONT."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own ticker; reports what it saw
        try:
            os.close(read)
            ticker = Ticker()
            ticker.start()
            since = time.monotonic()
            time.sleep(0.3)
            os.write(write, b"ready\n")
            deadline = time.monotonic() + 10
            while time.monotonic() - since < 2.5 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.write(write, f"{ticker.stopped(since, time.monotonic()):.3f}\n".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read) as f:
            assert f.readline() == "ready\n"
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(pid, signal.SIGCONT)
            stopped = float(f.readline())
    finally:
        os.kill(pid, signal.SIGCONT)
        os.waitpid(pid, 0)
    assert 1.0 <= stopped <= 2.0, stopped


def test_a_stop_not_yet_ticked_counts_up_to_now():
    ticker = Ticker()  # never started (an engine run without a controller): cautious
    ticker.close()
    time.sleep(0.2)  # no ticks any more: the ticker itself is "late"
    now = time.monotonic()
    assert ticker.stopped(now - 10.0, now + 1.0) >= 1.0
