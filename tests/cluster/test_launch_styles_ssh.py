"""Launch styles over real SSH: a two-file project shipped with ``sync:`` and run as a script
and as ``python -m``, and a script that starts its own workers on each node (``launch:
per-node``), with real gloo traffic between the namespaces."""

from __future__ import annotations

import re
import shutil

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, ROOT, assert_no_job_processes

PROJECTS = ROOT / "tests" / "projects"


def run(spec):
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-15:])
    assert_no_job_processes(job_id)
    return result, lines


def test_a_synced_two_file_project_runs_as_script_and_as_module(cluster, home, tmp_path):
    shutil.copytree(PROJECTS / "twofile", tmp_path / "proj")
    hosts = cluster.hosts[:2]
    _, lines = run(cluster_spec(cluster, tmp_path, [PYTHON, "train.py"], hosts=hosts,
                                sync="proj", workdir="proj"))
    found = sorted(ln for ln in lines if "two-file" in ln)
    assert len(found) == 4 and all(ln.endswith("/4 sum 60") for ln in found), lines[-10:]
    # Each rank ran in the synced copy on its node, not in the local project.
    assert {ln.split(":", 1)[0][1:] for ln in found} == {h.address for h in hosts}
    _, lines = run(cluster_spec(cluster, tmp_path, [PYTHON, "-m", "mypkg.train"], hosts=hosts,
                                sync="proj", workdir="proj"))
    assert sum("sum 6 from __main__ in mypkg" in ln for ln in lines) == 4, lines[-10:]


def test_a_script_that_starts_its_own_workers_per_node_over_ssh(cluster, home, tmp_path):
    command = [PYTHON, str(ROOT / "examples" / "per_node_spawn.py"),
               "--master_addr", "${master_addr}", "--master_port", "${master_port}",
               "--world_size", "${world_size}", "--start_rank", "${node_start_rank}",
               "--num_gpus", "${nproc_per_node}"]
    result, lines = run(cluster_spec(cluster, tmp_path, command, launch="per-node"))
    found = {int(m.group(2)): (m.group(1), m.group(3)) for ln in lines
             if (m := re.match(r"\[([\d.]+):node\d\] per-node rank (\d)/6 local \d "
                               r"final weights (\w+)", ln))}
    assert {r: a for r, (a, _) in found.items()} == {
        r: cluster.hosts[r // 2].address for r in range(6)}, lines[-10:]
    assert len({d for _, d in found.values()}) == 1
    assert result["attempts"][0]["world_size"] == 6
