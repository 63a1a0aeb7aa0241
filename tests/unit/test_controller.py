"""The restart policy, driven by a fake transport that scripts agent messages."""

from __future__ import annotations

import time

import pytest

from agents import commands as C
from agents import protocol as P
from orchestrator.controller import Controller
from orchestrator.spec import parse_jobspec
from orchestrator.state import JobState
from orchestrator.store import Store
from orchestrator.transport.fake import FakeAgent


def run_job(tmp_path, yaml_text: str, exits_by_host: dict[str, dict]) -> tuple[Store, str, list]:
    spec = parse_jobspec(yaml_text)
    store = Store(tmp_path / "home")
    job_id = "fake-000001"
    store.create_job(job_id, spec.name, spec.model_dump_json(), str(tmp_path),
                     spec.max_restarts, [n.host for n in spec.nodes])
    log: list = []
    agents = {}

    def connect(node, _spec):
        agents[node.host] = FakeAgent(node.host, exits_by_host.get(node.host, {}), log)
        return agents[node.host]

    Controller(store, job_id, spec, str(tmp_path), connect).run()
    return store, job_id, log


SPEC = """
name: fake
nodes: [{host: a}, {host: b}]
nproc_per_node: 2
command: [train]
max_restarts: 2
restart_backoff: {initial: 0.01, max: 0.01}
health: {heartbeat_interval: 1, node_timeout: 30}
"""


def test_success_on_first_attempt(tmp_path):
    store, job_id, log = run_job(tmp_path, SPEC, {})
    job = store.get_job(job_id)
    assert job.state == JobState.SUCCEEDED and job.attempt == 1 and job.restarts == 0
    assert job.failure is None
    starts = [m for _, m in log if m["op"] == "start"]
    assert [w["rank"] for m in starts for w in m["workers"]] == [0, 1, 2, 3]


def test_one_crash_costs_one_restart_for_the_whole_job(tmp_path):
    exits = {"b": {1: {2: 5, 3: None}}}  # attempt 1: rank 2 exits 5, rank 3 hangs
    exits["a"] = {1: {0: None, 1: None}}
    store, job_id, log = run_job(tmp_path, SPEC, exits)
    job = store.get_job(job_id)
    assert job.state == JobState.SUCCEEDED
    assert job.attempt == 2 and job.restarts == 1
    first = job.attempts[0]
    assert first.outcome == "FAILED" and first.failure["rank"] == 2
    assert first.failure["exit_code"] == 5 and first.failure["stderr_tail"] == ["boom 2"]
    # Every node was told to stop attempt 1, and attempt 2 counts one restart.
    assert {h for h, m in log if m["op"] == "stop" and m["attempt"] == 1} == {"a", "b"}
    second = [m for _, m in log if m["op"] == "start" and m["attempt"] == 2]
    assert {m["env"]["TORCHELASTIC_RESTART_COUNT"] for m in second} == {"1"}


def test_always_failing_rank_exhausts_budget(tmp_path):
    exits = {"a": {a: {1: "SIGSEGV"} for a in range(1, 5)}}
    store, job_id, _ = run_job(tmp_path, SPEC, exits)
    job = store.get_job(job_id)
    assert job.state == JobState.FAILED
    assert job.attempt == 3 and job.restarts == 2  # max_restarts + 1 attempts
    assert job.failure["rank"] == 1 and job.failure["signal"] == "SIGSEGV"
    assert job.failure["restarts_exhausted"] is True


def test_fail_on_exit_codes_skips_the_budget(tmp_path):
    spec = SPEC + "fail_on_exit_codes: [42]\n"
    store, job_id, _ = run_job(tmp_path, spec, {"b": {1: {3: 42}}})
    job = store.get_job(job_id)
    assert job.state == JobState.FAILED and job.attempt == 1 and job.restarts == 0
    assert job.failure["exit_code"] == 42 and job.failure["restarts_exhausted"] is False


