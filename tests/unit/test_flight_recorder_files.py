"""The agent's hands on flight recorder dumps (agents/stacks.py, ``read_trace`` in
agents/ops.py), against what a worker can leave where its dump goes: a symlink to a file it
should not see, a directory swapped for a symlink, a sparse file, a FIFO. Real files on disk,
the agent's functions called directly."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents import commands as C
from agents import ops, paths, stacks
from agents import protocol as P

MIB = 1024 * 1024


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(this attempt's traces directory, the agent's stack directory) under a home of the
    test's own."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    traces_dir = Path(paths.traces()) / "job-1" / "attempt-1"
    traces_dir.mkdir(parents=True, mode=0o700)
    stack_dir = tmp_path / "agent" / "attempt-1"
    stack_dir.mkdir(parents=True)
    return traces_dir, stack_dir


def within(seconds: float, call: Any) -> Any:
    """``call()`` on a thread: what it returned, or its exception re-raised; a call still
    blocked after ``seconds`` fails the test (a FIFO opened for reading blocks forever)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", call()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    how, value = out[0]
    if how == "raised":
        raise value
    return value


def collect(traces_dir: Path, stack_dir: Path, ranks: list[int]) -> Any:
    """trace_files as the agent calls it on a hang, every rank's dump said complete."""
    since = time.time()
    for rank in ranks:
        (stack_dir / f"flight-recorder-done-{rank}").touch()
    return within(20, lambda: stacks.trace_files(str(traces_dir), str(stack_dir), ranks,
                                                 since, time.monotonic() + 5))


def dump_path(traces_dir: Path, rank: int) -> Path:
    return traces_dir / f"nccl_trace_rank_{rank}"


def kept(traces_dir: Path, rank: int) -> Path:
    return traces_dir / "on-hang" / f"nccl_trace_rank_{rank}"


# --- symlinks: never followed, in the dump's name or in a directory on the way -------------------

def test_a_dump_that_is_a_symlink_is_refused_not_followed(dirs, tmp_path):
    traces_dir, stack_dir = dirs
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:TOP-SECRET-HASH")
    dump_path(traces_dir, 0).symlink_to(secret)
    dump_path(traces_dir, 1).write_bytes(b"rank one's dump")
    found, refused = collect(traces_dir, stack_dir, [0, 1])
    assert not os.path.lexists(kept(traces_dir, 0))
    assert found == {"1": str(kept(traces_dir, 1))}
    assert kept(traces_dir, 1).read_bytes() == b"rank one's dump"
    assert list(refused) == ["0"] and "nccl_trace_rank_0 is a symlink" in refused["0"], refused


def test_a_dump_hard_linked_to_another_file_is_refused(dirs, tmp_path):
    traces_dir, stack_dir = dirs
    other = tmp_path / "other"
    other.write_bytes(b"someone else's file")
    os.link(other, dump_path(traces_dir, 0))
    result = collect(traces_dir, stack_dir, [0])
    assert not os.path.lexists(kept(traces_dir, 0))
    found, refused = result
    assert found == {}
    assert "2 links" in refused["0"], refused


def test_a_traces_directory_swapped_for_a_symlink_is_not_followed(dirs, tmp_path):
    traces_dir, stack_dir = dirs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "nccl_trace_rank_0").write_bytes(b"not a dump of this job")
    traces_dir.rmdir()
    traces_dir.symlink_to(elsewhere)
    result = collect(traces_dir, stack_dir, [0])
    assert sorted(os.listdir(elsewhere)) == ["nccl_trace_rank_0"]  # nothing made there
    found, refused = result
    assert found == {}
    assert "attempt-1 is not a directory" in refused["0"], refused


