"""What a week-long job meets on its submit host, with its nodes over real SSH (the namespace
cluster): an exception of the controller, a full disk under $ORCHESTRATOR_HOME, a controller
stopped for 20 s. None stops a worker or charges a restart; every line is counted. (The same
scenarios run on local nodes in tests/integration/test_endurance.py and on Slurm in
tests/cluster/test_slurm_jobs.py.)"""

from __future__ import annotations

import time

import orchestrator
from orchestrator.specparts import HealthSpec
from tests.cluster.test_faults import running
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, wait_for
from tests.integration.test_endurance import (
    STEPS,
    check_a_full_disk_pauses,
    check_a_stalled_controller_declares_nobody_lost,
    check_an_exception_costs_nothing,
    small_disk,
)


def two_hosts(cluster, tmp_path, steps: int, **extra):
    return cluster_spec(cluster, tmp_path, STEPS, hosts=cluster.hosts[:2], nproc_per_node=1,
                        env={"STEPS": str(steps), "STEP_SLEEP": "0.05"}, **extra)


def test_an_exception_of_the_controller_costs_nothing_over_ssh(cluster, home, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@2x1")
    check_an_exception_costs_nothing(two_hosts(cluster, tmp_path, 150), 2, 150)


def test_a_full_disk_pauses_a_job_over_ssh(cluster, tmp_path, monkeypatch):
    with small_disk(tmp_path / "home", "48m") as home:
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        check_a_full_disk_pauses(two_hosts(cluster, tmp_path, 600,
                                           logs={"min_free_bytes": 1 << 20}), home, 2, 600)


def test_a_stalled_controller_declares_no_ssh_node_lost(cluster, home, tmp_path):
    check_a_stalled_controller_declares_nobody_lost(two_hosts(cluster, tmp_path, 700), 2, 700)


def test_a_cut_node_is_still_found_within_the_default_node_timeout(cluster, home, tmp_path):
    """The defaults were made patient (a busy node is not lost); a node whose link is cut
    is still LOST within node_timeout + 1 s at them, and the job fails naming it."""
    timeout = HealthSpec().node_timeout
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2]))
    running(job_id, 4)
    cluster.link_down(1)
    try:
        cut = time.monotonic()
        wait_for(lambda: orchestrator.status(job_id)["nodes"][1]["state"] == "LOST",
                 timeout + 20, interval=0.1, what="node 1 LOST")
        detected = time.monotonic() - cut
        result = orchestrator.wait(job_id, timeout=60)
    finally:
        cluster.link_up(1)
    assert detected <= timeout + 1 + 0.5, detected  # (+ this test's polling)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_FAIL"
    assert result["failure"]["node_index"] == 1
    assert_no_job_processes(job_id, within=60)
