"""The controller's checkpoint is written while its loop turns (orchestrator/keeper.py): lines
that arrive during the write wait for the next cut, the record names only what was written,
and the agents are told only what was recorded. And an agent that just said something sends
no heartbeat (agents/agent.py)."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest

from agents import protocol as P
from agents.agent import Agent
from orchestrator import keeper as K
from orchestrator.logfiles import LogSink, SinkCut
from orchestrator.nodebook import NodeBook


def numbers(path):
    """The line numbers in a rank's log or (after its ``[host:label]`` prefix) combined.log."""
    found = (re.fullmatch(r"(?:\[h:0\] )?line (\d+)", ln)
             for ln in path.read_text().splitlines())
    return [int(m.group(1)) for m in found if m]


def cut_count(path):
    marker = [ln for ln in path.read_text().splitlines() if ln.startswith("[orchestrator]")]
    return int(marker[0].split()[1]) if marker else 0


def test_lines_written_while_a_cut_is_written_land_once_and_a_crash_at_the_cut_replays_them(
        tmp_path):
    """A capped log that starts and drops segments while its cuts are written on another
    thread: every line once, in order; a controller that dies after a cut's record finds the
    files cut back to it, and the agents' replay of what came after lands once too."""
    sink = LogSink(tmp_path, cap=4096, ranks=2)
    written, recorded = 0, None
    for _round in range(12):
        for _ in range(150):  # lines before the cut
            sink.write("h", "0", "stdout", [f"line {written}"])
            written += 1
        cut = sink.cut()
        state = sink.state()
        writer = threading.Thread(target=cut.write)
        writer.start()
        for _ in range(150):  # lines that arrive while it is written: the next cut's
            sink.write("h", "0", "stdout", [f"line {written}"])
            written += 1
        writer.join()
        assert cut.done.is_set()
        if _round == 6:
            recorded = (cut.sizes, state, written - 150)  # what the record would hold
    sink.close()
    for name in ("rank-0.log", "combined.log"):
        got = numbers(tmp_path / name)
        assert got == sorted(set(got)) and got[-1] == written - 1, name
        assert len(got) + cut_count(tmp_path / name) == written, name

    # The controller died after round 6's record: the next one opens at its sizes and
    # state, and the agents replay everything after the lines that record held.
    other = tmp_path / "again"
    other.mkdir()
    sink = LogSink(other, cap=4096, ranks=2)
    for i in range(written):
        sink.write("h", "0", "stdout", [f"line {i}"])
        if i == 6 * 300 + 150 - 1:
            cut = sink.cut()
            state = sink.state()
            threading.Thread(target=cut.write).start()
        if i == 6 * 300 + 299:  # written meanwhile: the files hold more than the record
            cut.done.wait()
            sizes, kept = cut.sizes, i + 1 - 150
            break
    assert kept == recorded[2]
    again = LogSink(other, sizes, cap=4096, ranks=2, state=state)
    for i in range(kept, written):
        again.write("h", "0", "stdout", [f"line {i}"])
    again.close()
    got = numbers(other / "rank-0.log")
    assert got == sorted(set(got)) and got[-1] == written - 1
    assert len(got) + cut_count(other / "rank-0.log") == written


class _Attempt:
    number = 1
    warm_started: set[int] = set()

    def __init__(self, sink):
        self.sink = sink

    def snapshot(self, logs):
        return {"logs": logs, "log_state": self.sink.state()}


class _Book:
    kept = NodeBook.kept

    def __init__(self, n):
        self.nodes = [SimpleNamespace(index=i, received=0, acked=0, numbering=0)
                      for i in range(n)]


def test_the_record_waits_for_the_files_and_the_acks_for_the_record(tmp_path, monkeypatch):
    release, writing = threading.Event(), threading.Event()
    real_write = SinkCut.write

    def slow_write(cut):
        writing.set()
        release.wait(10)
        real_write(cut)

    monkeypatch.setattr(SinkCut, "write", slow_write)
    records, acks = [], []

    class Store:
        def checkpoint(self, job_id, attempt, state, acked, warm_starts):
            assert release.is_set(), "recorded before its files were written"
            records.append((state["logs"], dict(acked)))

    book = _Book(2)
    keeper = K.Keeper(Store(), "job-1", book, lambda node, cmd: acks.append(
        (node.index, cmd.seq)))
    attempt = _Attempt(LogSink(tmp_path))
    attempt.sink.write("h", "0", "stdout", ["line 0"])
    book.nodes[0].received = book.nodes[1].received = 5
    started = time.monotonic()
    keeper.checkpoint(attempt, None, dict)
    assert time.monotonic() - started < 5 and writing.wait(5)  # the loop went on
    assert not records and not acks
    # Meanwhile: more messages from node 0, and node 1's agent was replaced (another one
    # numbers its messages from 1): its old numbers must not be acknowledged to the new one.
    attempt.sink.write("h", "0", "stdout", ["line 1"])
    book.nodes[0].received = 9
    book.nodes[1].received, book.nodes[1].acked, book.nodes[1].numbering = 2, 0, 1
    keeper.checkpoint(attempt, None, dict)  # still being written: nothing yet
    assert not records
    release.set()
    deadline = time.monotonic() + 10
    while not records and time.monotonic() < deadline:
        keeper.checkpoint(attempt, None, dict)
        time.sleep(0.01)
    assert records[0] == ({"rank-0.log": 7, "combined.log": 13}, {0: 5, 1: 0})
    assert acks == [(0, 5)]  # node 0 up to the cut, not the 9 handled since
    assert book.nodes[0].acked == 5 and book.nodes[1].acked == 0
    keeper.checkpoint(attempt, None, dict, force=True)  # the rest, at once
    assert records[-1] == ({"rank-0.log": 14, "combined.log": 26}, {0: 9, 1: 2})
    assert acks[-2:] == [(0, 9), (1, 2)]


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


def test_a_failed_write_still_settles_every_sink_and_raises_at_the_record(tmp_path,
                                                                          monkeypatch):
    """A disk error while a checkpoint is written is the controller's to raise (crash-only,
    or a pause), and no sink is left waiting for a write nobody will do: both close."""
    before, current = LogSink(tmp_path / "1"), LogSink(tmp_path / "2")
    real_write = SinkCut.write

    def failing(cut):
        if cut.sink is before:
            cut.abandon()
            raise OSError(28, "No space left on device")
        real_write(cut)

    monkeypatch.setattr(SinkCut, "write", failing)

    class Store:
        def checkpoint(self, *args):
            raise AssertionError("recorded after a failed write")

    book = _Book(1)
    book.nodes[0].received = 3
    keeper = K.Keeper(Store(), "job-1", book, lambda node, cmd: None)
    previous, attempt = _Attempt(before), _Attempt(current)
    previous.sink.write("h", "0", "stdout", ["late"])
    attempt.sink.write("h", "0", "stdout", ["line 0"])
    keeper.checkpoint(attempt, previous, dict)
    deadline = time.monotonic() + 10
    with pytest.raises(OSError, match="No space"):
        while time.monotonic() < deadline:
            keeper.checkpoint(attempt, previous, dict)
            time.sleep(0.01)
    assert book.nodes[0].acked == 0
    before.close()
    current.close()  # (would wait forever for a part nobody writes)
    assert (tmp_path / "2" / "rank-0.log").read_text() == "line 0\n"
