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


class Clock:
    """Fake time for the heartbeat thread: its sleeps pass at once, and what else the agent
    "sent" (at the times in ``talks``) moves the outbox's ``sent_at`` as the time passes."""

    def __init__(self, outbox, talks: list[float], end: float):
        self.now, self.outbox, self.talks, self.end = 0.0, outbox, sorted(talks), end

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 1e-6)  # a real sleep always takes some time
        while self.talks and self.talks[0] <= self.now:
            self.outbox.sent_at = self.talks.pop(0)
        self.outbox.closed = self.now >= self.end


def beats(monkeypatch, talks: list[float], notice=None) -> list[float]:
    """When an agent with a period of 0.5 s sends heartbeats over 10 s (0.5 to 10.0) while
    it also says what ``talks`` says."""
    sent: list[float] = []

    class Outbox:
        sent_at = -1.0
        closed = False

        def current(self):
            return object()

        def put(self, message):
            assert message["type"] == P.HEARTBEAT and message["attempt"] == 3
            sent.append(clock.now)
            self.sent_at = clock.now

        def detach(self, conn):
            raise AssertionError("the controller was heard from")

    outbox = Outbox()
    clock = Clock(outbox, talks, end=10.0)
    monkeypatch.setattr("agents.agent.time", clock)
    agent = SimpleNamespace(outbox=outbox, heartbeat_interval=0.5, node_timeout=60.0,
                            last_heard=1e9, notice=notice, attempt=3)
    Agent._beat(agent)  # type: ignore[arg-type]
    return sent


def longest_silence(messages: list[float]) -> float:
    times = sorted([0.0, *messages, 10.0])
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def test_a_quiet_agent_beats_once_a_period(monkeypatch):
    sent = beats(monkeypatch, talks=[])
    assert len(sent) == 20 and longest_silence(sent) <= 0.5 + 1e-5, sent


def test_talk_takes_the_place_of_heartbeats_but_never_leaves_a_period_of_silence(monkeypatch):
    """Output just after each beat used to put off the next beat by a whole period: two
    periods of silence, past what a controller waits before it calls a node UNREACHABLE
    (1.5 periods) at the slightest delay. The next beat is due a period after the last
    message of any kind."""
    talks = [0.51, 0.8, 1.1, 1.4, 1.7, 2.0, 2.3, 2.6, 6.0, 6.1, 6.2]
    sent = beats(monkeypatch, talks=talks)
    assert longest_silence(sent + talks) <= 0.5 + 1e-5, (sent, talks)
    assert len(sent) < 20  # the talk said the node is alive: fewer beats
    assert not [t for t in sent if 0.51 < t < 2.6 + 0.5 - 1e-5], sent  # none while it talked


def test_a_notice_rides_on_every_beat_however_much_the_agent_says(monkeypatch):
    notice = P.Notice("SIGTERM", time.time() + 60)
    talks = [i / 10 for i in range(1, 100)]  # talking all the time
    assert len(beats(monkeypatch, talks=talks, notice=notice)) == 20


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


def test_a_sigterm_just_after_the_relay_went_is_still_a_notice(tmp_path):
    """A Slurm allocation's signal reaches every step at once: the relay's dies, and its
    channel can be gone before the agent reads the SIGTERM. A hot spare's agent then took
    no notice and left at once (its transport started another: an ordinary spare). A
    controller attached a moment ago still counts; one never attached, or long gone, not."""
    from agents.agent import _notice
    from agents.outbox import Outbox

    outbox = Outbox(str(tmp_path / "spool"), None)
    agent = SimpleNamespace(config=SimpleNamespace(sigterm_to_workers=False), workers=[],
                            outbox=outbox, stop_grace=30.0)
    assert _notice(agent, signal.SIGTERM) is None  # never attached: it leaves at once
    outbox._attached_once, outbox.detached_since = True, time.monotonic() - 1.0
    notice = _notice(agent, signal.SIGTERM)
    assert notice is not None and notice.source == "SIGTERM to the agent"
    outbox.detached_since = time.monotonic() - 60.0
    assert _notice(agent, signal.SIGTERM) is None
