"""An attempt keeps its first failure, except that a node found lost which was silent since
before a worker's failure was seen is that failure's cause (orchestrator/attempt.py)."""

from __future__ import annotations

import pytest

from orchestrator.attempt import Failure
from orchestrator.state import FailureCause
from tests.unit.test_hostile_readers import _job

SEEN = 1_000_000.0  # when the controller saw the worker's failure


def worker_failed(node_index=0):
    return Failure(FailureCause.WORKER_FAILED, "rank 1 exited with code 1",
                   node_index=node_index, rank=1, at=SEEN - 0.01, detected_at=SEEN)


def node_lost(last_heard, node_index=1, cause=FailureCause.NODE_FAIL):
    return Failure(cause, "agent gone", node_index=node_index, node_rank=1, at=last_heard)


@pytest.fixture
def attempt(home, tmp_path):
    return _job(home, tmp_path)[2]


def test_a_node_silent_since_before_a_workers_failure_is_its_cause(attempt):
    attempt.fail(worker_failed())
    attempt.fail(node_lost(last_heard=SEEN - 0.3))
    failure = attempt.result().failure
    assert (failure.cause, failure.node_index) == (FailureCause.NODE_FAIL, 1)
    # The trouble was known when the worker's failure came: time lost counts from there.
    assert failure.detected_at == SEEN and failure.at == SEEN - 0.3


@pytest.mark.parametrize("later", [
    node_lost(last_heard=SEEN + 0.5),  # it still talked after the worker's failure
    node_lost(last_heard=None),  # never heard
    node_lost(last_heard=SEEN - 0.3, node_index=0),  # the failing worker's own node
    node_lost(last_heard=SEEN - 0.3, cause=FailureCause.HUNG),  # not a node's loss
])
def test_every_other_later_failure_is_a_consequence(attempt, later):
    first = worker_failed()
    attempt.fail(first)
    attempt.fail(later)
    assert attempt.result().failure is first


def test_only_a_workers_failure_gives_way(attempt):
    first = Failure(FailureCause.HUNG, "no output", at=SEEN - 5, detected_at=SEEN)
    attempt.fail(first)
    attempt.fail(node_lost(last_heard=SEEN - 0.3))
    assert attempt.result().failure is first
