"""The controller is crash-only: an error of ours (the store, the disk, a bug) never stops a
worker and is never blamed on a node; and the supervisor's count of its deaths (pure)."""

from __future__ import annotations

import errno
import sqlite3
import time
from collections.abc import Callable

import pytest

from orchestrator import pause
from orchestrator.attempt import Attempt
from orchestrator.controller import Controller
from orchestrator.errors import StoreUnwritable
from orchestrator.spec import parse_jobspec
from orchestrator.state import NodeState
from orchestrator.store import Store, unwritable
from orchestrator.supervisor import BACKOFF, Deaths
from orchestrator.transport.fake import FakeAgent, FakeCluster
from tests.unit.test_controller import SPEC


def fake_job(tmp_path, job_id: str, spec_yaml: str) -> tuple[Store, FakeCluster, Controller]:
    """A job of ``spec_yaml`` recorded in a fresh home, its FakeCluster (workers run until
    stopped) and its controller, not yet run."""
    spec = parse_jobspec(spec_yaml)
    store = Store(tmp_path / "home")
    store.create_job(job_id, spec.name, spec.model_dump_json(), str(tmp_path),
                     spec.max_restarts, [n.host for n in spec.nodes])
    cluster = FakeCluster(heartbeat_interval=0.5, run=True)
    return store, cluster, Controller(store, job_id, spec, str(tmp_path), cluster)


def until(done: Callable[[], bool], deadline: float, every: float = 0.02) -> None:
    """A driver thread's wait: until ``done()`` or the monotonic ``deadline`` (the test
    asserts what came of it afterwards)."""
    while not done() and time.monotonic() < deadline:
        time.sleep(every)


def all_started(controller: Controller) -> Callable[[], bool]:
    return lambda: controller.current is not None and controller.current.all_started


def test_an_error_of_ours_handling_a_nodes_message_stops_no_worker_and_blames_no_node(
        tmp_path, monkeypatch):
    """On main: a sqlite3 error while handling node b's output was taken for a malformed
    message: b was LOST (NODE_FAIL, counted against the host), every worker stopped."""
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000009", "fake", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])
    log: list = []
    exits = {"a": {1: {0: None, 1: None}}, "b": {1: {2: 5, 3: None}}}  # rank 2 prints, exits 5

    def connect(node, _spec):
        return FakeAgent(node.host, exits[node.host], log)

    def broken(self, node_index, message):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(Attempt, "_on_output", broken)
    with pytest.raises(sqlite3.OperationalError):
        Controller(store, "fake-000009", spec, str(tmp_path), connect).run()
    job = store.get_job("fake-000009")
    assert not [n for n in job.nodes if n.state in (NodeState.LOST, NodeState.FAILED)]
    assert job.attempts[0].ended_at is None and job.attempts[0].failure is None
    assert store.host_events(0) == [], "a healthy host was blamed"
    assert not [m for _, m in log if m["op"] in ("stop", "shutdown")], "a worker was stopped"


def test_what_is_a_pause_and_what_is_a_crash(tmp_path, monkeypatch):
    store = Store(tmp_path / "home")
    store.create_job("pause-000001", "p", "{}", str(tmp_path), 0, ["a"])
    home = str(tmp_path / "home")

    def full(floor):
        raise StoreUnwritable(home, "0 bytes free")

    monkeypatch.setattr(store, "check_room", full)  # the home is full now
    log_file = f"{home}/jobs/pause-000001/logs/attempt-1/rank-0.log"
    assert pause.problem(OSError(errno.ENOSPC, "No space left on device", log_file),
                         store, "pause-000001", 1) == f"{log_file}: No space left on device"
    assert "disk is full" in pause.problem(
        StoreUnwritable(f"{home}/state.db", "the disk is full"), store, "pause-000001", 1)
    wrapped = RuntimeError("while checkpointing")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system", home)
    assert "Read-only" in pause.problem(wrapped, store, "pause-000001", 1)
    # A full disk elsewhere (/tmp), or an error of ours, is no pause: a crash.
    for ours in (OSError(errno.ENOSPC, "No space left on device", "/tmp/x"),
                 sqlite3.OperationalError("database is locked"), KeyError("x"),
                 OSError(errno.EMFILE, "Too many open files"), ValueError("bug")):
        assert pause.problem(ours, store, "pause-000001", 1) is None, ours
    monkeypatch.undo()  # the home has room again: what said it was full is gone, no pause
    assert pause.problem(OSError(errno.ENOSPC, "No space left on device", log_file),
                         store, "pause-000001", 1) is None
    full_sqlite = sqlite3.OperationalError("database or disk is full")
    assert unwritable(full_sqlite) and unwritable(KeyError("x")) is None


