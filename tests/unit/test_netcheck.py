"""The network check's judgement (orchestrator/netcheck.py) and its two ends on a node
(agents/netcheck.py) over loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from agents import netcheck as ends
from agents import protocol as P
from orchestrator.netcheck import Link, judge, links

MiB = 2**20
NAMES = ["n0", "n1", "n2", "n3"]


def measured(n, seconds):
    """Links of n nodes, each taking ``seconds[(src, dst)]`` (None: failed), else 0.01 s."""
    out = links(n)
    for link in out:
        took = seconds.get((link.src, link.dst), 0.01)
        if took is None:
            link.error = "Connection refused"
        else:
            link.seconds = took
    return out


def test_the_ring_comes_first_then_every_node_to_node_0_without_repeats():
    assert [(x.src, x.dst) for x in links(1)] == []
    assert [(x.src, x.dst) for x in links(2)] == [(0, 1), (1, 0)]
    assert [(x.src, x.dst) for x in links(4)] == [(0, 1), (1, 2), (2, 3), (3, 0), (1, 0),
                                                  (2, 0)]


def test_a_node_whose_every_link_is_slow_is_the_unhealthy_one_and_the_slowest_is_named():
    # 8 MiB in 2 s: 4.2 MB/s on both links of n2; the others are fast.
    found = measured(4, {(1, 2): 2.0, (2, 3): 2.0, (2, 0): 2.0})
    unhealthy, summary = judge(found, 4, 8 * MiB, 100.0, NAMES)
    assert list(unhealthy) == [2]
    assert "every link of this node is slow or broken (below health.network_check." \
           "min_mb_per_s 100)" in unhealthy[2]
    assert "n1 -> n2 4.2 MB/s" in unhealthy[2] and "n2 -> n0 4.2 MB/s" in unhealthy[2]
    assert summary.startswith("network check: 6 link(s) of 8 MiB, slowest n")
    assert "4.2 MB/s" in summary and "median" in summary


def test_one_slow_link_alone_blames_nobody():
    unhealthy, summary = judge(measured(4, {(1, 2): 2.0}), 4, 8 * MiB, 100.0, NAMES)
    assert unhealthy == {} and "slowest n1 -> n2 4.2 MB/s" in summary


def test_without_a_minimum_only_failed_transfers_are_bad():
    slow = measured(3, {(1, 2): 5.0, (2, 0): 5.0})
    assert judge(slow, 3, 8 * MiB, None, NAMES)[0] == {}
    broken = measured(3, {(1, 2): None, (2, 0): None})
    unhealthy, summary = judge(broken, 3, 8 * MiB, None, NAMES)
    assert list(unhealthy) == [2] and "failed (Connection refused)" in unhealthy[2]
    assert "slowest n1 -> n2 failed (Connection refused)" in summary


def test_when_no_link_is_good_every_node_is_unhealthy():
    unhealthy, _ = judge(measured(2, {(0, 1): None, (1, 0): None}), 2, MiB, None, NAMES)
    assert sorted(unhealthy) == [0, 1]


def test_a_link_carries_its_bytes_and_the_sender_times_it():
    token = bytes(range(32))
    receiver = ends.Receiver(token, 4 * MiB, timeout=10)
    try:
        seconds = ends.send("127.0.0.1", receiver.port, token, 4 * MiB, timeout=10)
        assert 0 < seconds < 10
        assert Link(0, 1, seconds).mb_per_s(4 * MiB) > 1
    finally:
        receiver.close()


def test_the_receiver_takes_nothing_from_a_stranger_and_no_more_than_its_size():
    token = bytes(32)
    receiver = ends.Receiver(token, MiB, timeout=10)
    try:
        with pytest.raises(OSError):  # the wrong token: closed, no answer
            ends.send("127.0.0.1", receiver.port, b"x" * 32, MiB, timeout=5)
        # It answers once its size has arrived, and reads no further (a longer sender
        # would be reset).
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as conn:
            conn.sendall(token + bytes(MiB))
            assert conn.recv(1) == ends.DONE
        # Still serving the job's own agents.
        assert ends.send("127.0.0.1", receiver.port, token, MiB, timeout=5) > 0
    finally:
        receiver.close()


def test_a_receiver_past_its_time_closes_its_port():
    receiver = ends.Receiver(bytes(32), MiB, timeout=0.3)
    port = receiver.port
    deadline = time.monotonic() + 5
    while not receiver.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.closed
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_transfer_past_its_timeout_fails():
    # A peer that accepts and never reads: the sender's buffers fill, then the timeout.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    try:
        with pytest.raises(OSError):
            ends.send("127.0.0.1", server.getsockname()[1], bytes(32), 256 * MiB, timeout=1)
    finally:
        server.close()


def test_the_door_wants_a_time_or_an_error_but_not_both():
    assert P.check({"type": "net_sent", "req": 1, "seconds": 0.5}) is None
    assert P.check({"type": "net_sent", "req": 1, "error": "refused"}) is None
    assert P.check({"type": "net_sent", "req": 1}) is not None
    assert P.check({"type": "net_sent", "req": 1, "seconds": 1, "error": "x"}) is not None
    assert P.check({"type": "net_sent", "req": 1, "seconds": -1}) is not None
    assert P.check({"type": "net_listening", "req": 1, "port": 0}) is not None
