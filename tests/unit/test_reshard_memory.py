"""A DCP load into fewer ranks reads the old ranks' copies from the nodes' memory: the
controller names where each rank's copies are once the job goes on with fewer ranks than it
saved (orchestrator/checkpoints.py ``Holdings.elsewhere``), and a node's agent borrows them
for the load: their descriptions as the attempt starts, their data when a load asks
(agents/borrows.py). The whole path, with a real job, is tests/integration/test_checkpoints.py
and the SSH and Slurm tests."""

from __future__ import annotations

import os
import secrets
import socket
import time

import torch

from agents import borrows
from agents import commands as C
from agents.checkpoints import Store
from agents.replicas import Server, push
from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from orchestrator.checkpoints import Holdings
from tests.unit.test_checkpoint_store import Outbox, store  # noqa: F401 (a fixture)
from tests.unit.test_drain_pull import held
from tests.unit.test_replicas import copy_of


def test_where_the_copies_are_is_named_only_when_the_job_goes_on_with_fewer_ranks():
    """Node 2 (ranks 4 and 5) is lost; its ranks' copies are replicas on its buddy, node 0.
    The nodes that go on are told where every rank's copies are, at the steps that every
    rank has somewhere (10 is not: ranks 4 and 5 never got there); each skips its own."""
    h = Holdings()
    h.update(0, held({0: [8, 9, 10], 1: [8, 9, 10]}, {4: [8, 9], 5: [9]}, port=4000))
    h.update(1, held({2: [8, 9, 10], 3: [8, 9, 10]}, {0: [9, 10], 1: [9, 10]}, port=4001))
    addresses = {0: "a", 1: "b", 2: "c"}
    where = {0: 0, 1: 0, 2: 1, 3: 1}
    assert h.agreed_step(where) == 10
    assert h.elsewhere(where, 10, addresses) == tuple(
        C.Copies(rank, (9,), "a" if rank in (0, 1, 4, 5) else "b", 4000 if rank in
                 (0, 1, 4, 5) else 4001) for rank in range(6))
    # Every rank placed (a restart, a spare in a lost node's place): nothing to name.
    assert h.elsewhere({**where, 4: 1, 5: 1}, 10, addresses) == ()


def test_a_noticed_node_is_named_as_no_source_of_copies_it_goes_away_with():
    """Node 1 noticed (its host goes away) and the job goes on without it, with fewer ranks:
    its ranks' copies were named from its own memory, where the loads found nothing once it
    had gone (that step no candidate, the load from disk or failed), though node 0 keeps
    replicas of them. A drained node stays up for it, and is a source."""
    h = Holdings()
    h.update(0, held({0: [9, 10], 1: [9, 10]}, {2: [9, 10], 3: [9, 10]}, port=4000))
    h.update(1, held({2: [9, 10], 3: [9, 10]}, {0: [9, 10], 1: [9, 10]}, port=4001))
    where = {0: 0, 1: 0}
    h.set_leaving({1})  # noticed
    assert {(c.rank, c.address) for c in h.elsewhere(where, 10, {0: "a", 1: "b"})} == {
        (0, "a"), (1, "a"), (2, "a"), (3, "a")}
    h.set_leaving({1}, staying_up={1})  # drained: it stays up
    assert {(c.rank, c.address) for c in h.elsewhere(where, 10, {0: "a", 1: "b"})} == {
        (0, "a"), (1, "a"), (2, "b"), (3, "b")}


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)


def test_a_node_borrows_another_nodes_copy_described_first_its_data_when_asked(store):  # noqa: F811
    """Node B's rank 1 saved step 7 (sealed); node A, going on without it, is told where it
    is: its description comes as the attempt starts, its data only once a load asks, whole
    and verified, and it goes once every rank of node A has loaded."""
    s, _ = store
    saved = {"w": torch.arange(1000.0), "step": 7}
    ckpt.save(7, saved)
    s._pass()  # sealed
    server = Server(s.root, "s3cret", lambda: 1 << 30, lambda _: None)
    node_a = Store(f"unit-{secrets.token_hex(4)}", 0, Outbox(), "s3cret")  # type: ignore[arg-type]
    try:
        node_a.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 7, (), (
            C.Copies(1, (7,), "127.0.0.1", server.port),)), "/tmp", 2, 1)
        here = borrows.attempt_dir(node_a.root, 2)
        base = os.path.join(here, "rank-1", F.step_name(7))
        F.await_pull(here)  # as a load does
        assert os.path.exists(base + ".meta") and os.path.exists(base + ".manifest")
        assert not os.path.exists(base + ".data")  # no data before a load asks
        F.write_file(base + ".want", b"")
        _wait(lambda: os.path.exists(base + ".data"))
        meta, state = ckpt.copy_at(torch, base, base + ".data", sealed=True)
        assert state["step"] == 7 and torch.equal(state["w"], saved["w"])
        F.write_file(os.path.join(here, "done-0"), b"")  # node A's one rank loaded
        _wait(lambda: not os.path.exists(base + ".data"))
        # The next attempt: what was borrowed goes.
        node_a.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 7), "/tmp", 3, 1)
        assert not os.path.exists(here)
    finally:
        node_a.close()
        server.close()
    assert not os.path.exists(node_a.root)


