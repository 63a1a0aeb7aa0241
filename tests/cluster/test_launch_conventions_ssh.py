"""Launch conventions over real SSH: a master port from a range (and a range fully taken
on node 0), `check` over a range from every node, max_duration, placeholders."""

from __future__ import annotations

import json
import re
import subprocess

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes


def test_port_range_placeholders_and_check_over_ssh(cluster, home, tmp_path):
    path = cluster_spec(cluster, tmp_path, [PYTHON, str(ROOT / "examples" / "legacy_launch.py"),
                                            "--local_rank=${local_rank}"],
                        hosts=cluster.hosts[:2], rendezvous={"port": "29620-29625"})
    check = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(path), "--json"],
                           capture_output=True, text=True, timeout=90, cwd=ROOT)
    report = json.loads(check.stdout)
    assert check.returncode == 0 and report["ports"] == list(range(29620, 29626)), report
    assert all(n["master_port_reachable"] and not n["unreachable_ports"]
               for n in report["nodes"])
    job_id = orchestrator.submit(path)
    result = orchestrator.wait(job_id, timeout=120)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert 29620 <= result["attempts"][0]["master_port"] <= 29625
    ranks = {int(m[1]) for ln in lines if (m := re.search(r"legacy rank (\d)/4 local_rank", ln))}
    assert ranks == {0, 1, 2, 3}
    assert_no_job_processes(job_id)


def test_a_range_taken_on_node0_fails_the_launch_naming_range_and_node(cluster, home, tmp_path):
    node0 = cluster.hosts[0]
    holder = subprocess.Popen(
        ["ip", "netns", "exec", node0.netns, PYTHON, "-c",
         "import socket, time\nheld = []\nfor p in (29640, 29641):\n"
         "    s = socket.socket(); s.bind(('', p)); s.listen(); held.append(s)\n"
         "print('ready', flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        job_id = orchestrator.submit(cluster_spec(
            cluster, tmp_path, ["true"], hosts=cluster.hosts[:2], max_restarts=2,
            rendezvous={"port": "29640-29641"}))
        result = orchestrator.wait(job_id, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "LAUNCH_FAILED"
    assert "29640-29641" in failure["message"] and node0.address in failure["host"]
    assert result["restarts"] == 0


def test_max_duration_over_ssh_leaves_nothing(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        max_duration="00:00:04", max_restarts=2, env={"SPAWN_GRANDCHILD": "1"}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "TIMEOUT"
    assert result["restarts"] == 0
    assert_no_job_processes(job_id)


def test_nproc_gpu_is_refused_on_cpu_nodes_and_env_set_work_over_ssh(cluster, home, tmp_path):
    path = cluster_spec(cluster, tmp_path, [PYTHON, str(WORKERS / "env_dump.py")],
                        hosts=cluster.hosts[:2], nproc_per_node="gpu")
    job_id = orchestrator.submit(path)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "LAUNCH_FAILED"
    assert "nproc_per_node: gpu, but root@" in result["failure"]["message"]
    assert "has no GPU" in result["failure"]["message"] and result["attempts"] == []
    run = subprocess.run([PYTHON, "-m", "orchestrator", "submit", str(path), "--wait",
                          "--set", "nproc_per_node=1", "--env", "EXTRA=over-ssh"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    job_id = orchestrator.list_jobs()[-1]["job_id"]
    envs = [json.loads(ln.split("ENV ", 1)[1]) for ln in orchestrator.logs(job_id)
            if "] ENV " in ln]
    assert len(envs) == 2 and {e["EXTRA"] for e in envs} == {"over-ssh"}
    assert_no_job_processes(job_id)


def test_the_synced_project_example_runs_on_ssh_nodes(cluster, home, tmp_path):
    import shutil

    project = tmp_path / "synced-project"
    shutil.copytree(ROOT / "examples" / "synced-project", project)
    spec = (project / "job.yaml").read_text().replace(
        "nodes: [{host: local}, {host: local}]",
        "nodes: [" + ", ".join(f"{{host: root@{h.address}}}" for h in cluster.hosts[:2]) + "]\n"
        f"ssh: {{identity_file: {cluster.client_key}, known_hosts: {cluster.known_hosts}}}\n"
        f"python: {PYTHON}")
    (project / "job.yaml").write_text(spec.replace("[python3, train.py]",
                                                   f"[{PYTHON}, train.py]"))
    job_id = orchestrator.submit(project / "job.yaml")
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    sums = [ln for ln in lines if "scaled sum 20" in ln]
    assert len(sums) == 4 and all("/root/.cache/orchestrator/sync/" in ln for ln in sums)
    assert_no_job_processes(job_id)
