"""Replicas between agents (agents/replicas.py): a save pushed to a buddy's server is kept
only once it verifies and can be pulled back verified; a peer without the job's secret, a
copy whose bytes do not match its manifest, and a replica larger than the room left are
refused with nothing kept; only the newest two steps of a rank stay. And the controller's
side (orchestrator/checkpoints.py): who pulls what from whom, and each node's buddy."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from agents import commands as C
from agents import protocol as P
from agents.replicas import KEEP, ReplicaError, Server, pull, push
from agents.shims import orchestrator_checkpoint_format as F
from orchestrator.checkpoints import Holdings


def copy_of(step: int, size: int = 100_000) -> tuple[bytes, bytes, memoryview]:
    data = bytes((step + i) % 251 for i in range(size))
    meta = json.dumps({"step": step, "rank": 3, "slot": 0, "size": size}).encode()
    manifest = json.dumps(F.manifest(meta, F.checksums(memoryview(data), size), size)).encode()
    return meta, manifest, memoryview(data)


@pytest.fixture
def server(tmp_path):
    problems: list[str] = []
    s = Server(str(tmp_path), "s3cret", lambda: 1 << 30, problems.append)
    yield s
    s.close()


def test_a_replica_is_kept_verified_and_pulled_back_verified(server, tmp_path):
    for step in (1, 2, 3):
        push("127.0.0.1", server.port, "s3cret", 3, step, *copy_of(step))
    held, used = server.holdings()
    assert list(held) == [3] and sorted(held[3]) == [1, 2, 3][-KEEP:]
    assert used == min(3, KEEP) * 100_000
    meta, manifest = pull("127.0.0.1", server.port, "s3cret", 3, 3, str(tmp_path / "got"))
    assert (meta, manifest) == copy_of(3)[:2]
    assert (tmp_path / "got").read_bytes() == bytes(copy_of(3)[2])
    server.retain = 3  # the controller retains step 3: older replicas go, the newest stays
    server.prune()
    assert server.holdings()[0] == {3: [3]}
    with pytest.raises(ReplicaError, match="no replica of step 1"):
        pull("127.0.0.1", server.port, "s3cret", 3, 1, str(tmp_path / "old"))


def test_a_peer_without_the_secret_and_a_bad_copy_are_refused(server, tmp_path):
    with pytest.raises((ReplicaError, OSError)):
        push("127.0.0.1", server.port, "wrong", 3, 1, *copy_of(1))
    meta, manifest, data = copy_of(2)
    spoilt = bytearray(data)
    spoilt[5000] ^= 1
    with pytest.raises(ReplicaError, match="chunk 0 .* fails its checksum"):
        push("127.0.0.1", server.port, "s3cret", 3, 2, meta, manifest, memoryview(spoilt))
    assert server.holdings() == ({}, 0)
    assert not [f for _, _, fs in os.walk(server.root) for f in fs]  # nothing half kept


def test_a_replica_whose_data_is_gone_is_not_held(tmp_path):
    """A replica going (its manifest goes first, then its data) or taken for a rank that
    now runs here: a manifest alone is no copy, and was said to be one of 0 bytes."""
    server = Server(str(tmp_path), "s3cret", lambda: 1 << 30, lambda _: None)
    try:
        for step in (1, 2):
            push("127.0.0.1", server.port, "s3cret", 3, step, *copy_of(step))
        os.unlink(os.path.join(server.root, "rank-3", "step-1.data"))
        assert server.holdings() == ({3: [2]}, 100_000)
    finally:
        server.close()


def test_no_replica_past_the_room_left(tmp_path):
    small = Server(str(tmp_path), "s3cret", lambda: 10, lambda _: None)
    try:
        with pytest.raises(ReplicaError, match="no room"):
            push("127.0.0.1", small.port, "s3cret", 3, 1, *copy_of(1))
    finally:
        small.close()


def test_puts_at_once_never_take_more_than_the_room_left_between_them(tmp_path):
    """Each put checked the room on its own while another was still writing (its bytes not
    yet a replica): a spare that takes every node's copies at once went past
    checkpoint.memory. A put's bytes are the room's from its check until it ends."""
    import socket
    import time

    from agents import replicas

    limit = 250_000  # two copies of 100,000 bytes fit, not three
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], lambda _: None)
    slow = socket.create_connection(("127.0.0.1", room.port))
    try:
        replicas._handshake_client(slow, "s3cret")
        meta, manifest, _ = copy_of(1)
        replicas._send_line(slow, {"op": "put", "rank": 1, "step": 1, "meta": len(meta),
                                   "manifest": len(manifest), "size": 100_000})
        assert replicas._read_line(slow).flag("ok")  # accepted: it writes from now on
        push("127.0.0.1", room.port, "s3cret", 2, 1, *copy_of(1))  # fits beside it
        with pytest.raises(ReplicaError, match="no room"):  # would not: it was taken
            push("127.0.0.1", room.port, "s3cret", 3, 1, *copy_of(1))
        slow.close()  # the slow put ends, unfinished: its room is free again
        deadline = time.monotonic() + 5
        while room._incoming and time.monotonic() < deadline:
            time.sleep(0.02)
        push("127.0.0.1", room.port, "s3cret", 3, 1, *copy_of(1))
        assert room.holdings() == ({2: [1], 3: [1]}, 200_000)
    finally:
        slow.close()
        room.close()


def sorted_holdings(server: Server) -> tuple[dict[int, list[int]], int]:
    held, used = server.holdings()
    return {rank: sorted(steps) for rank, steps in held.items()}, used


def test_room_for_a_put_never_takes_a_copy_the_loads_into_fewer_ranks_read(tmp_path):
    """A put makes room by evicting replicas older than their rank's newest: it took the
    copies an attempt's loads into fewer ranks read (the new ranks' first copies evicted the
    old ranks' step), and every load found nothing. Those stay (``keep``, set at the
    attempt's configure: agents/checkpoints.py); a put that finds no other room is refused."""
    limit = 250_000  # two copies of 100,000 bytes fit, not three
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], lambda _: None)
    try:
        push("127.0.0.1", room.port, "s3cret", 3, 10, *copy_of(10))  # what the loads read
        push("127.0.0.1", room.port, "s3cret", 3, 11, *copy_of(11))  # rank 3's newest
        room.keep = frozenset({(3, 10)})
        with pytest.raises(ReplicaError, match="no room"):
            push("127.0.0.1", room.port, "s3cret", 5, 12, *copy_of(12))
        assert sorted_holdings(room) == ({3: [10, 11]}, 200_000)
        room.keep = frozenset()  # the loads are done: the older copy may go for a new one
        push("127.0.0.1", room.port, "s3cret", 5, 12, *copy_of(12))
        assert sorted_holdings(room) == ({3: [11], 5: [12]}, 200_000)
    finally:
        room.close()


