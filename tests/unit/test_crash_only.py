"""The controller is crash-only: an error of ours (the store, the disk, a bug) never stops a
worker and is never blamed on a node; and the supervisor's count of its deaths (pure)."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from orchestrator import pause
from orchestrator.attempt import Attempt
from orchestrator.controller import Controller
from orchestrator.errors import StoreUnwritable
from orchestrator.spec import parse_jobspec
from orchestrator.state import NodeState
from orchestrator.store import Store, unwritable
from orchestrator.supervisor import BACKOFF, Deaths
from orchestrator.transport.fake import FakeAgent
from tests.unit.test_controller import SPEC


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


def test_what_is_a_pause_and_what_is_a_crash():
    full = sqlite3.OperationalError("database or disk is full")
    assert "disk is full" in pause.problem(full, "/h")
    assert pause.problem(OSError(errno.ENOSPC, "No space left on device", "/h/jobs/x.log"),
                         "/h") == "/h/jobs/x.log: No space left on device"
    assert pause.problem(StoreUnwritable("/h/state.db", "it is read-only"), "/h") == \
        "/h/state.db: it is read-only"
    wrapped = RuntimeError("while checkpointing")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert "Read-only" in pause.problem(wrapped, "/h")
    for ours in (sqlite3.OperationalError("database is locked"), KeyError("x"),
                 OSError(errno.EMFILE, "Too many open files"), ValueError("bug")):
        assert pause.problem(ours, "/h") is None and unwritable(ours) is None


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
