"""A drained node's ranks resume on the node taking its place from the drained node's own
memory: the move ends once every rank holds the agreed step there (no replica sent first,
measured: 1.4 s of a 512 MiB drain's pause), the drained node's replica server hands its
sealed saves out, and the new node's agent pulls them while its workers start, their load
waiting for them (agents/checkpoints.py, agents/replicas.py, orchestrator/checkpoints.py,
orchestrator/drain.py). A pull that fails makes the load say so, not start from scratch."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from agents import commands as C
from agents import protocol as P
from agents import pulls as pulls_module
from agents import replicas
from agents.checkpoints import Store
from agents.replicas import ReplicaError, Server, pull
from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from orchestrator.checkpoints import Holdings
from orchestrator.drain import Mover
from tests.unit.test_checkpoint_store import Outbox, store  # noqa: F401 (a fixture)


def held(memory, replicas_=None, port=None):
    return P.Held(1, {r: tuple(s) for r, s in memory.items()}, {}, 0, None,
                  {r: tuple(s) for r, s in (replicas_ or {}).items()}, port)


def test_a_leaving_nodes_memory_is_where_its_ranks_copies_come_from():
    h = Holdings()
    h.update(0, held({0: [5, 9], 1: [5, 9]}, port=4000))
    h.update(1, held({2: [5, 9], 3: [5, 9]}, port=4001))  # drained: it stays up
    h.update(2, held({}, {0: [5], 1: [5], 2: [5], 3: [5]}, port=4002))  # the spare
    where = {0: 0, 1: 0, 2: 2, 3: 2}
    assert h.agreed_step(where) == 5  # a node's memory is no source while it stays in
    h.set_leaving([1])  # nor a noticed one's: it may be gone before the copies are
    assert h.agreed_step(where) == 5
    h.set_leaving([1], staying_up=[1])  # drained
    assert h.agreed_step(where) == 9
    addresses = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
    pulls = h.pulls(where, 9, addresses)
    assert pulls == {2: (C.Pull(2, 9, "10.0.0.2", 4001), C.Pull(3, 9, "10.0.0.2", 4001))}
    assert h.where_from(pulls, 9) == " (2 ranks from the memory of the node(s) leaving)"
    # A replica of that step is taken first (the spare's own: a rename).
    h.update(2, held({}, {2: [9], 3: [9]}, port=4002))
    assert h.pulls(where, 9, addresses) == {2: (C.Pull(2, 9, "10.0.0.3", 4002),
                                                C.Pull(3, 9, "10.0.0.3", 4002))}
    assert h.serving([1, 2]) and not h.serving([3])


def test_a_drain_ends_at_every_rank_in_memory_and_a_notice_waits_for_replicas():
    """A drained node stays up and is not asked to replicate; a noticed one may go away, so
    its ranks' copies must be on a node that stays before its move ends."""
    failed: list = []
    nodes = [SimpleNamespace(index=i, host=f"n{i}", channel=object(), usable=True, info=None)
             for i in range(3)]
    holdings = Holdings()
    sent: list = []
    engine = SimpleNamespace(nodes=nodes, holdings=holdings, spec=SimpleNamespace(
        checkpoint=SimpleNamespace(dir=None), min_nodes=2, nproc_per_node=2), pool=SimpleNamespace(
        send=lambda node, command: sent.append((node.index, command)) or True))
    plan = SimpleNamespace(nodes=[SimpleNamespace(node_index=n, workers=[
        SimpleNamespace(rank=2 * n + i) for i in range(2)]) for n in (0, 1)])
    attempt = SimpleNamespace(number=1, participants=[0, 1], plan=plan, node_ranks={1: 1},
                              node_plans={0: None, 1: None}, last_steps={}, fail=failed.append,
                              nprocs={0: 2, 1: 2})
    mover = Mover("j", None, {0: "n0", 1: "n1", 2: "n2"})  # type: ignore[arg-type]
    for notice in (False, True):
        failed.clear()
        sent.clear()
        mover.move = None
        holdings.update(0, held({0: [9], 1: [9]}, port=4000))
        holdings.update(1, held({2: [9], 3: [9]}, port=4001))
        mover.drained = {1: {"target": "1", "job_id": "j", "since": 0.0, "reason": "maintenance",
                             "within": 60.0, **({"notice": True} if notice else {})}}
        holdings.set_leaving([1], [] if notice else [1])
        mover._begin(engine, attempt)  # type: ignore[arg-type]
        move = mover.move
        assert move is not None and move.pull is not notice and move.step == 11  # 9 + MARGIN
        # Told the step: only a noticed node replicates (a drained one's copies are pulled).
        assert [(i, c.step, c.replicate) for i, c in sent] == [(0, 11, False), (1, 11, notice)]
        holdings.update(0, held({0: [9, 11], 1: [9, 11]}, port=4000))
        holdings.update(1, held({2: [9, 11], 3: [9, 11]}, port=4001))
        mover._check(engine, attempt)  # type: ignore[arg-type]
        if notice:  # its ranks are in node 1's memory only: the move waits
            assert failed == [] and mover.move is move
        else:
            (failure,) = failed
            assert failure.message.startswith("node 1 (n1) drained (maintenance): every rank "
                                              "saved step 11"), failure.message
            # The next attempt: node 1's ranks on the spare, from node 1's memory.
            assert holdings.agreed_step({0: 0, 1: 0, 2: 2, 3: 2}) == 11