def test_a_retained_replica_given_up_for_room_is_said(tmp_path):
    """A full memory gives up replicas of the retained step for newer copies (else no copy
    came again): the step a node's loss resumes may then be in no memory, and the guide
    says the agent says so (in the same words each time: the agent says each problem once).
    An older step's going is no news."""
    limit = 250_000
    problems: list[str] = []
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], problems.append)
    try:
        for step in (9, 10, 11):  # 9 goes for 11
            push("127.0.0.1", room.port, "s3cret", 3, step, *copy_of(step))
        room.retain = 11
        push("127.0.0.1", room.port, "s3cret", 3, 12, *copy_of(12))  # 10 goes: older
        assert problems == []
        push("127.0.0.1", room.port, "s3cret", 3, 13, *copy_of(13))  # 11 goes: retained
        assert sorted_holdings(room) == ({3: [12, 13]}, 200_000)
        assert len(problems) == 1, problems
        assert "checkpoint.memory is full: replicas of the retained step" in problems[0]
    finally:
        room.close()


def test_a_full_memory_gives_up_the_retained_step_last(tmp_path):
    """Room for a new copy comes from the older replicas, the oldest first, but the retained
    step's last: the newest step every rank has here is what a node's loss resumes, and a
    copy of a step not every rank has sent yet is worth less. The retained step went first
    (it was the oldest), and the spare held no step of every rank."""
    limit = 500_000
    problems: list[str] = []
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], problems.append)
    try:
        for rank, step in ((3, 10), (5, 10), (5, 11), (3, 12), (5, 12)):
            push("127.0.0.1", room.port, "s3cret", rank, step, *copy_of(step))
        room.retain = 10
        push("127.0.0.1", room.port, "s3cret", 3, 13, *copy_of(13))
        assert sorted_holdings(room) == ({3: [10, 12, 13], 5: [10, 12]}, 500_000)
        assert problems == []
    finally:
        room.close()


def test_a_put_that_would_not_fit_all_the_same_evicts_nothing(tmp_path):
    """Room for a copy larger than every older replica frees: each went (the retained step's
    among them, said as given up for newer copies), and then the put was refused all the
    same. Nothing goes for a copy that does not fit."""
    limit = 250_000
    problems: list[str] = []
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], problems.append)
    try:
        push("127.0.0.1", room.port, "s3cret", 3, 10, *copy_of(10))
        push("127.0.0.1", room.port, "s3cret", 3, 11, *copy_of(11))
        room.retain = 10
        with pytest.raises(ReplicaError, match="no room"):
            push("127.0.0.1", room.port, "s3cret", 5, 12, *copy_of(12, size=200_000))
        assert sorted_holdings(room) == ({3: [10, 11]}, 200_000) and problems == []
    finally:
        room.close()


def test_a_copy_held_already_is_not_sent_and_makes_no_room(tmp_path):
    """A second node sending the copy this one holds (a spare's and the leaving node's) is
    told so: the put reserved its room first, and that evicted an older replica for bytes
    that never came."""
    limit = 250_000
    room = Server(str(tmp_path), "s3cret", lambda: limit - room.holdings()[1], lambda _: None)
    try:
        push("127.0.0.1", room.port, "s3cret", 3, 10, *copy_of(10))
        push("127.0.0.1", room.port, "s3cret", 3, 11, *copy_of(11))
        push("127.0.0.1", room.port, "s3cret", 3, 11, *copy_of(11))  # the same bytes again
        assert sorted_holdings(room) == ({3: [10, 11]}, 200_000)
    finally:
        room.close()


def test_a_replica_of_a_rank_that_now_runs_here_goes_once_the_node_holds_its_own(server,
                                                                                  tmp_path):
    """A spare that took a node's place kept its last replica of each rank it now runs for
    good (the newest of a rank always stays), outside the memory's share. Once the node holds
    its own copy of a step from the retained one on, the replica goes; a rank that does not
    run here, or whose own copies are older, keeps its newest."""
    for rank in (3, 4, 5):
        push("127.0.0.1", server.port, "s3cret", rank, 5, *copy_of(5))
    for rank, step in ((3, 9), (5, 7)):  # the node's own sealed saves of ranks 3 and 5
        own = tmp_path / f"rank-{rank}"
        own.mkdir()
        (own / f"{F.step_name(step)}.manifest").write_text("{}")
    server.retain = 8
    server.prune()
    assert server.holdings()[0] == {4: [5], 5: [5]}


def held(memory=None, replicas=None, port=None) -> P.Held:
    return P.Held(1, {r: tuple(s) for r, s in (memory or {}).items()}, {}, 0, None,
                  {r: tuple(s) for r, s in (replicas or {}).items()}, port)


def test_a_replacement_pulls_the_lost_ranks_from_the_buddy_that_holds_them():
    h = Holdings()
    # Node 1 is lost; node 0 holds its own ranks and replicas of node 1's; node 2 is new.
    h.update(0, held({0: [7, 8], 1: [7, 8]}, {2: [6, 7], 3: [7]}, port=4000))
    h.update(2, held(port=4002))
    where = {0: 0, 1: 0, 2: 2, 3: 2}
    assert h.agreed_step(where) == 7
    addresses = {0: "10.0.0.1", 2: "10.0.0.3"}
    assert h.pulls(where, 7, addresses) == {2: (C.Pull(2, 7, "10.0.0.1", 4000),
                                                C.Pull(3, 7, "10.0.0.1", 4000))}


