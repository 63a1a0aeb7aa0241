"""A planned move over real nodes (orchestrator/drain.py): two SSH nodes and a hot spare on
the namespace cluster train with a save every step; node rank 1's host is drained by its
address, as an operator names it, for every job: every rank saves the agreed step and waits
there, and the spare goes on from it, warm, with nothing redone and no restart charged. A
SIGTERM to an agent (its host's shutdown), and a preemption_check that says so (a cloud's
notice), are notices that move the job the same way."""

from __future__ import annotations

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.integration.test_drain import (
    check_moves_to_the_spare,
    drain_moves_to_the_spare,
    preemption_check,
    sigterm_moves_to_the_spare,
    train_spec,
)


def submit(cluster, tmp_path, out, health=None, **extra) -> str:
    data = train_spec(tmp_path, [], out, **extra)
    return orchestrator.submit(cluster_spec(
        cluster, tmp_path, data.pop("command"), **{k: v for k, v in data.items()
                                                   if k not in ("nodes", "name", "workdir")},
        health={"heartbeat_interval": 0.5, "node_timeout": 2, **(health or {})}))


def test_a_drained_host_leaves_at_a_step_every_rank_saved_over_ssh(cluster, home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job_id = submit(cluster, tmp_path, out)
    hosts = {n["node_index"]: n["host"] for n in orchestrator.status(job_id)["nodes"]}

    def by_address(job, node):  # the host, for every job
        orchestrator.drain_node(hosts[node], reason="maintenance")

    try:
        drain_moves_to_the_spare(job_id, out, by_address)
    finally:
        for d in orchestrator.drains():
            orchestrator.undrain_node(d["target"])


def test_a_sigterm_to_an_agent_over_ssh_is_a_notice_and_the_spare_goes_on(
        cluster, home, tmp_path):
    """The host's shutdown SIGTERMs node rank 1's agent: the same move, over SSH."""
    out = tmp_path / "out"
    out.mkdir()
    sigterm_moves_to_the_spare(submit(cluster, tmp_path, out, stop_grace_period=30), out)


def test_a_preemption_check_over_ssh_is_a_notice_and_the_spare_goes_on(
        cluster, home, tmp_path):
    """A cloud's notice, asked on node rank 1's host by its agent: the same move."""
    out = tmp_path / "out"
    out.mkdir()
    check_moves_to_the_spare(submit(cluster, tmp_path, out, health=preemption_check(tmp_path)),
                             out, tmp_path)