def test_a_copy_that_cannot_be_borrowed_is_said_and_the_load_told_why(store, monkeypatch):  # noqa: F811
    """No room in checkpoint.memory for a copy's data: the load reads ``.failed`` (and then
    takes the rank's next copy, or fails naming it); a source that does not answer leaves
    no description (that step is then no candidate) and is said in the agent's log."""
    s, _ = store
    ckpt.save(7, {"w": torch.arange(1000.0), "step": 7})
    s._pass()
    server = Server(s.root, "s3cret", lambda: 1 << 30, lambda _: None)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]
    node_a = Store(f"unit-{secrets.token_hex(4)}", 0, Outbox(), "s3cret")  # type: ignore[arg-type]
    monkeypatch.setattr(node_a, "_room", lambda: 100)  # bytes: less than the copy
    try:
        node_a.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 7, (), (
            C.Copies(1, (7,), "127.0.0.1", server.port),
            C.Copies(3, (7,), "127.0.0.1", closed))), "/tmp", 2, 1)
        here = borrows.attempt_dir(node_a.root, 2)
        F.await_pull(here)
        assert not os.path.exists(os.path.join(here, "rank-3", F.step_name(7) + ".meta"))
        base = os.path.join(here, "rank-1", F.step_name(7))
        F.write_file(base + ".want", b"")
        _wait(lambda: os.path.exists(base + ".failed"))
        assert b"no room in checkpoint.memory" in F.read_bytes(base + ".failed")
        assert not os.path.exists(base + ".data")
        said = " ".join(node_a.problems)
        assert "no description of rank 3's copy of step 7" in said, said
        assert "no room in checkpoint.memory for rank 1's copy of step 7" in said, said
    finally:
        node_a.close()
        server.close()


def test_the_copies_a_load_into_fewer_ranks_reads_stay_when_a_newer_step_is_retained(
        store):  # noqa: F811
    """This node keeps replicas of rank 3 (of the lost node) at steps 1 and 2, and the loads
    into fewer ranks read step 1 (the newest every old rank has somewhere). The new ranks'
    first copies reach their buddies while the loads still read, and the controller retains
    step 2: the prune took step 1's replica, and every rank then failed ("step 1 was saved
    by 6 ranks; loading it into 4 needs every rank's copy"). What ``copies`` names stays for
    the attempt, retained or not; the next attempt's retain prunes it."""
    s, _ = store
    s.replicas = Server(s.root, "s3cret", lambda: 1 << 30, lambda _: None)
    for step in (1, 2):
        push("127.0.0.1", s.replicas.port, "s3cret", 3, step, *copy_of(step))
    s.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 2, (), (
        C.Copies(3, (1,), "127.0.0.1", s.replicas.port),)), "/tmp", 2, 1)
    s.retain(C.Retain(2))
    assert sorted(s.replicas.holdings()[0][3]) == [1, 2]
    s.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 2), "/tmp", 3, 1)
    s.retain(C.Retain(2))
    assert s.replicas.holdings()[0] == {3: [2]}


def test_the_copies_a_load_into_fewer_ranks_reads_stay_from_the_attempts_start(
        store):  # noqa: F811
    """Before any retain: a put of a new rank's first copy made room by evicting step 1 of
    rank 3, which the loads read (only a retain named what they read). The attempt's
    configure names it at once; the put finds no other room and is refused."""
    import pytest

    from agents.transfers import ReplicaError

    s, _ = store
    limit = 250_000  # two copies fit, not three
    s.replicas = Server(s.root, "s3cret", lambda: limit - s.replicas.holdings()[1],
                        lambda _: None)
    for step in (1, 2):
        push("127.0.0.1", s.replicas.port, "s3cret", 3, step, *copy_of(step))
    s.configure(C.CheckpointConfig(None, 1, 2, 64 << 20, 2, (), (
        C.Copies(3, (1,), "127.0.0.1", s.replicas.port),)), "/tmp", 2, 1)
    with pytest.raises(ReplicaError, match="no room"):
        push("127.0.0.1", s.replicas.port, "s3cret", 5, 2, *copy_of(2), attempt=2)
    assert sorted(s.replicas.holdings()[0][3]) == [1, 2]