def test_each_node_replicates_to_the_next_and_is_told_only_news():
    h = Holdings()
    addresses = {0: "a", 1: "b", 2: "c"}
    assert h.buddies([0, 1], addresses) == {}  # no port known yet: nothing to say
    h.update(0, held(port=4000))
    h.update(1, held(port=4001))
    assert h.buddies([0, 1], addresses) == {0: C.ReplicateTo("b", 4001),
                                            1: C.ReplicateTo("a", 4000)}
    assert h.buddies([0, 1], addresses) == {}
    h.update(2, held(port=4002))
    assert h.buddies([0, 2], addresses) == {0: C.ReplicateTo("c", 4002),
                                            2: C.ReplicateTo("a", 4000),
                                            1: C.ReplicateTo("", 0)}  # out: sends nowhere
    assert h.buddies([0], addresses) == {0: C.ReplicateTo("", 0), 2: C.ReplicateTo("", 0)}


def test_every_node_also_replicates_to_the_first_spare_which_pulls_from_itself():
    """The first hot spare (the one that takes a failed node's place) holds every
    participant's copies before it is needed; taking a place, it copies them from itself."""
    h = Holdings()
    addresses = {0: "a", 1: "b", 2: "c", 3: "d"}
    for index in range(4):
        h.update(index, held(port=4000 + index))
    assert h.buddies([0, 1], addresses, [2, 3]) == {
        0: C.ReplicateTo("b", 4001, (("c", 4002),)), 1: C.ReplicateTo("a", 4000, (("c", 4002),))}
    assert h.buddies([0, 1], addresses, [2, 3]) == {}  # only news
    assert h.buddies([0, 1], addresses, [3]) == {  # spare 2 took a place elsewhere, or left
        0: C.ReplicateTo("b", 4001, (("d", 4003),)), 1: C.ReplicateTo("a", 4000, (("d", 4003),))}
    # Node 1 lost: spare 2 takes its place; it holds node 1's ranks (2, 3) at step 7 itself.
    h.update(0, held({0: [7], 1: [7]}, {2: [7], 3: [7]}, port=4000))
    h.update(2, held(replicas={0: [7], 1: [7], 2: [7], 3: [7]}, port=4002))
    where = {0: 0, 1: 0, 2: 2, 3: 2}
    assert h.agreed_step(where) == 7
    assert h.pulls(where, 7, addresses) == {2: (C.Pull(2, 7, "c", 4002), C.Pull(3, 7, "c", 4002))}


def test_the_door_reads_where_a_node_replicates():
    from agents import commands

    told = C.ReplicateTo("10.0.0.2", 4001, (("10.0.0.3", 4002),))
    assert commands.parse(commands.wire(told)) == (told, None)
    for bad in ([["10.0.0.3"]], [["10.0.0.3", 0]], [[3, 4002]], "10.0.0.3:4002"):
        with pytest.raises(P.ProtocolError):
            commands.parse({**commands.wire(told), "also": bad})


def test_the_step_every_rank_could_resume_after_a_node_loss_is_retained():
    h = Holdings()
    h.update(0, held({}, {2: [5, 6], 3: [5, 6, 7]}, port=4000))
    h.update(1, held({}, {0: [6], 1: [4, 6]}, port=4001))
    assert h.retained([0, 1, 2, 3]) == C.Retain(6)
    assert h.retained([0, 1, 2, 3]) is None  # no news
    h.update(1, held({}, {0: [6, 7], 1: [6, 7]}, port=4001))
    h.update(0, held({}, {2: [6, 7], 3: [6, 7]}, port=4000))
    assert h.retained([0, 1, 2, 3]) == C.Retain(7)
    assert h.retained([0, 1, 2, 3, 4]) is None  # rank 4 has no replica: nothing to keep


def test_a_fall_back_agrees_on_a_step_older_than_the_one_that_failed_once():
    h = Holdings()
    h.update(0, held({0: [5, 6, 7], 1: [6, 7]}, port=4000))
    where = {0: 0, 1: 0}
    assert h.agreed_step(where) == 7
    h.fall_back(7)
    assert h.agreed_step(where) == 6 and h.fell_back
    h.new_attempt()  # it started: the next restart agrees on the newest again
    assert h.agreed_step(where) == 7 and h.fell_back


def test_the_step_an_attempt_resumed_is_the_oldest_its_ranks_loaded_once_all_said():
    def loads(attempt: int, steps: dict[int, int]) -> P.Held:
        return P.Held(attempt, {}, {}, 0, None, restored={
            rank: (attempt, step, "persisted", 0.5, 0) for rank, step in steps.items()})
    h = Holdings()
    h.update(0, loads(2, {0: 19, 1: 19}))
    assert h.loaded_step(2, 3) is None  # rank 2 has not said yet
    h.update(1, loads(2, {2: 17}))  # it resharded an older step
    assert h.loaded_step(2, 3) == 17 and h.loaded_step(1, 3) is None
    h.update(1, loads(1, {2: 30}))  # an older attempt's report changes nothing
    assert h.loaded_step(2, 3) == 17
    h.update(0, loads(3, {0: 40}))  # the next attempt's loads start afresh
    assert h.loaded_step(3, 1) == 40 and h.loaded_step(2, 3) is None


def test_a_transfer_accepted_before_the_store_closed_never_makes_it_again(tmp_path,
                                                                          monkeypatch):
    """A buddy's push that was accepted just before this node's store closed and removed its
    memory (a job's end): refused, and nothing of the store made again (a directory made
    again would outlive the agent on /dev/shm: CI caught one)."""
    import shutil
    import socket

    from agents import replicas

    root = tmp_path / "memory"
    root.mkdir()
    s = Server(str(root), "s3cret", lambda: 1 << 30, lambda _: None)
    early = socket.create_connection(("127.0.0.1", s.port))
    early.settimeout(10)
    early.recv(16, socket.MSG_PEEK)  # its nonce: accepted, its _serve waits (else a reset)
    s.close()
    shutil.rmtree(root)
    monkeypatch.setattr(replicas.socket, "create_connection", lambda *a, **k: early)
    with pytest.raises(ReplicaError, match="closing"):
        push("127.0.0.1", s.port, "s3cret", 3, 1, *copy_of(1))
    assert not root.exists()


