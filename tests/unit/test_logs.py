"""Log files: the cap that keeps the head and the tail, exact truncation to a checkpoint,
and the free-space guard."""

from __future__ import annotations

import os

import pytest

from orchestrator.attempt import LogSink


def lines(path):
    return path.read_text().splitlines()


def test_capped_log_keeps_head_and_tail_and_says_how_much_was_cut(tmp_path):
    sink = LogSink(tmp_path, cap=4096)
    for i in range(2000):  # 2000 lines of 8 to 10 bytes: far over the cap
        sink.write("h", "0", "stdout", [f"line {i}"])
    sink.close()
    kept = lines(tmp_path / "rank-0.log")
    marker = [ln for ln in kept if ln.startswith("[orchestrator] ")]
    assert len(marker) == 1 and "cut here" in marker[0]
    cut = int(marker[0].split()[1])
    numbers = [int(ln.split()[1]) for ln in kept if ln.startswith("line ")]
    assert numbers[0] == 0 and numbers[-1] == 1999  # the head and the very end are kept
    assert len(numbers) + cut == 2000 and numbers == sorted(numbers)
    head = numbers[:numbers.index(numbers[0]) + 1]
    assert head and (tmp_path / "rank-0.log").stat().st_size <= 4096 + 200
    assert not list(tmp_path.glob("*.tail*.log"))


def test_uncapped_log_keeps_everything(tmp_path):
    sink = LogSink(tmp_path, cap=None)
    sink.write("h", "1", "stderr", [f"l{i}" for i in range(10000)])
    sink.close()
    assert lines(tmp_path / "rank-1.log") == [f"l{i}" for i in range(10000)]
    assert len(lines(tmp_path / "combined.log")) == 10000


def test_reopening_at_a_checkpoint_writes_each_line_once(tmp_path):
    sink = LogSink(tmp_path, cap=4096)
    for i in range(300):
        sink.write("h", "0", "stdout", [f"line {i}"])
    sizes, state = sink.flush(), sink.state()
    for i in range(300, 700):  # written after the checkpoint: the agent will replay these
        sink.write("h", "0", "stdout", [f"line {i}"])
    sink.flush()  # the controller dies here
    again = LogSink(tmp_path, sizes, cap=4096, state=state)
    for i in range(300, 1000):
        again.write("h", "0", "stdout", [f"line {i}"])
    again.close()
    kept = lines(tmp_path / "rank-0.log")
    numbers = [int(ln.split()[1]) for ln in kept if ln.startswith("line ")]
    cut = int(next(ln for ln in kept if ln.startswith("[orchestrator]")).split()[1])
    assert len(numbers) == len(set(numbers)) and numbers == sorted(numbers)
    assert len(numbers) + cut == 1000 and numbers[-1] == 999


def test_below_min_free_a_sink_raises_enospc_and_writes_nothing(tmp_path):
    """Lines are never dropped for want of space: the controller pauses instead (its
    agents keep the lines) until there is room (orchestrator/pause.py)."""
    import errno

    with pytest.raises(OSError) as raised:
        LogSink(tmp_path, min_free=10 ** 18)  # more than any disk has
    assert raised.value.errno == errno.ENOSPC and "logs.min_free_bytes" in str(raised.value)
    assert not list(tmp_path.glob("*.log"))


def accounted(lines_read):
    """Line numbers read, and lines said to be cut, from a reader's output."""
    numbers, cut = [], 0
    for ln in lines_read:
        if ln.startswith("[orchestrator] ") and " cut here" in ln:
            cut += int(ln.split()[1])
        else:
            numbers.append(int(ln.split()[1]))
    return numbers, cut


def test_a_follower_reads_every_line_or_a_marker_counting_it_across_cuts_and_the_close(
        tmp_path):
    from orchestrator.logread import Follower

    sink = LogSink(tmp_path, cap=4096)
    follower, seen = Follower(tmp_path / "rank-0.log"), []
    total = 0
    for burst in range(40):
        # Bursts of different sizes, read in between: some are read as they come, some are
        # cut (their segment dropped) before the reader comes back.
        for _ in range(7 if burst % 3 else 300):
            sink.write("h", "0", "stdout", [f"line {total}"])
            total += 1
        sink.flush()
        sink.state()
        seen += follower.read()
    sink.close()
    seen += follower.read()
    numbers, cut = accounted(seen)
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert len(numbers) + cut == total and numbers[-1] == total - 1
    assert cut > 0 and follower.read() == []
    # Each marker stands exactly where its lines were: numbers before it + its count = next.
    expected = 0
    for ln in seen:
        if ln.startswith("[orchestrator] "):
            expected += int(ln.split()[1])
        else:
            assert int(ln.split()[1]) == expected
            expected += 1


def test_reading_a_cut_log_while_it_runs_and_after_shows_the_marker_with_its_count(tmp_path):
    from orchestrator.logread import Follower, tail_lines

    sink = LogSink(tmp_path, cap=4096)
    for i in range(1500):
        sink.write("h", "0", "stdout", [f"line {i}"])
    sink.flush()
    running = Follower(tmp_path / "rank-0.log").read()
    numbers, cut = accounted(running)
    assert cut > 0 and len(numbers) + cut == 1500 and numbers[-1] == 1499
    last, partial = tail_lines(tmp_path / "rank-0.log", 5, 1 << 20)
    assert [int(ln.split()[1]) for ln in last] == list(range(1495, 1500)) and not partial
    everything, _ = tail_lines(tmp_path / "rank-0.log", 10 ** 6, 1 << 20)
    assert accounted(everything) == (numbers, cut)
    sink.close()
    assert accounted(Follower(tmp_path / "rank-0.log").read()) == (numbers, cut)
    after, _ = tail_lines(tmp_path / "rank-0.log", 10 ** 6, 1 << 20)
    assert accounted(after) == (numbers, cut)


def test_a_filesystem_that_refuses_syncfs_has_every_file_fsynced(tmp_path, monkeypatch):
    """Thousands of files due at once are synced with one syncfs; where that is refused
    (an old kernel, a FUSE mount) each file is fsynced instead (it used to count them as
    synced already, and fsync none)."""
    from orchestrator import logfiles

    monkeypatch.setattr(logfiles, "_syncfs", lambda fd: -1)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(logfiles.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    sink = LogSink(tmp_path, cap=None)
    for rank in range(logfiles.SYNCFS_AT + 10):
        sink.write("h", str(rank), "stdout", ["a line"])
    sink.flush()
    assert len(synced) == logfiles.SYNCFS_AT + 10 + 1  # every rank's log and combined.log
    sink.close()
