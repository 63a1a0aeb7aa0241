"""Node reputation across jobs (orchestrator/reputation.py) on a real SQLite store."""

from __future__ import annotations

from orchestrator import reputation
from orchestrator.store import Store


def test_two_infrastructure_failures_in_an_hour_quarantine_a_host_with_a_doubling_cooldown(
        tmp_path):
    store = Store(tmp_path)
    t = 1_000_000.0
    assert reputation.record(store, "root@10.0.0.2:22", "job-a", "NODE_FAIL", "lost", t) is None
    held = reputation.record(store, "ubuntu@10.0.0.2", "job-b", "WORKER_FAILED", "SIGKILL",
                             t + 60)
    assert held is not None and held["host"] == "10.0.0.2" and held["level"] == 1
    assert held["until"] == t + 60 + 600 and "2 infrastructure failures" in held["reason"]
    assert set(reputation.quarantined(store, t + 61)) == {"10.0.0.2"}
    assert reputation.quarantined(store, t + 60 + 601) == {}
    # Events before the quarantine ended do not count again; two new ones: twice as long.
    assert reputation.record(store, "10.0.0.2", "job-c", "NODE_FAIL", "lost", t + 700) is None
    again = reputation.record(store, "10.0.0.2", "job-d", "NODE_FAIL", "lost", t + 800)
    assert again is not None and again["level"] == 2 and again["until"] == t + 800 + 1200
    # Far apart, nothing; this machine, never.
    assert reputation.record(store, "10.0.0.3", "j", "NODE_FAIL", "x", t) is None
    assert reputation.record(store, "10.0.0.3", "j", "NODE_FAIL", "x", t + 4000) is None
    for i in range(5):
        assert reputation.record(store, "local", "j", "NODE_FAIL", "x", t + i) is None
    assert reputation.cooldown(20) == reputation.MAX_COOLDOWN
    store.close()


def test_release_ends_a_quarantine_now(tmp_path):
    import time

    store = Store(tmp_path)
    now = time.time()
    reputation.record(store, "h1", "a", "NODE_FAIL", "lost", now)
    reputation.record(store, "h1", "b", "NODE_FAIL", "lost", now)
    assert "h1" in reputation.quarantined(store)
    assert store.release_quarantine("h1") is True
    assert reputation.quarantined(store) == {}
    assert store.release_quarantine("h1") is False
    store.close()


CHECKED = """
name: checked
nodes: [{host: a}, {host: b}]
nnodes: "1:2"
nproc_per_node: 1
command: [train]
health: {node_check: [check], heartbeat_interval: 1, node_timeout: 30}
"""


def test_a_failed_check_counts_against_its_host_unless_every_node_failed(tmp_path):
    from orchestrator.state import JobState
    from tests.unit.test_the_door import run

    def one_bad(agent, _):
        agent.check_problems = ["health.node_check failed (exit code 7)"] \
            if agent.host == "b" else []

    state, job = run(tmp_path / "one", one_bad, CHECKED)
    assert state == JobState.SUCCEEDED
    store = Store(tmp_path / "one" / "home")
    assert [(e["host"], e["kind"]) for e in store.host_events(0)] == [("b", "CHECK_FAILED")]

    def all_bad(agent, _):
        agent.check_problems = ["health.node_check failed (exit code 2)"]  # a typo in it

    state, job = run(tmp_path / "all", all_bad, CHECKED)
    assert state == JobState.FAILED and job.failure["cause"] == "NODE_UNHEALTHY"
    assert Store(tmp_path / "all" / "home").host_events(0) == []


def test_the_policy_is_this_homes_setting_checked_and_kept(tmp_path):
    import pytest

    from orchestrator.errors import OrchestratorError

    store = Store(tmp_path)
    assert reputation.policy(store) == reputation.Policy()
    rules = reputation.set_policy(store, after=3, window=60, cooldown=30)
    assert (rules.after, rules.window, rules.cooldown, rules.max_cooldown) == (3, 60, 30, 86400.0)
    assert reputation.policy(Store(tmp_path)) == rules  # kept in the store
    for bad in ({"after": -1}, {"after": 1.5}, {"window": 0}, {"cooldown": float("inf")},
                {"max_cooldown": True}, {"afterr": 2}):
        with pytest.raises(OrchestratorError):
            reputation.set_policy(store, **bad)
    assert reputation.policy(store) == rules  # a refused change changes nothing
    t = 1_000_000.0
    for i in range(2):
        assert reputation.record(store, "h", "j", "NODE_FAIL", "x", t + i) is None
    held = reputation.record(store, "h", "j", "NODE_FAIL", "x", t + 2)
    assert held is not None and held["until"] == t + 2 + 30
    assert "3 infrastructure failures within 1 min" in held["reason"]
    # Outside the 60 s window, three more do not add up.
    for i in range(3):
        assert reputation.record(store, "k", "j", "NODE_FAIL", "x", t + 100 * i) is None
    reputation.set_policy(store, after=0)
    for i in range(5):
        assert reputation.record(store, "m", "j", "NODE_FAIL", "x", t + i) is None
    store.close()


def test_a_failure_decided_again_by_a_controller_that_took_over_counts_once(tmp_path):
    """A controller that died while an attempt was being stopped left it open, with its
    failure; the one that took over decided it again and counted it against the host a
    second time: a healthy-enough host quarantined after half the incidents the policy
    asks for. Found by a reading helper."""
    from orchestrator.attempt import Failure
    from orchestrator.state import FailureCause

    store = Store(tmp_path)
    lost = Failure(FailureCause.NODE_FAIL, "10.0.0.2: silent for 30s", node_index=1,
                   host="10.0.0.2", at=1_000_000.0, detected_at=1_000_030.0,
                   failure_class="infrastructure")
    assert reputation.count_failure(store, "job-a", "10.0.0.2", lost) is None
    again = Failure.from_dict(lost.to_dict())  # as the open attempt's checkpoint keeps it
    assert reputation.count_failure(store, "job-a", "10.0.0.2", again) is None  # not 2 of 2
    assert len(store.host_events(0, "10.0.0.2")) == 1
    store.close()