def test_a_copy_of_an_attempt_before_the_nodes_is_not_kept(server):
    """Copies of a timeline a new attempt left behind: refused when they come, and not kept
    when the node's attempt moved on while one arrived."""
    import socket
    import time

    from agents import replicas

    meta, manifest, view = copy_of(5)
    push("127.0.0.1", server.port, "s3cret", 3, 5, meta, manifest, view, attempt=2)
    with pytest.raises(ReplicaError, match="attempt 1, before this node's 2"):
        push("127.0.0.1", server.port, "s3cret", 3, 5, meta, manifest, view, attempt=1)
    meta, manifest, view = copy_of(6, size=4 << 20)
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    replicas._handshake_client(conn, "s3cret")
    replicas._send_line(conn, {"op": "put", "rank": 3, "step": 6, "meta": len(meta),
                               "manifest": len(manifest), "size": len(view), "attempt": 2})
    assert replicas._answer(conn) is False  # go on
    conn.sendall(meta + manifest + view[:1 << 20])
    time.sleep(0.2)
    server.attempt = 3  # this node's agent began attempt 3 meanwhile
    conn.sendall(view[1 << 20:])
    with pytest.raises(ReplicaError, match="attempt 2, before this node's 3"):
        replicas._answer(conn)
    conn.close()
    assert server.holdings()[0] == {3: [5]}


def test_a_peers_manifest_nested_or_of_huge_chunks_is_refused_and_a_pull_says_so(
        tmp_path, monkeypatch):
    """What a peer with the secret sends is bounded too: a manifest nested past Python's
    limit raised RecursionError past every handler (a pull's thread died and its rank's load
    was never told why), and one of 1 TiB chunks had the receiver buffer two of them."""
    from agents import pulls, replicas

    meta, manifest, _ = copy_of(1)
    with pytest.raises(ReplicaError, match="not JSON"):
        replicas._manifest(meta, b"[" * 100_000, 100_000)
    huge = {**json.loads(manifest), "chunk": 1 << 40, "crc": [0]}
    with pytest.raises(ReplicaError, match="malformed"):
        replicas._manifest(meta, json.dumps(huge).encode(), 100_000)

    def nested(*args, **kwargs):
        return json.loads("[" * 100_000)
    monkeypatch.setattr(pulls, "pull_replica", nested)
    problems: list[str] = []
    pulls._fetch(str(tmp_path), "s3cret", None, C.Pull(3, 1, "127.0.0.1", 1),
                 problems.append, lambda: None)
    assert os.path.exists(tmp_path / "rank-3" / F.PULL_FAILED_NAME) and problems


def test_a_copy_of_many_chunks_is_verified_chunk_by_chunk_as_it_comes(server, tmp_path):
    """The receiver takes each chunk's checksum as the chunk arrives (no second pass): every
    chunk is checked, the last short one included, and a bad byte in a middle one is named."""
    size, chunk = 1_000_000, 4096
    data = bytearray(os.urandom(size))
    meta = json.dumps({"step": 5, "rank": 3, "slot": 0, "size": size}).encode()
    man = {"format": F.FORMAT, "size": size, "chunk": chunk, "meta": F.zlib.crc32(meta),
           "crc": F.checksums(memoryview(data), size, chunk)}
    push("127.0.0.1", server.port, "s3cret", 3, 5, meta, json.dumps(man).encode(),
         memoryview(data))
    pull("127.0.0.1", server.port, "s3cret", 3, 5, str(tmp_path / "got"))
    assert (tmp_path / "got").read_bytes() == bytes(data)
    data[size - 10] ^= 1  # in the last chunk, which is short
    with pytest.raises(ReplicaError, match=f"chunk {size // chunk} .* fails its checksum"):
        push("127.0.0.1", server.port, "s3cret", 3, 6, meta, json.dumps(man).encode(),
             memoryview(data))
    data[size - 10] ^= 1
    data[500_000] ^= 1
    with pytest.raises(ReplicaError, match=f"chunk {500_000 // chunk} .* fails"):
        push("127.0.0.1", server.port, "s3cret", 3, 6, meta, json.dumps(man).encode(),
             memoryview(data))
    assert server.holdings()[0] == {3: [5]}


def test_a_node_that_holds_the_replica_takes_it_without_a_copy(server, tmp_path):
    """A spare that now runs the ranks it held replicas of moves them into its memory (a
    rename: 1 GiB took 2.1 s through pull), and holds them no more as replicas."""
    push("127.0.0.1", server.port, "s3cret", 3, 4, *copy_of(4))
    kept = os.stat(os.path.join(server.root, "rank-3", "step-4.data")).st_ino
    assert server.take(3, 4, str(tmp_path / "slot-0")) == copy_of(4)[:2]
    assert os.stat(tmp_path / "slot-0").st_ino == kept
    assert (tmp_path / "slot-0").read_bytes() == bytes(copy_of(4)[2])
    assert server.holdings() == ({}, 0)
    assert server.take(3, 4, str(tmp_path / "slot-1")) is None  # none left: pull instead
    assert not (tmp_path / "slot-1").exists()


def test_a_drained_node_is_no_spare_and_a_node_out_of_the_job_sends_nowhere():
    """After a move off node 1 (drained) to spare 2, nobody sends copies to node 1 as a
    spare's, and node 1, out of the attempt, stops sending its own."""
    h = Holdings()
    addresses = {0: "a", 1: "b", 2: "c"}
    for index in range(3):
        h.update(index, held(port=4000 + index))
    h.buddies([0, 1], addresses, [2])
    h.set_leaving({1})
    assert h.buddies([0, 2], addresses, [1]) == {
        0: C.ReplicateTo("c", 4002), 2: C.ReplicateTo("a", 4000), 1: C.ReplicateTo("", 0)}
    h.set_leaving(())  # undrained: a spare again
    assert h.buddies([0, 2], addresses, [1]) == {
        0: C.ReplicateTo("c", 4002, (("b", 4001),)), 2: C.ReplicateTo("a", 4000, (("b", 4001),))}