def test_unreachable_node_fails_launch_naming_host(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000002", "fake", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])

    def connect(node, _spec):
        agent = FakeAgent(node.host, {}, [])
        agent.fail_open = node.host == "b"
        return agent

    state = Controller(store, "fake-000002", spec, str(tmp_path), connect).run()
    job = store.get_job("fake-000002")
    assert state == JobState.FAILED and job.failure["cause"] == "LAUNCH_FAILED"
    assert job.failure["host"] == "b" and "connection refused" in job.failure["message"]


@pytest.mark.parametrize("max_restarts", [0])
def test_no_restart_budget_fails_at_once(tmp_path, max_restarts):
    spec = SPEC.replace("max_restarts: 2", f"max_restarts: {max_restarts}")
    store, job_id, _ = run_job(tmp_path, spec, {"a": {1: {0: 1}}})
    job = store.get_job(job_id)
    assert job.state == JobState.FAILED and job.attempt == 1
    assert job.failure["restarts_exhausted"] is False


def test_agent_of_another_protocol_fails_the_launch_naming_the_node(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000003", "fake", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])

    def connect(node, _spec):
        agent = FakeAgent(node.host, {}, [])
        agent.protocol = 1 if node.host == "b" else P.VERSION
        return agent

    state = Controller(store, "fake-000003", spec, str(tmp_path), connect).run()
    job = store.get_job("fake-000003")
    assert state == JobState.FAILED and job.failure["cause"] == "LAUNCH_FAILED"
    message = job.failure["message"]
    assert message.startswith("b: ") and "protocol 1" in message
    assert f"speaks {P.VERSION}" in message
    assert "\n" not in message


def test_requests_match_replies_drop_late_ones_and_wake_on_close():
    """The one request helper (orchestrator/channel.py, was protocol.Mailbox)."""
    import threading

    from orchestrator.channel import Channel, ask

    sent = []

    class Conn:
        host = "h"

        def send(self, message):
            sent.append(message)

    hello = P.parse({"type": "hello", "protocol": P.VERSION, "pid": 1, "attempt": 0,
                     "workers": []})
    channel = Channel(0, Conn(), 1, hello, False)
    future = channel.request(C.FreePort(port=0))
    assert sent[-1] == {"op": "free_port", "req": future.req, "port": 0}
    # Not a reply: the loop hands it to the controller, never to a request.
    assert not isinstance(P.parse({"type": "heartbeat", "attempt": 0}), P.Reply)
    reply = P.parse({"type": "port", "req": future.req, "port": 5, "ok": True})
    threading.Timer(0.05, channel.resolve, args=(reply,)).start()
    assert future.result(2.0) == P.PortReply(future.req, 5, True)
    # A reply nobody waits for any more is dropped; the channel's end wakes every waiter.
    assert ask(channel, C.Listen(), 0.05) is None
    channel.resolve(P.parse({"type": "listening", "req": future.req + 1, "ok": True}))
    later = channel.request(C.Listen())
    threading.Timer(0.05, channel.end).start()
    assert later.result(5.0) is None and channel.closed


def test_malformed_agent_message_loses_the_node_and_never_crashes_the_controller(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000004", "fake", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])

    def connect(node, _spec):
        agent = FakeAgent(node.host, {1: {0: None, 1: None}}, [])
        agent.malformed = node.host == "b"
        return agent

    state = Controller(store, "fake-000004", spec, str(tmp_path), connect).run()
    job = store.get_job("fake-000004")
    first = job.attempts[0].failure
    assert first["cause"] == "NODE_FAIL" and first["host"] == "b"
    assert "malformed message from the agent" in first["message"] and "bad rank" in \
        first["message"]
    # The controller carried on: it tried again, and ended the job with a state, not a crash.
    assert state in (JobState.FAILED, JobState.SUCCEEDED)
    assert "controller error" not in (job.failure or {}).get("message", "")


def test_protocol_check_names_the_field():
    from agents.protocol import check

    assert check({"type": "output", "attempt": 1, "rank": 0, "stream": "stdout",
                  "lines": ["a"], "seq": 3}) is None
    assert check({"type": "exited", "attempt": 1, "rank": None, "local_rank": 0,
                  "exit_code": None, "signal": "SIGKILL", "seq": 4}) is None
    assert "bad pid" in check({"type": "started", "attempt": 1, "rank": 0, "local_rank": 0,
                               "pid": True})
    assert "seq" in check({"type": "stopped", "attempt": 1, "seq": "7"})
    assert "lines must be text" in check({"type": "output", "attempt": 1, "rank": 0,
                                          "stream": "stdout", "lines": [1]})
    assert check({"type": 5}) == "no message type"


def test_node0_dropping_while_the_port_is_picked_costs_a_restart_not_the_job(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home")
    store.create_job("fake-000005", "fake", spec.model_dump_json(), str(tmp_path), 2, ["a", "b"])
    dropped: list = []

    def connect(node, _spec):
        agent = FakeAgent(node.host, {}, [])
        if node.host == "a" and not dropped:
            agent.drop_port = True
            dropped.append(agent)
        return agent

    state = Controller(store, "fake-000005", spec, str(tmp_path), connect).run()
    job = store.get_job("fake-000005")
    assert state == JobState.SUCCEEDED, job.failure
    assert job.restarts == 1 and job.attempt == 1  # no attempt was started on the lost port


def test_a_stop_answered_before_the_deadline_counts_though_read_after_it(tmp_path, monkeypatch):
    """A controller far behind its queue (thousands of nodes) must not call a node that
    answered `stopped` in time LOST because it read the answer late: that drops the node's
    channel and, with it, the lines still queued behind."""
    from orchestrator import controller as controller_module
    from orchestrator.engine import Engine

    monkeypatch.setattr(controller_module, "STOP_MARGIN", 0.3)
    original = Engine.turn  # one turn of the controller's loop (was Controller._pump)
    lagged: list[float] = []

    def behind(self, timeout):
        attempt = self.current
        if attempt is not None and attempt.stopping and attempt.number == 1:
            # Busy elsewhere until past the deadline: every `stopped` waits in the queue.
            lagged.append(time.monotonic())
            if lagged[-1] - lagged[0] < 0.8:
                time.sleep(timeout)
                return
        original(self, timeout)

    monkeypatch.setattr(Engine, "turn", behind)
    exits = {"b": {1: {2: 5, 3: None}}, "a": {1: {0: None, 1: None}}}
    store, job_id, _ = run_job(tmp_path, SPEC.replace("command: [train]",
                                                      "command: [train]\nstop_grace_period: 0.1"),
                               exits)
    job = store.get_job(job_id)
    assert lagged, "the stop phase was never reached"
    assert job.state == JobState.SUCCEEDED and job.attempt == 2, job.failure
    lost = [e for n in job.nodes for e in n.history if e.state.value == "LOST"]
    assert lost == []


def test_a_spare_takes_the_place_of_the_node_a_failure_names_and_nobody_else_moves():
    from types import SimpleNamespace

    from orchestrator.controller import choose_participants

    nodes = {i: SimpleNamespace(index=i) for i in range(5)}

    def last(participants, failed):
        failure = None if failed is None else SimpleNamespace(node_index=failed)
        return SimpleNamespace(participants=participants, failure=failure)

    def chosen(healthy, previous, most=3):
        return [n.index for n in choose_participants([nodes[i] for i in healthy], previous, most)]

    assert chosen([0, 1, 2, 3, 4], None) == [0, 1, 2]  # the first attempt: the first ones
    # node 1 failed: spare 3 takes its place (node rank 1); node 1 is a spare now
    assert chosen([0, 1, 2, 3, 4], last([0, 1, 2], 1)) == [0, 3, 2]
    # then node 3 is lost: the first spare, in spec order (node 1 is healthy again)
    assert chosen([0, 1, 2, 4], last([0, 3, 2], 3)) == [0, 1, 2]
    # a worker's failure with no spare left: the same nodes in the same places
    assert chosen([0, 3, 2], last([0, 3, 2], 3)) == [0, 3, 2]
    # the failed node is the only one left to fill its place
    assert chosen([0, 1, 2, 3], last([3, 0, 2], 1)) == [3, 0, 2]
    # no failure named (a hang): nobody moves, and a node that is gone is replaced
    assert chosen([0, 2, 3, 4], last([0, 1, 2], None)) == [0, 3, 2]


def test_a_node_is_connecting_until_the_controller_handled_the_outcome(tmp_path):
    """A wait for connects to end (a resumed controller's, before it picks participants)
    must find each node's outcome handled, not queued: a node still counts as connecting
    while its Attached or Unavailable waits in the loop (CI caught a resumed controller
    launching on the two of three nodes whose Attached happened to be handled first)."""
    from orchestrator.errors import OrchestratorError
    from orchestrator.loop import EventLoop
    from orchestrator.nodebook import Node
    from orchestrator.nodepool import NodePool

    spec = parse_jobspec(SPEC)

    class Unreachable:
        def __init__(self, node, _spec):
            pass

        def open(self):
            raise OrchestratorError("a: no route to host")

    loop = EventLoop()
    pool = NodePool("fake-000001", spec, "s" * 32, Unreachable, loop)
    node = Node(0, spec.nodes[0])
    pool.connect(node, launch=True)
    events: list = []
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        events = loop.poll(0.1)
    assert [type(e).__name__ for e in events] == ["Unavailable"]
    assert node.connecting  # its outcome is not handled yet
    pool.close()


def test_a_node_tried_again_is_tried_at_once_when_the_job_ends(tmp_path, monkeypatch):
    """A node that stays away is tried again after ever longer delays (up to RECONNECT_MAX):
    when the job ends, the controller tries it at once and from the first delay on, so that
    its agent, back, is shut down then (a cut node's agent outlived its job by the last
    delay, and the cleanup of a test cutting a node by more than 15 s under load). One
    connect at a time still: the retry that was due never comes."""
    import threading

    from orchestrator import nodepool
    from orchestrator.errors import OrchestratorError
    from orchestrator.loop import EventLoop
    from orchestrator.nodebook import Node

    monkeypatch.setattr(nodepool, "RECONNECT_MAX", 20.0)
    spec = parse_jobspec(SPEC)
    tries: list[float] = []
    ends: list[float] = []
    slow = threading.Event()  # set: the next connect takes 4 s (then fails)
    out = [0, 0]  # connects out now, the most at once

    class Unreachable:
        def __init__(self, node, _spec):
            pass

        def open(self):
            tries.append(time.monotonic())
            out[0] += 1
            out[1] = max(out)
            try:
                if slow.is_set():
                    slow.clear()
                    time.sleep(4.0)
                raise OrchestratorError("a: no route to host")
            finally:
                out[0] -= 1
                ends.append(time.monotonic())

    loop = EventLoop()
    pool = nodepool.NodePool("fake-000001", spec, "s" * 32, Unreachable, loop)
    node = Node(0, spec.nodes[0])
    pool.connect(node, launch=False, retry=True)
    deadline = time.monotonic() + 10
    while len(tries) < 5 and time.monotonic() < deadline:  # delays 0.2, 0.4, 0.8, 1.6: 3.2 next
        loop.poll(0.05)
    while not node.link.waiting and time.monotonic() < deadline:
        loop.poll(0.01)
    assert len(tries) == 5
    slow.set()
    hurried = time.monotonic()
    pool.hurry(node)
    while len(tries) < 7 and time.monotonic() < hurried + 6:  # past the due retry's time
        loop.poll(0.02)
    pool.close()
    assert len(tries) == 7 and tries[5] - hurried < 0.5, [t - hurried for t in tries[5:]]
    assert tries[6] - ends[5] < 0.6  # from the first delay on
    assert out[1] == 1  # the retry due 3.2 s after the fifth did not come meanwhile