def test_a_full_store_raises_unwritable_and_keeps_nothing(tmp_path, monkeypatch):
    store = Store(tmp_path / "home")
    store.create_job("full-000001", "full", "{}", str(tmp_path), 0, ["a"])

    real = store._db

    def execute(sql, *args):
        if sql.startswith("UPDATE jobs"):
            error = sqlite3.OperationalError("database or disk is full")
            raise error
        return real.execute(sql, *args)

    monkeypatch.setattr(store, "_db", type("Db", (), {
        "execute": staticmethod(execute), "in_transaction": property(
            lambda _: real.in_transaction)})())
    with pytest.raises(StoreUnwritable, match="disk is full"):
        store.update_job("full-000001", attempt=3)
    assert not real.in_transaction
    assert Store(tmp_path / "home").get_job("full-000001").attempt == 0


def test_deaths_back_off_and_a_repeated_error_is_failing():
    deaths = Deaths()
    assert [deaths.add(t, f"E{t}") for t in range(5)] == list(BACKOFF[:5])
    assert deaths.add(5, "E5") is None  # six deaths in ten minutes
    deaths = Deaths()
    assert deaths.add(0, "same") == BACKOFF[0] and deaths.add(1, "same") == BACKOFF[1]
    assert deaths.add(2, "same") is None  # the same error three times in a row
    deaths = Deaths()
    for t in range(0, 5000, 1000):  # deaths far apart never add up
        assert deaths.add(t, f"E{t}") == BACKOFF[0]


def test_the_same_error_weeks_apart_is_not_a_failing_controller():
    deaths = Deaths()
    week = 7 * 86400.0
    for k in range(5):  # an OOM kill a week, each after the controller ran all week
        assert deaths.add(k * week, "killed by SIGKILL", lived=week) == BACKOFF[0]
    assert deaths.add(5 * week, "killed by SIGKILL", lived=5.0) == BACKOFF[0]
    assert deaths.add(5 * week + 10, "killed by SIGKILL", lived=5.0) is None  # 3 in a row


def test_a_supervisor_whose_job_left_the_home_exits(tmp_path, monkeypatch):
    """A controller that ended after its home was removed (or unmounted, and another one is
    there now) leaves its supervisor with no job to read: it exits, where it used to look
    again every few seconds forever (the full-disk tests left one behind per run)."""
    import threading

    from orchestrator import supervisor

    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    Store().close()
    got: list = []
    looker = threading.Thread(target=lambda: got.append(
        supervisor._job_state("gone-000001", supervisor._Told())), daemon=True)
    looker.start()
    looker.join(10)
    assert got == [None], "still looking for a job the home does not have"


@pytest.mark.parametrize("exits, ends", [
    ({}, "SUCCEEDED"),  # every rank exits 0
    ({"b": {1: {2: 5}}}, "FAILED"),  # rank 2 exits 5, no restart left
])
def test_a_controller_that_dies_as_the_job_ends_leaves_it_ended_not_run_again(
        tmp_path, monkeypatch, exits, ends):
    """Between an attempt's end and the job's (the agents shut down, a Slurm allocation
    given back: seconds), a controller's death, however it came, left a job whose attempt
    had ended and whose state was still RUNNING: the one that took over found no attempt
    open and ran the job again, attempt 2 of a job that had SUCCEEDED (or had no restart
    left). What comes after an attempt is recorded with its end, and a controller that takes
    over acts on it. Found by a reading helper."""
    from orchestrator.engine import Engine, Phase
    from orchestrator.state import JobState

    spec = parse_jobspec(SPEC.replace("max_restarts: 2", "max_restarts: 0"))
    store = Store(tmp_path / "home")
    store.create_job("end-000001", "end", spec.model_dump_json(), str(tmp_path), 0, ["a", "b"])
    log: list = []
    cluster = FakeCluster(log=log, exits=exits)
    checkpoint = Engine.checkpoint

    def dies_as_it_ends(self, force=False):
        if self.phase is Phase.ENDING:
            raise sqlite3.OperationalError("database is locked")
        return checkpoint(self, force)
    monkeypatch.setattr(Engine, "checkpoint", dies_as_it_ends)
    with pytest.raises(sqlite3.OperationalError):
        Controller(store, "end-000001", spec, str(tmp_path), cluster).run()
    monkeypatch.undo()
    assert store.get_job("end-000001").state == JobState.RUNNING  # the end not yet written
    state = Controller(store, "end-000001", spec, str(tmp_path), cluster, resume=True).run()
    job = store.get_job("end-000001")
    assert (state.value, job.state.value, len(job.attempts)) == (ends, ends, 1)
    assert not [m for _, m in log if m.get("op") == "start" and m.get("attempt") == 2]
    assert (job.failure is None) == (ends == "SUCCEEDED")