def test_two_nodes_sending_the_same_copy_at_once_leave_one_good_copy(server, tmp_path):
    """A spare and a leaving node may send the same rank's step to one node at once: each
    transfer writes a file of its own (one cut short under the other's mapping would be a
    SIGBUS, the agent's end), and a good copy is kept."""
    import threading

    size = 8 << 20
    data = memoryview(bytes(os.urandom(size)))
    meta = json.dumps({"step": 4, "rank": 3, "slot": 0, "size": size}).encode()
    manifest = json.dumps(F.manifest(meta, F.checksums(data, size), size)).encode()
    errors: list[Exception] = []

    def send() -> None:
        try:
            push("127.0.0.1", server.port, "s3cret", 3, 4, meta, manifest, data)
        except (OSError, ReplicaError) as exc:  # the other's copy replaced this one's
            errors.append(exc)

    for _ in range(5):
        senders = [threading.Thread(target=send) for _ in range(2)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    assert len(errors) < 10, errors
    pull("127.0.0.1", server.port, "s3cret", 3, 4, str(tmp_path / "got"))
    assert (tmp_path / "got").read_bytes() == bytes(data)
    assert [n for n in os.listdir(os.path.join(server.root, "rank-3"))
            if n.endswith(".tmp")] == []


def test_a_copy_the_node_holds_already_is_not_sent_again(server, monkeypatch):
    """The same data (its checksums) under another meta, as a spare that took a leaving
    node's place sends it: answered "have", no byte of data sent; other data is sent."""
    from agents import replicas

    push("127.0.0.1", server.port, "s3cret", 3, 4, *copy_of(4))
    meta, manifest, data = copy_of(4)
    other = json.dumps({"step": 4, "rank": 3, "slot": 9, "size": len(data)}).encode()
    man = json.loads(manifest)
    man["meta"] = F.zlib.crc32(other)
    sent: list[int] = []
    real = replicas.socket.socket.sendall
    monkeypatch.setattr(replicas.socket.socket, "sendall",
                        lambda self, b, *a: (sent.append(len(b)), real(self, b, *a))[1])
    push("127.0.0.1", server.port, "s3cret", 3, 4, other, json.dumps(man).encode(), data)
    assert sum(sent) < 1000, sent  # the request line only
    sent.clear()
    push("127.0.0.1", server.port, "s3cret", 3, 5, *copy_of(5))
    assert sum(sent) > len(data), sent
    assert sorted(server.holdings()[0][3]) == [4, 5]


def test_a_replica_let_go_keeps_its_pages_for_the_next_copy_unless_it_is_being_sent(
        server, tmp_path):
    """New pages are what a copy into memory pays for most (docs/benchmarks.md): a pruned
    replica's data becomes a blank of the node's memory, and the next replica that arrives
    is written into it (the same file: its pages exist); a pull into the node takes one
    too. One being sent when it is let go is removed instead: written over, the copy on
    its way would be torn."""
    push("127.0.0.1", server.port, "s3cret", 3, 1, *copy_of(1))
    first = os.stat(tmp_path / "replicas" / "rank-3" / "step-1.data").st_ino
    server.retain = 2
    push("127.0.0.1", server.port, "s3cret", 3, 2, *copy_of(2))  # step 1 goes: a blank
    assert [os.stat(p).st_ino for _, p in F.blanks(str(tmp_path))] == [first]
    assert server.holdings() == ({3: [2]}, 100_000)  # a blank is no replica
    server.retain = 3
    push("127.0.0.1", server.port, "s3cret", 3, 3, *copy_of(3))
    assert os.stat(tmp_path / "replicas" / "rank-3" / "step-3.data").st_ino == first
    assert (tmp_path / "replicas" / "rank-3" / "step-3.data").read_bytes() == \
        bytes(copy_of(3)[2])  # verified as it came, and all of it there
    blank = [os.stat(p).st_ino for _, p in F.blanks(str(tmp_path))]  # step 2's
    assert len(blank) == 1
    pull("127.0.0.1", server.port, "s3cret", 3, 3, str(tmp_path / "pulled"), str(tmp_path))
    assert os.stat(tmp_path / "pulled").st_ino == blank[0] and F.blanks(str(tmp_path)) == []
    assert (tmp_path / "pulled").read_bytes() == bytes(copy_of(3)[2])
    # Let go while a pull reads it (the sender's shared lock): removed, not a blank.
    found = server._replica(3, 3)
    assert found is not None
    try:
        server.retain = 4
        push("127.0.0.1", server.port, "s3cret", 3, 4, *copy_of(4))
        assert F.blanks(str(tmp_path)) == [] and server.holdings()[0] == {3: [4]}
    finally:
        os.close(found[2])


def started_store(tmp_path, monkeypatch):
    """An agent's checkpoint store, started (its replica server), a worker's env set for its
    rank 0; and what it says to the controller."""
    import secrets

    from agents.checkpoints import Store

    said: list[dict] = []

    class Outbox:
        def current(self) -> object:
            return self

        def put(self, message: dict) -> None:
            said.append(message)

    store = Store(f"unit-{secrets.token_hex(4)}", 0, Outbox(), "s3cret")  # type: ignore[arg-type]
    env = store.configure(C.CheckpointConfig(memory=64 << 20), str(tmp_path), 1, 1)
    for key, value in {**env, "RANK": "0"}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    store.start()
    return store, said


def test_connections_that_say_nothing_hold_no_transfer_and_go_in_time(server, monkeypatch):
    """Anything on the network can connect to a node's replica port: eight connections that
    said nothing held every transfer's place for TIMEOUT (60 s), and no buddy's copy came
    meanwhile. A transfer's place is taken once a peer proved it knows the job's secret,
    and one that says too little within HELLO_TIMEOUT is dropped, however slowly it talks."""
    import socket
    import time

    from agents import replicas

    monkeypatch.setattr(replicas, "HELLO_TIMEOUT", 1.0, raising=False)
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
              for _ in range(8)]
    time.sleep(0.2)  # all accepted
    meta, manifest, view = copy_of(1)
    push("127.0.0.1", server.port, "s3cret", 3, 1, meta, manifest, view)  # not refused
    assert server.holdings()[0] == {3: [1]}
    trickle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    assert len(trickle.recv(16)) == 16  # the nonce
    started, said = time.monotonic(), b"?"
    while time.monotonic() - started < 10:  # a byte now and then: never enough in time
        try:
            trickle.sendall(b"x")
            said = trickle.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            time.sleep(0.2)
            continue
        except OSError:
            said = b""
        break
    assert said.startswith(b'{"ok": false') or said == b"", said  # refused, or reset
    assert time.monotonic() - started < 3  # 32 bytes at 5 a second would take 6.4 s
    for conn in [*silent, trickle]:
        conn.close()


