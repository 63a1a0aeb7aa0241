"""A busy node is not a lost one: the real controller against in-process fake agents
(orchestrator/transport/fake.py). A node silent past the UNREACHABLE mark (half of
node_timeout) keeps its channel while the controller reconnects: what it says on it
brings it back, also when a new connection to it would come up too late (a relay started
on an oversubscribed node took 1.2 s in CI, and the node was LOST at node_timeout 2)."""

from __future__ import annotations

import threading
import time

from orchestrator.controller import Controller
from orchestrator.spec import parse_jobspec
from orchestrator.state import JobState, NodeState
from orchestrator.store import Store
from orchestrator.transport.fake import FakeCluster

SPEC = """
name: busy
nodes: [{host: n0}, {host: n1}, {host: n2}]
command: [train]
max_restarts: 0
health: {heartbeat_interval: 0.5, node_timeout: 2, controller_grace: 1}
"""


def test_a_node_starved_past_the_unreachable_mark_is_back_on_its_channel_not_lost(tmp_path):
    spec = parse_jobspec(SPEC)
    store = Store(tmp_path / "home", durable=True)
    job_id = "busy-000001"
    store.create_job(job_id, spec.name, spec.model_dump_json(), str(tmp_path),
                     spec.max_restarts, [n.host for n in spec.nodes])
    cluster = FakeCluster(heartbeat_interval=0.5, run=True)
    controller = Controller(store, job_id, spec, str(tmp_path), cluster)
    busy = controller.nodes[1]
    seen: list[NodeState] = []
    errors: list[BaseException] = []

    def until(cond, what: str, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while not cond():
            if busy.state not in seen[-1:]:
                seen.append(busy.state)
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {within:g}s ({seen})")
            time.sleep(0.01)

    def drive() -> None:
        try:
            until(lambda: controller.current is not None and controller.current.all_started,
                  "started")
            # Silent 1.6 s: UNREACHABLE after 1 s; a new connection would be up 3 s later,
            # past node_timeout.
            cluster.stall(busy.host, 1.6, relay_s=3.0)
            until(lambda: busy.state == NodeState.UNREACHABLE, "unreachable")
            until(lambda: busy.state == NodeState.RUNNING, "back")
            time.sleep(3.5)  # past node_timeout since it fell silent, and the slow reconnect
            until(lambda: busy.state == NodeState.RUNNING, "still running")
            cluster.finish()
        except BaseException as exc:  # noqa: BLE001 (reported by the test's thread)
            errors.append(exc)
            controller.request_cancel()

    observer = threading.Thread(target=drive, daemon=True)
    observer.start()
    try:
        final = controller.run()
    finally:
        cluster.close()
        observer.join(timeout=10)
    if errors:
        raise errors[0]
    job = store.get_job(job_id)
    assert final == JobState.SUCCEEDED, (final, job.failure)
    assert job.restarts == 0
    states = [e.state for e in job.nodes[busy.index].history]
    assert NodeState.UNREACHABLE in states and NodeState.LOST not in states, states