def died_deciding_a_restart(tmp_path, monkeypatch, job_id: str):
    """A job of SPEC whose attempt 1 fails (rank 2 exits 5) and whose controller dies as it
    writes the restart (RESTARTING): the store, and the cluster its agents live on."""
    from orchestrator.engine import Engine
    from orchestrator.state import JobState

    spec = parse_jobspec(SPEC)  # max_restarts 2
    store = Store(tmp_path / "home")
    store.create_job(job_id, "r", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])
    cluster = FakeCluster(exits={"b": {1: {2: 5}}})
    set_state = Engine.set_state

    def dies_restarting(self, new, **fields):
        if new == JobState.RESTARTING:
            raise sqlite3.OperationalError("database is locked")
        return set_state(self, new, **fields)
    monkeypatch.setattr(Engine, "set_state", dies_restarting)
    with pytest.raises(sqlite3.OperationalError):
        Controller(store, job_id, spec, str(tmp_path), cluster).run()
    monkeypatch.undo()
    return spec, store, cluster


def test_a_controller_that_dies_deciding_a_restart_charges_it_once(tmp_path, monkeypatch):
    """The restart a failure charges was written after the attempt's end: a controller's
    death in between gave the next attempt for free. Now written with the end."""
    from orchestrator.state import JobState

    spec, store, cluster = died_deciding_a_restart(tmp_path, monkeypatch, "restart-000001")
    state = Controller(store, "restart-000001", spec, str(tmp_path), cluster, resume=True).run()
    job = store.get_job("restart-000001")
    assert (state, len(job.attempts), job.restarts) == (JobState.SUCCEEDED, 2, 1)


def test_a_channel_that_ends_during_a_pause_is_reached_again(tmp_path, monkeypatch):
    """A pause lasts as long as the home stays full, hours maybe. A node's channel that
    ended meanwhile (a relay's SSH session dropped) was let go and never reached again, and
    its agent, with no controller, stopped its workers after controller_grace: our full disk
    cost the user their training. Its agent is reached again (never launched). Found by a
    reading helper."""
    import threading

    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("hold-000001", "hold", spec.model_dump_json(), str(tmp_path), 2,
                     ["a", "b"])
    cluster = FakeCluster(run=True)
    opened: list[str] = []

    def connect(node, job_spec):
        opened.append(node.host)
        return cluster(node, job_spec)
    controller = Controller(store, "hold-000001", spec, str(tmp_path), connect)
    full = threading.Event()
    check_room = Store.check_room

    def room(self, floor):
        if full.is_set():
            raise StoreUnwritable(str(self.home), "0 bytes free")
        return check_room(self, floor)
    monkeypatch.setattr(Store, "check_room", room)
    seen: dict[str, object] = {}

    def drive() -> None:
        deadline = time.monotonic() + 30
        until(all_started(controller), deadline)
        full.set()  # the home is full: the controller pauses
        watch = Store(tmp_path / "home")  # a connection of its own: not the controller's
        while watch.get_job("hold-000001").paused is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["paused"] = watch.get_job("hold-000001").paused
        before = opened.count("b")
        cluster.agents["b"].wire.put(None)  # b's channel ends
        while opened.count("b") == before and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["reached again"] = opened.count("b") > before
        full.clear()  # room again: a fresh controller would carry on

    threading.Thread(target=drive, daemon=True).start()
    try:
        controller.run()
    finally:
        cluster.close()
    assert seen.get("paused") and seen.get("reached again"), seen
    assert controller.hand_over