def test_a_copy_is_never_written_through_a_symlink(dirs, tmp_path):
    traces_dir, stack_dir = dirs
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (traces_dir / "on-hang").mkdir()
    kept(traces_dir, 0).symlink_to(victim)  # the copy's name, made first by a worker
    dump_path(traces_dir, 0).write_bytes(b"rank zero's dump")
    result = collect(traces_dir, stack_dir, [0])
    assert victim.read_bytes() == b"precious"
    found, refused = result
    assert found == {"0": str(kept(traces_dir, 0))} and refused == {}
    assert not kept(traces_dir, 0).is_symlink()
    assert kept(traces_dir, 0).read_bytes() == b"rank zero's dump"
    # and a kept directory that is a symlink is refused, not written into
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kept(traces_dir, 0).unlink()
    (traces_dir / "on-hang").rmdir()
    (traces_dir / "on-hang").symlink_to(elsewhere)
    result = collect(traces_dir, stack_dir, [0])
    assert os.listdir(elsewhere) == []
    found, refused = result
    assert found == {}
    assert "on-hang is not a directory" in refused["0"], refused


# --- sparse files: copied with their holes; a dump over the bound is left where it is ------------

def test_a_sparse_dump_is_copied_with_its_holes(dirs):
    traces_dir, stack_dir = dirs
    size = 64 * MIB
    with open(dump_path(traces_dir, 0), "wb") as f:
        f.write(b"head")
        f.seek(size // 2)
        f.write(b"middle")
        f.truncate(size)
    if os.stat(dump_path(traces_dir, 0)).st_blocks * 512 >= MIB:
        pytest.skip("this filesystem keeps no holes")
    result = collect(traces_dir, stack_dir, [0])
    copy = os.stat(kept(traces_dir, 0))
    assert copy.st_size == size
    assert copy.st_blocks * 512 < MIB, f"{copy.st_blocks * 512} bytes on disk"
    assert kept(traces_dir, 0).read_bytes() == dump_path(traces_dir, 0).read_bytes()
    assert result == ({"0": str(kept(traces_dir, 0))}, {})


def test_a_dump_over_the_bound_is_refused_and_left_where_its_rank_wrote_it(dirs):
    traces_dir, stack_dir = dirs
    with open(dump_path(traces_dir, 0), "wb") as f:
        f.truncate(64 * MIB + 1)  # sparse: nothing on disk, 64 MiB to read and keep
    dump_path(traces_dir, 1).write_bytes(b"small")
    result = collect(traces_dir, stack_dir, [0, 1])
    assert not os.path.lexists(kept(traces_dir, 0)) and dump_path(traces_dir, 0).exists()
    assert stacks.TRACE_MAX_BYTES == 64 * MIB
    found, refused = result
    assert found == {"1": str(kept(traces_dir, 1))}
    assert "more than the 64 MiB" in refused["0"], refused
    assert str(dump_path(traces_dir, 0)) in refused["0"], refused


# --- a FIFO: refused for its rank only, and nothing blocks ----------------------------------------

def test_a_fifo_is_refused_for_its_rank_only_and_never_blocks(dirs):
    traces_dir, stack_dir = dirs
    os.mkfifo(dump_path(traces_dir, 0))
    dump_path(traces_dir, 1).write_bytes(b"rank one's dump")
    found, refused = collect(traces_dir, stack_dir, [0, 1])
    assert found == {"1": str(kept(traces_dir, 1))}
    assert list(refused) == ["0"] and "is a FIFO" in refused["0"], refused


class FakeAgent:
    """What op_stacks and op_read_trace use of an agent."""

    def __init__(self, directory: Path, traces_dir: Path, workers: list[Any]):
        self.directory, self.traces_dir = str(directory), str(traces_dir)
        self.attempt, self.token, self.workers = 1, "ab" * 16, workers
        self.replies: list[P.Reply] = []

    def reply(self, reply: P.Reply) -> None:
        self.replies.append(reply)


class Worker:
    def __init__(self, rank: int):
        self.rank = rank
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_fifo_loses_no_rank_s_stacks_reply(dirs, monkeypatch):
    traces_dir, stack_dir = dirs
    monkeypatch.setenv("ORCHESTRATOR_PY_SPY", "none")  # no hook either: "none", at once
    os.mkfifo(dump_path(traces_dir, 0))
    dump_path(traces_dir, 1).write_bytes(b"rank one's dump")
    for rank in (0, 1):
        (stack_dir / f"flight-recorder-done-{rank}").touch()
    workers = [Worker(0), Worker(1)]
    try:
        agent = FakeAgent(stack_dir.parent, traces_dir, workers)
        within(30, lambda: ops._stacks(agent, C.GetStacks(3.0, True), 7))  # type: ignore[arg-type]
    finally:
        for w in workers:
            w.proc.kill()
            w.proc.wait()
    [reply] = agent.replies
    assert isinstance(reply, P.Stacks) and sorted(reply.stacks) == [0, 1]
    assert reply.traces == {1: str(kept(traces_dir, 1))}
    assert list(reply.refused) == [0] and "is a FIFO" in reply.refused[0]
    assert P.parse(P.reply_wire(reply, 1)) == reply  # the controller's door takes it


# --- read_trace: the controller's reads, under the same rules ------------------------------------

def read_trace(traces_dir: Path, path: Path) -> P.TraceChunk:
    agent = FakeAgent(traces_dir, traces_dir, [])
    within(10, lambda: ops.op_read_trace(agent, C.ReadTrace(str(path)), 3))  # type: ignore[arg-type]
    [reply] = agent.replies
    assert isinstance(reply, P.TraceChunk)
    return reply


def test_read_trace_sends_a_dump(dirs):
    traces_dir, _ = dirs
    dump_path(traces_dir, 0).write_bytes(b"x" * 10)
    chunk = read_trace(traces_dir, dump_path(traces_dir, 0))
    assert (chunk.data, chunk.size) == (b"x" * 10, 10)


def test_read_trace_never_blocks_on_a_fifo(dirs):
    traces_dir, _ = dirs
    os.mkfifo(dump_path(traces_dir, 0))
    with pytest.raises(PermissionError, match="is a FIFO"):
        read_trace(traces_dir, dump_path(traces_dir, 0))


def test_read_trace_follows_no_symlink_even_inside_the_traces_directory(dirs):
    traces_dir, _ = dirs
    other = traces_dir.parent / "attempt-2"
    other.mkdir()
    (other / "nccl_trace_rank_0").write_bytes(b"another attempt's file")
    dump_path(traces_dir, 0).symlink_to(other / "nccl_trace_rank_0")
    with pytest.raises(PermissionError, match="is a symlink"):
        read_trace(traces_dir, dump_path(traces_dir, 0))
    swapped = traces_dir.parent / "attempt-3"
    swapped.symlink_to(other)
    with pytest.raises(PermissionError, match="attempt-3 is not a directory"):
        read_trace(traces_dir, swapped / "nccl_trace_rank_0")
    with pytest.raises(PermissionError, match="not a flight recorder dump"):
        read_trace(traces_dir, traces_dir / ".." / ".." / ".." / "secret")


# --- the controller: a refused dump is said, with its node and why -----------------------------

def test_the_controller_names_a_refused_dump_with_its_node_and_why(tmp_path):
    from types import SimpleNamespace

    from orchestrator import hang, render

    def ask_all(channels, request, timeout):
        if isinstance(request, C.ReadTrace):
            return {key: P.TraceChunk(1, b"dump", 4) for key in channels}
        return {0: P.Stacks(1, {0: P.Stack("py-spy", "a"), 1: P.Stack("py-spy", "b")},
                            {1: "/t/on-hang/nccl_trace_rank_1"},
                            {0: "nccl_trace_rank_0 is a FIFO, not a regular file: refused"})}

    found = hang.collect({0: SimpleNamespace(closed=False)}, {0: "node-a"},  # type: ignore[dict-item]
                         ask_all, flight_recorder=True)
    recorder = hang.fetch_dumps(found, tmp_path / "fr", ask_all)
    assert recorder is not None and recorder["ranks"] == [1]
    assert recorder["refused"] == {
        "0": "node-a: nccl_trace_rank_0 is a FIFO, not a regular file: refused"}
    shown = render.summary_line({"job_id": "j", "state": "FAILED", "failure": {
        "cause": "HUNG", "message": "m", "flight_recorder": recorder}})
    assert ("flight recorder dump of rank 0 refused by its node, node-a: nccl_trace_rank_0 "
            "is a FIFO") in shown
