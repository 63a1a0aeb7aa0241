"""What a node says is checked at the door: each malformed message or reply, from fake agents,
loses that node (naming the field) and never the controller; a node speaks only for its own
ranks; an agent's wild claims are bounded."""

from __future__ import annotations

import threading
import time

from orchestrator.controller import Controller
from orchestrator.spec import parse_jobspec
from orchestrator.state import JobState
from orchestrator.store import Store
from orchestrator.transport.fake import FakeAgent

SPEC = """
name: door
nodes: [{host: a}, {host: b}]
nproc_per_node: 2
command: [train]
max_restarts: 1
restart_backoff: {initial: 0.01, max: 0.01}
health: {heartbeat_interval: 1, node_timeout: 30}
"""


def run(tmp_path, setup, spec=SPEC, *, during=None, job_id="door-000001"):
    """Run a job on fake agents a and b; ``setup(agent, number)`` prepares each agent (number:
    how many agents that host had before it); ``during(store)`` runs on a thread meanwhile."""
    parsed = parse_jobspec(spec)
    store = Store(tmp_path / "home")
    store.create_job(job_id, "door", parsed.model_dump_json(), str(tmp_path),
                     parsed.max_restarts, [n.host for n in parsed.nodes])
    made: dict[str, int] = {}

    def connect(node, _spec):
        agent = FakeAgent(node.host, {}, [])
        setup(agent, made.get(node.host, 0))
        made[node.host] = made.get(node.host, 0) + 1
        return agent

    controller = Controller(store, job_id, parsed, str(tmp_path), connect)
    if during is not None:
        threading.Thread(target=during, args=(store, controller), daemon=True).start()
    state = controller.run()
    job = store.get_job(job_id)
    assert "controller error" not in ((job.failure or {}).get("message") or ""), job.failure
    return state, job


def lost_with(job, host, *fragments):
    events = [e for n in job.nodes if n.host == host for e in n.history
              if e.state.value in ("LOST", "FAILED") and e.message]
    assert events, [(n.host, [(e.state.value, e.message) for e in n.history]) for n in job.nodes]
    assert all(f in events[0].message for f in ("malformed message", *fragments)), events[0]


def once(kind, change):
    """A tamper that changes the first message of ``kind``."""
    done = []

    def tamper(message):
        if message.get("type") == kind and not done:
            done.append(1)
            return change(message)
        return message

    return tamper


def test_a_hello_with_a_bad_worker_entry_fails_that_node(tmp_path):
    def setup(agent, n):
        if agent.host == "b":
            agent.tamper = once("hello", lambda m: {**m, "workers": [1]})

    state, job = run(tmp_path, setup)
    assert state == JobState.FAILED and job.failure["cause"] == "LAUNCH_FAILED"
    assert job.failure["host"] == "b" and "hello: bad workers" in job.failure["message"]


def test_a_port_reply_that_is_not_a_port_costs_a_restart_not_the_controller(tmp_path):
    def setup(agent, n):
        if agent.host == "a" and n == 0:
            agent.tamper = once("port", lambda m: {**m, "port": "x"})

    state, job = run(tmp_path, setup)
    assert state == JobState.SUCCEEDED and job.restarts == 1, job.failure
    lost_with(job, "a", "port: bad port 'x'")


def test_output_for_an_impossible_rank_loses_the_node_and_the_job_goes_on(tmp_path):
    def setup(agent, n):
        if agent.host == "b" and n == 0:
            agent.tamper = once("started", lambda m: {**m, "rank": 10 ** 300})

    state, job = run(tmp_path, setup)
    assert state == JobState.SUCCEEDED and job.restarts == 1, job.failure
    lost_with(job, "b", "started: bad rank")
    assert job.attempts[0].failure["cause"] == "NODE_FAIL"


def test_a_node_cannot_end_another_nodes_ranks(tmp_path):
    # Node a's workers run on; b claims that a's rank 0 exited 0 (and then its own ranks).
    def setup(agent, n):
        if agent.host == "a" and n == 0:
            agent.exits = {1: {0: None, 1: None}}
        if agent.host == "b" and n == 0:
            agent.tamper = once("exited", lambda m: {**m, "rank": 0})

    state, job = run(tmp_path, setup)
    first = job.attempts[0]
    assert first.outcome == "FAILED" and first.failure["host"] == "b", first.failure
    lost_with(job, "b", "rank 0 is not this node's")
    assert state == JobState.SUCCEEDED and job.attempt == 2


def test_a_deeply_nested_error_file_is_shown_as_text(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000

    def setup(agent, n):
        agent.exits = {1: {0: 3}} if agent.host == "a" else {}
        agent.tamper = lambda m: {**m, "error_file": deep} if m.get("type") == "exited" \
            and m.get("rank") == 0 else m

    state, job = run(tmp_path, setup, SPEC.replace("max_restarts: 1", "max_restarts: 0"))
    assert state == JobState.FAILED and job.failure["cause"] == "WORKER_FAILED"
    assert job.failure["exit_code"] == 3 and "error file (not torch's): [[[" in \
        job.failure["message"]


def test_a_stacks_reply_naming_no_rank_loses_that_node(tmp_path):
    def setup(agent, n):
        agent.exits = {1: {0: None, 1: None, 2: None, 3: None}} if n == 0 else {}
        if agent.host == "b" and n == 0:
            agent.stacks = {"x": {"method": "py-spy", "text": "..."}}

    def during(store, controller):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (controller.current and
                                                   controller.current.all_started):
            time.sleep(0.02)
        store.request_stacks("door-000001")

    state, job = run(tmp_path, setup, during=during)
    lost_with(job, "b", "stacks: bad stacks 'x'")
    assert state == JobState.SUCCEEDED and job.restarts == 1


def test_a_node_claiming_a_billion_gpus_gets_a_plausible_count(tmp_path):
    def setup(agent, n):
        agent.gpus = 10 ** 9

    state, job = run(tmp_path, setup, SPEC.replace("nproc_per_node: 2", "nproc_per_node: auto"))
    assert state == JobState.SUCCEEDED
    assert job.attempts[0].world_size == 2 * 64  # capped per node (protocol.MAX_GPUS)


def test_late_replies_are_dropped_and_nothing_waits_for_them(tmp_path):
    from agents import commands as C
    from agents import protocol as P
    from orchestrator.channel import Channel, ask

    class Conn:
        host = "h"

        def send(self, message):
            pass

    hello = P.parse({"type": "hello", "protocol": P.VERSION, "pid": 1, "attempt": 0,
                     "workers": []})
    channel = Channel(0, Conn(), 1, hello, False)
    for _ in range(1000):
        assert ask(channel, C.FreePort(), 0) is None  # no reply in time: forgotten
    for req in range(1, 1001):  # then every reply comes, late
        channel.resolve(P.PortReply(req, 1, True))
    assert channel._pending == {}