def test_a_closing_store_ends_the_copy_it_is_sending_at_once(tmp_path, monkeypatch):
    """A buddy cut off while a copy goes to it (its link down: nothing answers, nothing
    resets) held the store's thread for the transfer's whole timeout, and the agent's end,
    which joins that thread, with it: a cut node's agent outlived its job by more than 15 s
    (one full run of the suite). Closing ends the store's own transfers at once."""
    import socket
    import threading
    import time

    import torch

    from agents import replicas
    from agents.shims import orchestrator_checkpoint as ckpt

    monkeypatch.setattr(replicas, "TIMEOUT", 20.0)  # the old code then takes 20 s, not 60
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, and never says a word
    accepted: list[object] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    store, said = started_store(tmp_path, monkeypatch)
    try:
        ckpt.save(1, {"w": torch.ones(1000)})
        store.replicate_to(C.ReplicateTo("127.0.0.1", silent.getsockname()[1]))
        deadline = time.monotonic() + 10
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert accepted, "the store never began sending the save"
        time.sleep(0.2)  # in the handshake: waiting for the buddy's word
    finally:
        started = time.monotonic()
        store.close()
        took = time.monotonic() - started
        silent.close()
    assert took < 3, f"closing the store took {took:.1f}s"
    assert not os.path.exists(store.root)
    assert not [m for m in said if m["type"] == P.ERROR], said  # a copy ended so is no news


def test_a_closing_store_ends_a_connect_to_a_buddy_that_never_answers(tmp_path, monkeypatch):
    """A buddy whose link is down drops the store's SYN: its connect waited CONNECT_TIMEOUT
    (5 s) whatever the store's close said, and the agent's end with it. Here a listener whose
    accept queue is full drops the SYN the same way; close ends the connect at once."""
    import socket
    import time

    import torch

    from agents import replicas
    from agents.shims import orchestrator_checkpoint as ckpt

    monkeypatch.setattr(replicas, "CONNECT_TIMEOUT", 20.0)  # the old code then takes 20 s
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    queued = socket.create_connection(full.getsockname(), timeout=5)  # never accepted
    probe = socket.socket()
    probe.settimeout(0.3)
    with pytest.raises(TimeoutError):  # the queue is full: a connect now hangs
        probe.connect(full.getsockname())
    probe.close()
    store, said = started_store(tmp_path, monkeypatch)
    try:
        ckpt.save(1, {"w": torch.ones(1000)})
        store.replicate_to(C.ReplicateTo("127.0.0.1", full.getsockname()[1]))
        time.sleep(1.0)  # the store's thread is in its connect
    finally:
        started = time.monotonic()
        store.close()
        took = time.monotonic() - started
        queued.close()
        full.close()
    assert took < 3, f"closing the store took {took:.1f}s"
    assert not os.path.exists(store.root)
    assert not [m for m in said if m["type"] == P.ERROR], said  # a copy ended so is no news


def test_a_closing_store_ends_the_copies_it_is_taking_and_makes_nothing_after(tmp_path):
    """A buddy's copy under way when this node's store closes (both agents of a job end
    together): the store removes its memory once close returns, and a transfer still
    writing then made files again that outlived the agent on /dev/shm (CI: a job's memory
    was still there 15 s after its agents were gone). Close ends the copies it is taking
    and returns once they are over: nothing is made after it."""
    import socket
    import time

    from agents import replicas

    root = tmp_path / "memory"
    root.mkdir()
    s = Server(str(root), "s3cret", lambda: 1 << 30, lambda _: None)
    meta, manifest, view = copy_of(1, size=4 << 20)
    conn = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    replicas._handshake_client(conn, "s3cret")
    replicas._send_line(conn, {"op": "put", "rank": 3, "step": 1, "meta": len(meta),
                               "manifest": len(manifest), "size": len(view)})
    assert replicas._answer(conn) is False  # go on
    conn.sendall(meta + manifest + view[:1 << 20])  # a quarter: the copy is under way
    time.sleep(0.3)
    started = time.monotonic()
    s.close()
    assert time.monotonic() - started < 3
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    try:
        conn.sendall(view[1 << 20:])
        conn.recv(1)
    except OSError:
        pass  # ended: what the sender should see
    conn.close()
    time.sleep(0.5)
    after = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert after == before and not (root / "replicas" / "rank-3" / "step-1.data").exists()