@pytest.fixture
def leaving(store):  # noqa: F811
    """A drained node's store (the fixture's: rank 1) holding rank 1's sealed save of step 7,
    and its replica server."""
    s, _ = store
    ckpt.save(7, {"w": torch.arange(10.0), "step": 7})
    s._pass()  # sealed
    server = Server(s.root, "s3cret", lambda: 1 << 30, lambda _: None)
    yield s, server
    server.close()


def test_a_nodes_own_sealed_save_is_handed_out_verified(leaving, tmp_path, monkeypatch):
    s, server = leaving
    meta, manifest = pull("127.0.0.1", server.port, "s3cret", 1, 7, str(tmp_path / "got"))
    assert json.loads(meta)["step"] == 7 and json.loads(manifest)["size"] == \
        os.path.getsize(tmp_path / "got")
    # One not sealed yet is waited for (up to SEAL_WAIT), then refused; a corrupt one too.
    monkeypatch.setattr(replicas, "SEAL_WAIT", 0.2)
    base = os.path.join(s.root, "rank-1", F.step_name(7))
    os.rename(base + ".manifest", base + ".corrupt")
    with pytest.raises(ReplicaError, match="no replica of step 7"):
        pull("127.0.0.1", server.port, "s3cret", 1, 7, str(tmp_path / "bad"))
    os.rename(base + ".corrupt", base + ".other")
    started = time.monotonic()
    with pytest.raises(ReplicaError, match="no replica of step 7"):
        pull("127.0.0.1", server.port, "s3cret", 1, 7, str(tmp_path / "unsealed"))
    assert time.monotonic() - started >= 0.2


def replacement(monkeypatch, tmp_path, port):
    """A new node's store that installs rank 1's step 7 from ``port`` as its attempt starts
    (install, then configure: as the agent's start does), and the worker's env for it."""
    new = Store(f"unit-{secrets.token_hex(4)}", 1, Outbox(), "s3cret")  # type: ignore[arg-type]
    new.install((C.Pull(1, 7, "127.0.0.1", port),))
    env = new.configure(C.CheckpointConfig(None, 0, 2, 64 << 20, 7), str(tmp_path), 2, 1)
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    return new


def test_the_workers_start_while_the_copy_comes_and_their_load_waits_for_it(
        leaving, tmp_path, monkeypatch):
    _, server = leaving
    gate = threading.Event()
    real = pulls_module.pull_replica
    monkeypatch.setattr(pulls_module, "pull_replica",
                        lambda *args: gate.wait(10) and real(*args))
    new = replacement(monkeypatch, tmp_path, server.port)
    try:
        marker = os.path.join(new.root, "rank-1", F.PULLING_NAME)
        assert os.path.exists(marker)  # install returned: the workers may start
        loaded: list = []
        worker = threading.Thread(target=lambda: loaded.append(ckpt.load()))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not loaded  # its load waits for the copy
        gate.set()
        worker.join(10)
        step, state = loaded[0]
        assert step == 7 and state["step"] == 7 and torch.equal(state["w"], torch.arange(10.0))
        assert not os.path.exists(marker)
        record = json.loads(open(os.path.join(new.root, "rank-1", "restored.json")).read())
        assert record["source"] == "buddy"  # pulled from another node
    finally:
        new.close()


def test_a_pull_that_fails_makes_the_load_say_so_not_start_from_scratch(
        store, tmp_path, monkeypatch):  # noqa: F811
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # nothing listens there once closed
    new = replacement(monkeypatch, tmp_path, port)
    try:
        with pytest.raises(ckpt.CheckpointError,
                           match=r"rank 1 has no copy of step 7.*from 127\.0\.0\.1"):
            ckpt.load()
        assert any("no copy of step 7 of rank 1" in m.get("message", "")
                   for m in new.outbox.sent)  # and the agent said so
        # A later attempt's start forgets it.
        new.install(())
        assert not os.path.exists(os.path.join(new.root, "rank-1", F.PULL_FAILED_NAME))
    finally:
        new.close()