def test_a_node_unreachable_when_its_controller_died_fails_the_attempt_once_lost(
        tmp_path, monkeypatch):
    """A node UNREACHABLE (its host just died) when the controller died: the one that took
    over did not know it had run workers, so losing it failed no attempt; its peers waited
    in their collectives (30 min), and the job then failed as the user's. Now restored with
    where it was, it fails the attempt as NODE_FAIL once lost. Found by a reading helper."""
    import threading

    from orchestrator.engine import Engine
    from orchestrator.state import JobState

    store, cluster, controller = fake_job(
        tmp_path, "gone-000001", "name: gone\nnodes: [{host: a}, {host: b}]\n"
        "command: [train]\nmax_restarts: 0\nlaunch_timeout: 1\n"
        "health: {heartbeat_interval: 0.5, node_timeout: 4, controller_grace: 1}\n")
    spec = controller.spec
    crash = threading.Event()
    checkpoint = Engine.checkpoint

    def dies(self, force=False):
        if crash.is_set():
            raise sqlite3.OperationalError("database is locked")
        return checkpoint(self, force)
    monkeypatch.setattr(Engine, "checkpoint", dies)

    def drive() -> None:
        deadline = time.monotonic() + 30
        until(all_started(controller), deadline)
        cluster.kill("b")
        watch = Store(tmp_path / "home")  # a connection of its own: not the controller's
        while watch.get_job("gone-000001").nodes[1].state != NodeState.UNREACHABLE and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        crash.set()

    threading.Thread(target=drive, daemon=True).start()
    try:
        with pytest.raises(sqlite3.OperationalError):
            controller.run()
        monkeypatch.undo()
        assert store.get_job("gone-000001").nodes[1].state == NodeState.UNREACHABLE
        began = time.monotonic()
        resumed = Controller(store, "gone-000001", spec, str(tmp_path), cluster, resume=True)
        give_up = threading.Timer(20, resumed.request_cancel)  # the old code waits for good
        give_up.daemon = True
        give_up.start()
        state = resumed.run()
        give_up.cancel()
    finally:
        cluster.close()
    failure = store.get_job("gone-000001").attempts[0].failure
    assert state == JobState.FAILED and failure is not None, (state, failure)
    assert (failure["cause"], failure["node_index"]) == ("NODE_FAIL", 1), failure
    assert time.monotonic() - began < 20


def test_an_agent_attached_again_during_a_pause_keeps_its_workers_writing(tmp_path):
    """A pausing controller acknowledges nothing. An agent that attached again during the
    pause replayed its spool and waited there for a window that never opened: its sender
    stopped, the output queue filled, and every worker blocked writing to stdout for as long
    as the pause lasted. Told to spool, the replay stops and the rest waits for the next
    attach. Found by a reading helper."""
    import socket
    import threading
    import time

    from agents import protocol as P
    from agents.outbox import Outbox

    outbox = Outbox(str(tmp_path / "spool"), None)
    outbox.hello = lambda: {"type": P.HELLO}
    threading.Thread(target=outbox.run, daemon=True).start()
    line = "x" * 1000
    for _ in range(6):  # 6 MiB spooled while no controller is attached
        outbox.add_lines(1, 0, "stdout", [line] * 1000)
    deadline = time.monotonic() + 20
    while outbox._lines and time.monotonic() < deadline:
        time.sleep(0.05)
    ours, theirs = socket.socketpair()

    def read_all() -> None:  # the pausing controller reads everything, acknowledges nothing
        while theirs.recv(1 << 20):
            pass
    threading.Thread(target=read_all, daemon=True).start()
    try:
        outbox.attach(ours, 0)
        while outbox.current() is not ours and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # in the spool's replay, at the window
        outbox.spool_while_attached(ours)  # the pause says: spool
        writing = threading.Thread(target=lambda: [
            outbox.add_lines(1, 0, "stdout", [line] * 1000) for _ in range(3)], daemon=True)
        writing.start()
        writing.join(timeout=5)
        assert not writing.is_alive(), "the workers' output blocked behind the replay"
    finally:
        outbox.close()
        ours.close()
        theirs.close()


