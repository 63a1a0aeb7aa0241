"""No process of a job survives it on SSH nodes either (tests/integration/test_containment.py):
workers whose descendants double-fork, leave the session, clear their environment and ignore
SIGTERM, counted by the pids they recorded, after cancel, after a failure, and after an
agent and its watchdog are SIGKILLed together."""

from __future__ import annotations

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import wait_for
from tests.integration.test_containment import (
    ESCAPER,
    cancel_leaves_nothing,
    failure_leaves_nothing,
    killed_agent_and_watchdog_leave_nothing,
)


def _submit(cluster, tmp_path, **extra):
    directory = tmp_path / "escapees"
    directory.mkdir()
    env = {"ESCAPE_DIR": str(directory), **extra.pop("env", {})}
    extra.setdefault("max_restarts", 0)
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, ESCAPER, hosts=cluster.hosts[:2], env=env, stop_grace_period=1,
        **extra))
    return job_id, directory


def test_cancel_leaves_no_descendant_on_any_ssh_node(cluster, home, tmp_path):
    cancel_leaves_nothing(*_submit(cluster, tmp_path), 4)


def test_a_failure_leaves_no_descendant_on_any_ssh_node(cluster, home, tmp_path):
    failure_leaves_nothing(*_submit(cluster, tmp_path, env={"EXIT_AFTER": "3"}), 4)


def test_an_ssh_nodes_agent_and_watchdog_sigkilled_leave_no_descendant(cluster, home, tmp_path):
    job_id, directory = _submit(cluster, tmp_path, max_restarts=1,
                                restart_backoff={"initial": 0.1})
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 60, what="RUNNING")
    killed_agent_and_watchdog_leave_nothing(job_id, directory, 4)