def test_a_released_store_keeps_nothing_and_says_so_but_still_serves(tmp_path, monkeypatch):
    """A drained node out of the job is told to let go (C.Release): its ranks' copies, its
    buddy's replicas and the pages kept for them go, its report says it holds nothing, and
    its replica server still takes copies (undrained, it may be a spare again)."""
    import time

    import torch

    from agents.shims import orchestrator_checkpoint as ckpt

    store, said = started_store(tmp_path, monkeypatch)
    try:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.ones(100_000)})
        assert store.replicas is not None
        for step in (4, 5, 6):
            push("127.0.0.1", store.replicas.port, "s3cret", 7, step, *copy_of(step))

        def held() -> dict:
            return [m for m in said if m.get("type") == P.HELD][-1]
        deadline = time.monotonic() + 10
        while not (held()["memory"] and held()["replicas"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held()["bytes"] > 0 and held()["memory"] and held()["replicas"]
        store.release()
        deadline = time.monotonic() + 10
        while held()["bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (held()["bytes"], held()["memory"], held()["replicas"]) == (0, {}, {})
        assert [n for n in os.listdir(store.root) if n.startswith("rank-")] == []
        assert F.blank_bytes(store.root) == 0
        push("127.0.0.1", store.replicas.port, "s3cret", 7, 8, *copy_of(8))
        assert store.replicas.holdings()[0] == {7: [8]}
    finally:
        store.close()


def test_a_report_taken_while_the_store_lets_go_says_before_or_after_never_between(
        tmp_path, monkeypatch):
    """A report of what the node holds, taken while release() is letting go, says what it
    held before or what it holds after: one that came between said it held a replica of
    none of the bytes (the replica's data gone, its manifest not yet), and a controller
    or a test that took 0 bytes for 'released' read a replica that was going."""
    import threading

    import torch

    from agents.shims import orchestrator_checkpoint as ckpt

    store, _ = started_store(tmp_path, monkeypatch)
    try:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.ones(100_000)})
        assert store.replicas is not None
        for step in (4, 5):
            push("127.0.0.1", store.replicas.port, "s3cret", 7, step, *copy_of(step))

        def report() -> tuple:
            with store._lock:  # as the store's reporter takes it (Store._report)
                held = store.holdings()
            return held["bytes"], held["memory"], held["replicas"]
        before = report()
        assert before[0] > 0 and before[1] and before[2]
        seen: list[tuple] = []
        reporters: list[threading.Thread] = []
        let_go = store.replicas._let_go

        def letting_go(base: str) -> None:
            let_go(base)
            reporter = threading.Thread(target=lambda: seen.append(report()))
            reporters.append(reporter)
            reporter.start()
            reporter.join(0.2)  # the reporter thread, between two replicas going
        monkeypatch.setattr(store.replicas, "_let_go", letting_go)
        store.release()
        for reporter in reporters:
            reporter.join(10)
        after = report()
        assert after == (0, {}, {})
        assert seen and all(s in (before, after) for s in seen), seen
    finally:
        store.close()


def test_ranks_that_resumed_an_older_step_than_told_are_said_to_every_node(monkeypatch):
    """Once every rank of the attempt said it loaded an older step than it was told, every
    node is told (a spare too: it holds replicas of the old timeline), once, and the step
    every node retains is found again."""
    from types import SimpleNamespace

    from orchestrator import dispatch
    from orchestrator.nodebook import NodeInfo

    monkeypatch.setattr(dispatch, "assign_buddies", lambda engine: None)
    sent: list[tuple[int, C.Command]] = []
    nodes = [SimpleNamespace(index=i, channel=object(), info=NodeInfo()) for i in range(3)]
    loaded: list[int] = []
    attempt = SimpleNamespace(number=2, restored_step=100, plan=SimpleNamespace(world_size=2),
                              checkpoint=C.CheckpointConfig(restore_step=100),
                              loaded=lambda step: loaded.append(step) or setattr(
                                  attempt, "restored_step", step))
    holdings = Holdings()
    holdings._retained = 100
    engine = SimpleNamespace(holdings=holdings, current=attempt, nodes=nodes,
                             book=SimpleNamespace(note=lambda node, info: None),
                             pool=SimpleNamespace(send=lambda node, command:
                                                  sent.append((node.index, command))))

    def report(node: int, rank: int) -> None:
        dispatch._on_message(engine, nodes[node], dataclasses.replace(  # type: ignore[arg-type]
            held({rank: [90]}), attempt=2, restored={rank: (2, 90, "memory", 0.1, 1)}))
    report(0, 0)
    assert sent == [] and loaded == []  # not every rank said yet
    report(1, 1)
    assert sent == [(i, C.Resumed(90, 2)) for i in range(3)] and loaded == [90]
    assert holdings._retained is None
    report(1, 1)
    assert len(sent) == 3  # once


def test_a_node_lost_to_silence_is_forgotten_as_a_holder_of_copies(tmp_path):
    """A node whose link is cut goes LOST by silence, its channel dropped by the controller
    (no Closed comes then): what it last said it held stayed, and the next attempt's pulls
    could name it as the source of a rank's copy (its load failing, again every attempt),
    the retained step counted its replicas. Found by a reading helper."""
    import threading
    import time

    from orchestrator.state import NodeState
    from tests.unit.test_crash_only import all_started, fake_job, until

    _, cluster, controller = fake_job(
        tmp_path, "gone-000001", "name: gone\nnodes: [{host: n0}, {host: n1}, {host: n2}]\n"
        "nnodes: 2\ncommand: [train]\nmax_restarts: 0\n"
        "health: {heartbeat_interval: 0.5, node_timeout: 2, controller_grace: 1}\n")
    spare = controller.nodes[2]
    seen: list[object] = []

    def drive() -> None:
        deadline = time.monotonic() + 30
        until(all_started(controller), deadline)
        controller.engine.loop.call_later(0.0, lambda: controller.engine.holdings.update(
            2, held({}, {0: [9], 1: [9]}, port=4002)))  # the spare holds both ranks' step 9
        while controller.engine.holdings.summary(2) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(controller.engine.holdings.summary(2))
        cluster.kill("n2")  # its link cut
        while spare.state != NodeState.LOST and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(spare.state)
        time.sleep(0.2)
        seen.append(controller.engine.holdings.summary(2))
        controller.request_cancel()

    threading.Thread(target=drive, daemon=True).start()
    try:
        controller.run()
    finally:
        cluster.close()
    assert seen[0] is not None and seen[1] == NodeState.LOST, seen
    assert seen[2] is None, seen  # forgotten with its channel


def test_a_spare_lets_go_of_the_steps_after_the_one_an_attempt_starts_from(tmp_path,
                                                                          monkeypatch):
    """A fall back below a step that failed: the participants dropped their copies of the
    later steps as the attempt started, the spare kept its replicas of them, and when that
    attempt failed for another reason the next one resumed the failed step again from the
    spare and failed the same way. As an attempt starts, the spares are told its step; a
    participant of it already was. Found by a reading helper."""
    from types import SimpleNamespace

    from orchestrator import dispatch

    store, _ = started_store(tmp_path, monkeypatch)  # a spare: it runs nothing of attempt 2
    try:
        assert store.replicas is not None
        for step in (90, 95, 100):
            push("127.0.0.1", store.replicas.port, "s3cret", 7, step, *copy_of(step))
        store.resumed(C.Resumed(95, 2))
        assert sorted(store.replicas.holdings()[0][7]) == [90, 95]
        store.resumed(C.Resumed(90, 1))  # of an attempt before this node's: nothing
        assert sorted(store.replicas.holdings()[0][7]) == [90, 95]
    finally:
        store.close()
    sent: list[tuple[int, C.Command]] = []
    nodes = [SimpleNamespace(index=i, channel=object()) for i in range(3)]
    attempt = SimpleNamespace(number=2, node_plans={0: None, 1: None},
                              checkpoint=C.CheckpointConfig(restore_step=95))
    engine = SimpleNamespace(current=attempt, nodes=nodes, pool=SimpleNamespace(
        send=lambda node, command: sent.append((node.index, command))))
    dispatch.spares_resume(engine)  # type: ignore[arg-type]
    assert sent == [(2, C.Resumed(95, 2))]


def test_a_spare_told_a_later_attempt_resumed_takes_no_copy_of_an_attempt_before(tmp_path,
                                                                                 monkeypatch):
    """A spare (it runs nothing) told that attempt 2 resumed step 95 dropped the later steps,
    but went on taking puts of attempt 1: a push of the abandoned timeline still under way
    (or from a node that left the job) landed after the discard, and a later attempt could
    resume it. Found by a reading helper."""
    store, _ = started_store(tmp_path, monkeypatch)
    try:
        assert store.replicas is not None
        push("127.0.0.1", store.replicas.port, "s3cret", 7, 95, *copy_of(95), attempt=1)
        store.resumed(C.Resumed(95, 2))
        with pytest.raises(ReplicaError, match="a copy of attempt 1, before this node's 2"):
            push("127.0.0.1", store.replicas.port, "s3cret", 7, 100, *copy_of(100),
                 attempt=1)
        push("127.0.0.1", store.replicas.port, "s3cret", 7, 96, *copy_of(96), attempt=2)
        assert sorted(store.replicas.holdings()[0][7]) == [95, 96]
    finally:
        store.close()


def test_each_node_shows_how_far_back_its_loss_would_take_its_ranks():
    """``newest_elsewhere``: the newest step of which every rank a node holds has a copy that
    outlives the node (another node's replica, or persisted where another node reads it):
    what its loss costs now. Status showed what a node holds of others, never that."""
    h = Holdings()
    h.update(0, held({0: [5, 6, 7], 1: [5, 6, 7]}, port=4000))
    assert h.summary(0)["newest_elsewhere"] is None  # type: ignore[index]
    h.update(2, held(replicas={0: [4, 6], 1: [6]}, port=4002))  # the spare, two saves behind
    assert h.summary(0)["newest_elsewhere"] == 6  # type: ignore[index]
    h.update(1, held({2: [7]}, {0: [5], 1: [4]}, port=4001))  # its buddy, further behind
    assert h.summary(0)["newest_elsewhere"] == 6  # type: ignore[index]
    h.update(2, held(replicas={0: [6], 1: [5]}, port=4002))
    assert h.summary(0)["newest_elsewhere"] == 5  # type: ignore[index]  # rank 0's on node 1
    h.update(1, held({2: [7]}, port=4001))
    assert h.summary(0)["newest_elsewhere"] is None  # type: ignore[index]  # no step in common
    assert h.keeping(2) == [0] and h.keeping(1) == [] and h.keeping(0) == []
    # Persisted: only where another node reads the same checkpoint.dir.
    own = P.Held(1, {0: (7,), 1: (7,)}, {0: (3, 7), 1: (3, 7)}, 0, "disk-0", port=4000)
    h = Holdings()
    h.update(0, own)
    h.update(1, P.Held(1, {2: (7,)}, {}, 0, "disk-1", port=4001))
    assert h.summary(0)["newest_elsewhere"] is None  # type: ignore[index]  # its own disk
    h.update(1, P.Held(1, {2: (7,)}, {}, 0, "disk-0", port=4001))
    assert h.summary(0)["newest_elsewhere"] == 7  # type: ignore[index]  # a shared one


def test_a_spares_report_refreshes_what_the_nodes_it_keeps_copies_of_show(monkeypatch):
    """A node's copies elsewhere change with the report of the node that keeps them, not
    with its own: the spare's report updates what status shows of the nodes whose ranks it
    holds (once changed), not only its own."""
    from types import SimpleNamespace

    from orchestrator import dispatch
    from orchestrator.nodebook import NodeInfo

    monkeypatch.setattr(dispatch, "assign_buddies", lambda engine: None)
    nodes = [SimpleNamespace(index=i, channel=object(), info=NodeInfo()) for i in range(3)]
    noted: list[int] = []

    def note(node: SimpleNamespace, info: NodeInfo) -> None:
        noted.append(node.index)
        node.info = info
    engine = SimpleNamespace(holdings=Holdings(), current=None, nodes=nodes,
                             book=SimpleNamespace(note=note))

    def report(node: int, message: P.Held) -> None:
        dispatch._on_message(engine, nodes[node], message)  # type: ignore[arg-type]
    report(0, held({0: [7], 1: [7]}, port=4000))
    report(1, held({2: [7], 3: [7]}, port=4001))
    assert nodes[0].info.checkpoint["newest_elsewhere"] is None
    noted.clear()
    report(2, held(replicas={0: [7], 1: [7]}, port=4002))
    assert nodes[0].info.checkpoint["newest_elsewhere"] == 7, nodes[0].info.checkpoint
    assert nodes[1].info.checkpoint["newest_elsewhere"] is None and noted == [2, 0]
    report(2, held(replicas={0: [7], 1: [7], 2: [6]}, port=4002))
    assert noted == [2, 0, 2]  # node 0's unchanged, node 1's rank 3 still has none
