"""Node reputation across jobs on the namespace cluster: a node cut off twice within the
window is quarantined, `orchestrator nodes` says so, and the next job runs without it."""

from __future__ import annotations

import json
import subprocess

import orchestrator
from orchestrator.ui.metrics import exposition
from tests.cluster.test_faults import running
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes

CUT = {"health": {"heartbeat_interval": 0.5, "node_timeout": 2}, "ssh": {"connect_timeout": 2}}


def cli(*args):
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_a_node_cut_twice_is_quarantined_and_the_next_job_runs_without_it(
        cluster, home, tmp_path):
    victim = cluster.hosts[2].address
    for n in (1, 2):
        work = tmp_path / f"cut{n}"
        work.mkdir()
        job_id = orchestrator.submit(cluster_spec(
            cluster, work, [PYTHON, str(WORKERS / "sleeper.py")],
            hosts=[cluster.hosts[0], cluster.hosts[2]], nproc_per_node=1, **CUT))
        running(job_id, 2)
        cluster.link_down(2)
        try:
            result = orchestrator.wait(job_id, timeout=60)
        finally:
            cluster.link_up(2)
        failure = result["failure"]
        assert failure["cause"] == "NODE_FAIL" and failure["failure_class"] == "infrastructure"
        assert_no_job_processes(job_id, within=15)
    (held,) = [h for h in orchestrator.nodes() if h["quarantined"]]
    assert held["host"] == victim and held["level"] == 1 and held["events_24h"] == 2
    shown = cli("nodes")
    assert victim in shown.stdout and "QUARANTINED" in shown.stdout, shown.stdout
    assert json.loads(cli("nodes", "--json").stdout)[0]["host"] == victim
    metrics = exposition(home)[0].decode()
    assert f'orchestrator_host_quarantined{{host="{victim}"}} 1.0' in metrics, metrics
    assert f'orchestrator_host_infra_failures_24h{{host="{victim}"}} 2.0' in metrics
    # The next job may run on 2 of 3: it runs on the two others.
    work = tmp_path / "next"
    work.mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, work, [PYTHON, "-c", "print('trained')"], nnodes="2:3", nproc_per_node=1,
        **CUT))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    ran = {r["host"] for r in result["ranks"]}
    assert len(result["ranks"]) == 2 and len(ran) == 2 and all(ran), ran
    assert victim not in " ".join(ran), ran
    # Released, it is a candidate again.
    assert cli("nodes", "release", victim).returncode == 0
    assert not any(h["quarantined"] for h in orchestrator.nodes())
    assert cli("nodes", "release", victim).returncode == 1


def test_a_node_failing_its_health_check_is_left_out_of_a_2_of_3_job(cluster, home, tmp_path):
    victim = cluster.hosts[1].address
    # Fails on the victim only: its address is local in its own network namespace alone.
    check = [PYTHON, "-c", "import sys\nif " + repr(victim) + " in open('/proc/net/fib_trie')"
             ".read():\n    print('GPU 3: uncorrectable ECC errors', file=sys.stderr)\n"
             "    sys.exit(7)\n"]
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "-c", "print('trained')"], nnodes="2:3", nproc_per_node=1,
        health={"node_check": check, "node_check_timeout": 20}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert len(result["ranks"]) == 2 and {r["node_index"] for r in result["ranks"]} == {0, 2}
    node = result["nodes"][1]
    assert node["error"] == "unhealthy: health.node_check failed (exit code 7)", node
    (host,) = orchestrator.nodes()
    assert host["host"] == victim and host["events"][0]["kind"] == "CHECK_FAILED"
    assert "health.node_check failed (exit code 7)" in host["events"][0]["detail"]
    assert victim in cli("nodes").stdout
    # Where MIN does not allow it, the job fails at once, naming the node and its check.
    (tmp_path / "all").mkdir()
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path / "all", [PYTHON, "-c", "print('trained')"], nproc_per_node=1,
        health={"node_check": check, "node_check_timeout": 20}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_UNHEALTHY"
    assert result["failure"]["message"].startswith(
        f"root@{victim} failed its health check: health.node_check failed (exit code 7)")
    assert result["failure"]["stderr_tail"] == ["GPU 3: uncorrectable ECC errors"]
    assert not result["attempts"] or result["attempts"][0]["world_size"] is None


def test_a_node_on_a_slow_link_fails_the_network_check_and_is_left_out(cluster, home, tmp_path):
    """The pairwise network check: node 2's cable throttled to 16 Mbit/s each way. Every link
    it is part of is slow, the others are not: it is the one left out of a 2:3 job; where MIN
    does not allow it, the job fails at once naming it and the slow links."""
    victim = cluster.hosts[2].address
    network = {"network_check": {"bytes": 4 * 2**20, "min_mb_per_s": 20, "timeout": 20}}
    cluster.slow_link(2, 16)
    try:
        job_id = orchestrator.submit(cluster_spec(
            cluster, tmp_path, [PYTHON, "-c", "print('trained')"], nnodes="2:3",
            nproc_per_node=1, health=network))
        result = orchestrator.wait(job_id, timeout=120)
        assert result["state"] == "SUCCEEDED", result["failure"]
        assert {r["node_index"] for r in result["ranks"]} == {0, 1}
        error = result["nodes"][2]["error"]
        assert error.startswith("unhealthy: network check: every link of this node is slow "
                                "or broken (below health.network_check.min_mb_per_s 20): "), error
        assert f"node 1 (root@{cluster.hosts[1].address}) -> node 2 (root@{victim})" in error
        log = (home / "jobs" / job_id / "controller.log").read_text()
        assert f"slowest node 1 (root@{cluster.hosts[1].address}) -> node 2 (root@{victim})" \
            in log or f"slowest node 2 (root@{victim}) -> node 0" in log, log
        (host,) = orchestrator.nodes()
        assert host["host"] == victim and host["events"][0]["kind"] == "CHECK_FAILED"

        (tmp_path / "all").mkdir()
        job_id = orchestrator.submit(cluster_spec(
            cluster, tmp_path / "all", [PYTHON, "-c", "print('trained')"], nproc_per_node=1,
            health=network))
        result = orchestrator.wait(job_id, timeout=120)
        assert result["state"] == "FAILED" and result["failure"]["cause"] == "NODE_UNHEALTHY"
        assert result["failure"]["message"].startswith(
            f"root@{victim} failed its health check: network check: every link"), result
    finally:
        cluster.slow_link(2, None)
    # At full speed again, the same check passes on every node.
    (tmp_path / "fast").mkdir()
    result = orchestrator.wait(orchestrator.submit(cluster_spec(
        cluster, tmp_path / "fast", [PYTHON, "-c", "print('trained')"], nproc_per_node=1,
        health=network)), timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