def test_a_pull_of_an_attempt_before_says_nothing_to_the_next_attempts_load(tmp_path,
                                                                            monkeypatch):
    """Attempt N's pull from a buddy cut mid-copy waits for its transfer's timeout; attempt
    N+1 began meanwhile with its own pull of the rank's copy. The old pull's failure, and the
    end of its wait, reached the new attempt's load while its own copy was still coming: the
    load raised "no copy", the attempt failed. Found by a reading helper."""
    root = str(tmp_path)
    release = threading.Event()

    def fake_pull(address, port, secret, rank, step, path, memory):
        if port == 1:  # attempt N's source: its node went mid-copy
            time.sleep(0.3)
            raise OSError("timed out")
        release.wait(10)  # attempt N+1's: alive, slower
        raise OSError("the test is over")
    monkeypatch.setattr(pulls_module, "pull_replica", fake_pull)
    problems: list[str] = []
    pulls_module.install(root, "s", None, (C.Pull(3, 100, "gone", 1),), problems.append,
                         lambda: None)
    time.sleep(0.05)
    pulls_module.install(root, "s", None, (C.Pull(3, 100, "alive", 2),), problems.append,
                         lambda: None)
    rank_dir = os.path.join(root, "rank-3")
    time.sleep(0.6)  # the old pull has failed by now
    assert os.path.exists(os.path.join(rank_dir, F.PULLING_NAME))  # the load still waits
    F.pull_failed(rank_dir, 100)  # and is told of no failure
    release.set()
    deadline = time.monotonic() + 5
    while os.path.exists(os.path.join(rank_dir, F.PULLING_NAME)) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(F.CheckpointError, match="alive"):  # its own pull's failure, named
        F.pull_failed(rank_dir, 100)


def test_a_pull_of_an_attempt_before_leaves_no_wait_to_an_attempt_that_pulls_nothing(
        tmp_path, monkeypatch):
    """Attempt N's pull of rank 3 stalls (its buddy cut mid-copy); attempt N+1 needs no pull
    of rank 3 here (its copy held, or persisted). The old pull's marker stayed: rank 3's load
    waited up to 600 s and then said its copy did not come, at every attempt after on that
    node. Found by a reading helper."""
    root = str(tmp_path)
    release = threading.Event()

    def stalled(*args):
        release.wait(10)
        raise OSError("timed out")
    monkeypatch.setattr(pulls_module, "pull_replica", stalled)
    pulls_module.install(root, "s", None, (C.Pull(3, 100, "gone", 1),), lambda _: None,
                         lambda: None)
    marker = os.path.join(root, "rank-3", F.PULLING_NAME)
    assert os.path.exists(marker)
    pulls_module.install(root, "s", None, (), lambda _: None, lambda: None)
    try:
        assert not os.path.exists(marker)  # the next attempt's load waits for nothing
    finally:
        release.set()


def test_a_load_with_no_good_copy_anywhere_here_raises_rather_than_start_from_scratch(
        store, tmp_path, monkeypatch):  # noqa: F811
    """The ranks told a step whose copy did not verify, or came too late from another node,
    agreed on an older step; where no rank held one, every rank started from scratch and
    nothing said so (a week of training gone). They raise instead: the attempt fails, and
    the next one resumes what the nodes hold. Found by a reading helper."""
    import torch.distributed as dist

    s, _ = store
    monkeypatch.setenv(F.PERSIST_VAR, "1000")
    s.configure(C.CheckpointConfig("ck", 1000, 2, 64 << 20), str(tmp_path), 1, 1)
    ckpt.save(7, {"w": torch.full((1000,), 7.0)})
    s._pass()
    rank_dir = os.path.join(s.root, "rank-1")
    slot = json.loads(F.read_bytes(os.path.join(rank_dir, "step-7.meta")))["slot"]
    with open(os.path.join(rank_dir, f"slot-{slot}"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")  # the only copy of step 7 is bad
    monkeypatch.setenv(F.STEP_VAR, "7")
    monkeypatch.setenv("ORCHESTRATOR_ATTEMPT", "2")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ckpt.CheckpointError, match="no good copy of step 7 on every rank"):
            ckpt.load()
    finally:
        dist.destroy_process_group()
    # A copy pulled from another node that did not come within its wait says so too.
    monkeypatch.setenv(F.STEP_VAR, "9")
    F.write_file(os.path.join(rank_dir, F.PULLING_NAME), str(time.time() - 1).encode())
    with pytest.raises(ckpt.CheckpointError, match="step 9, pulled from another node, did "
                                                   "not come in time"):
        ckpt.load()