def test_late_lines_of_the_attempt_that_ended_reach_its_log_after_a_takeover(tmp_path,
                                                                            monkeypatch):
    """An agent cut off while an attempt was stopped replays its lines later, often the
    traceback that explains the failure. A controller that took over after that attempt had
    ended kept no attempt to write them into: they were taken (acknowledged) and written
    nowhere, and nothing counted them. Found by a reading helper."""
    from orchestrator.state import JobState

    spec, store, cluster = died_deciding_a_restart(tmp_path, monkeypatch, "late-000001")
    b = cluster.agents["b"]
    with b.lock:  # said while no controller listened: replayed on the next attach
        b._emit({"type": "output", "attempt": 1, "rank": 2, "stream": "stderr",
                 "lines": ["Traceback (late)"]})
    state = Controller(store, "late-000001", spec, str(tmp_path), cluster, resume=True).run()
    assert state == JobState.SUCCEEDED
    log = store.log_dir("late-000001", 1)
    text = "".join(p.read_text() for p in log.rglob("*") if p.is_file())
    assert "Traceback (late)" in text, sorted(p.name for p in log.rglob("*"))


def test_the_attempt_a_controller_takes_over_keeps_the_step_its_ranks_resume(tmp_path):
    """The attempt restored at a takeover was made without its checkpoint settings: the step
    its ranks resume was None, so a drained node out of the job was told to let go of its
    memory while the ranks that took its place were still pulling their copies from it (a
    move's next attempt: their loads failed), and the steps it redid counted from nothing.
    Found by a reading helper."""
    from types import SimpleNamespace

    from orchestrator import takeover

    spec = parse_jobspec(SPEC)
    record = SimpleNamespace(attempt=2, ended_at=None, restored_step=42)
    saved = {"participants": [0, 1], "nprocs": {}, "master_port": 29500, "logs": None}
    engine = SimpleNamespace(spec=spec, job_id="j-1", hosts={}, preparer=None,
                             store=SimpleNamespace(checkpoint_of=lambda job, number: saved))
    attempt = takeover.open_attempt(
        engine, SimpleNamespace(attempts=[record], ranks=[]),  # type: ignore[arg-type]
        str(tmp_path), lambda *args: SimpleNamespace(stderr={}))
    assert attempt is not None and attempt.restored_step == 42
    assert attempt.checkpoint.restore_step == 42
    assert attempt.checkpoint.keep == spec.checkpoint.keep


def test_a_controller_lingering_for_an_unreachable_agent_exits_when_told(tmp_path):
    """After the job's end the controller keeps trying to reach an agent it lost, to stop
    its workers, for controller_grace + 5 s (605 s by default). A SIGTERM then only set a
    flag that wait never looked at: `kill` did nothing for ten minutes (the cut-node
    benchmark's two controllers). Told to exit, it leaves them: the agent it cannot reach
    stops its own workers after controller_grace."""
    import threading

    from orchestrator.state import JobState

    store, cluster, controller = fake_job(
        tmp_path, "cut-000001", "name: cut\nnodes: [{host: a}, {host: b}]\n"
        "command: [train]\nmax_restarts: 0\nlaunch_timeout: 1\n"
        "health: {heartbeat_interval: 0.5, node_timeout: 2, controller_grace: 30}\n")
    told: list[float] = []

    def drive() -> None:
        deadline = time.monotonic() + 30
        until(all_started(controller), deadline)
        cluster.kill("b")  # lost after node_timeout: the job fails, then lingers for b
        until(lambda: controller.engine.lingering, deadline)
        time.sleep(0.5)  # inside linger's wait
        told.append(time.monotonic())
        controller.request_exit()  # what the supervisor's SIGTERM handler calls

    threading.Thread(target=drive, daemon=True).start()
    try:
        state = controller.run()
    finally:
        cluster.close()
    assert told, "the job never lingered"
    took = time.monotonic() - told[0]
    assert state == JobState.FAILED, state
    assert store.get_job("cut-000001").state == JobState.FAILED
    assert took < 3, f"{took:.1f}s from the request to the controller's return"
