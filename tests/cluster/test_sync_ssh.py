"""sync: and setup: over real SSH: a project shipped by content into each node's cache, a
changed file arriving on the next submit, an unchanged tree costing no file contents."""

from __future__ import annotations

import re
import secrets

import pytest

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, assert_no_job_processes, command_lines

SCRIPT = """import os
print("cwd", os.getcwd())
print("data", open("data.txt").read().strip())
print("ignored file shipped:", os.path.exists("secret.env"))
"""


def project(tmp_path, data: str):
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "train.py").write_text(SCRIPT)
    (proj / "data.txt").write_text(data)
    (proj / "secret.env").write_text("TOKEN=x")
    (proj / ".gitignore").write_text("secret.env\n")
    return proj


def run(cluster, tmp_path, **extra):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "train.py"], hosts=cluster.hosts[:2], nproc_per_node=1,
        sync="proj", workdir="proj", **extra))
    result = orchestrator.wait(job_id, timeout=120)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert_no_job_processes(job_id)
    return result, lines


def test_sync_ships_changes_and_an_unchanged_tree_costs_nothing(cluster, home, tmp_path):
    # Contents unique to this run: nodes keep blobs and setup markers across jobs.
    token = secrets.token_hex(4)
    proj = project(tmp_path, f"first-{token}")
    result, lines = run(cluster, tmp_path, setup=[f"echo setup {token} ran in $(pwd)"])
    cwds = {m[1] for ln in lines if (m := re.search(r"\] cwd (\S+)", ln))}
    assert len(cwds) == 1 and cwds.pop().startswith("/root/.cache/orchestrator/sync/")
    assert sum(f"data first-{token}" in ln for ln in lines) == 2
    assert sum("ignored file shipped: False" in ln for ln in lines) == 2
    setup = [ln for ln in lines
             if f":setup] setup {token} ran in /root/.cache/orchestrator/sync/" in ln]
    assert setup, lines[:5]  # run in the synced copy, and streamed
    sent = [n["sync"] for n in result["nodes"]]
    assert all(s["done"] and s["files"] == 3 for s in sent), sent  # with .gitignore
    from orchestrator.cli import _show_sync_progress

    _show_sync_progress(result["job_id"])  # the bars' code path (drawn only on a terminal)

    (proj / "data.txt").write_text(f"second-{token}")
    result, lines = run(cluster, tmp_path)
    assert sum(f"data second-{token}" in ln for ln in lines) == 2
    sent = [n["sync"] for n in result["nodes"]]
    # Only data.txt's new content travelled (the nodes share a disk here, so one of them
    # may find it already cached).
    assert sum(s["bytes_sent"] for s in sent) == len(f"second-{token}"), sent

    result, _ = run(cluster, tmp_path)  # nothing changed: no file contents at all
    assert [n["sync"]["bytes_sent"] for n in result["nodes"]] == [0, 0]


def test_a_symlink_leaving_the_tree_is_refused_before_anything_starts(cluster, home, tmp_path):
    proj = project(tmp_path, "x")
    (proj / "escape").symlink_to("/etc/hostname")
    with pytest.raises(orchestrator.LaunchError, match="points outside the synced tree"):
        orchestrator.submit(cluster_spec(cluster, tmp_path, [PYTHON, "train.py"],
                                         hosts=cluster.hosts[:1], sync="proj", workdir="proj"))
    assert orchestrator.list_jobs() == []


def test_a_failing_setup_fails_the_job_without_a_restart(cluster, home, tmp_path):
    project(tmp_path, "x")
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "train.py"], hosts=cluster.hosts[:2], nproc_per_node=1,
        sync="proj", workdir="proj", max_restarts=3,
        setup=["echo no such requirement >&2", "exit 3"]))
    result = orchestrator.wait(job_id, timeout=120)
    failure = result["failure"]
    assert result["state"] == "FAILED" and failure["cause"] == "SETUP_FAILED", failure
    assert failure["exit_code"] == 3 and "no such requirement" in failure["stderr_tail"]
    assert failure["host"].startswith("root@10.231.") and result["restarts"] == 0
    assert_no_job_processes(job_id)


VERIFY = """import hashlib, json, os, sys
expected = json.load(open(sys.argv[1]))
seen = {}
for top, _, files in os.walk("."):
    for name in files:
        rel = os.path.relpath(os.path.join(top, name), ".")
        if rel != ".orchestrator-manifest.json":
            seen[rel] = hashlib.sha256(open(rel, "rb").read()).hexdigest()
print("verified", len(seen), "complete" if seen == expected else "DIFFERENT", flush=True)
"""


def test_nodes_sharing_a_home_each_run_setup_and_all_get_the_new_tree(cluster, home, tmp_path):
    """The namespace nodes share one filesystem, as nodes mounting one NFS home do: setup
    runs once per node (3 times), and 3 nodes building the same new tree into one shared
    cache at once all get a complete copy."""
    import hashlib
    import json

    proj = tmp_path / "proj"
    proj.mkdir()
    expected = {}
    for i in range(120):  # new content: no node has any of it yet
        rel = f"pkg{i % 6}/file{i}.bin"
        data = secrets.token_bytes(2048 + i * 97)
        (proj / rel).parent.mkdir(exist_ok=True)
        (proj / rel).write_bytes(data)
        expected[rel] = hashlib.sha256(data).hexdigest()
    (proj / "verify.py").write_text(VERIFY)
    expected["verify.py"] = hashlib.sha256(VERIFY.encode()).hexdigest()
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    runs = tmp_path / "setup-runs"
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "verify.py", str(tmp_path / "expected.json")],
        nproc_per_node=1, sync="proj", workdir="proj",
        setup=[f'echo "$SSH_CONNECTION" | cut -d" " -f3 >> {runs}']))
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert sorted(runs.read_text().split()) == sorted(h.address for h in cluster.hosts)
    verified = [ln.split("] ", 1)[1] for ln in lines if "] verified" in ln]
    assert verified == [f"verified {len(expected)} complete"] * 3, lines[-10:]
    assert all(n["sync"]["done"] for n in result["nodes"])
    assert_no_job_processes(job_id)
    again = orchestrator.submit(cluster_spec(  # the same setup again: done on every node
        cluster, tmp_path, [PYTHON, "verify.py", str(tmp_path / "expected.json")],
        nproc_per_node=1, sync="proj", workdir="proj",
        setup=[f'echo "$SSH_CONNECTION" | cut -d" " -f3 >> {runs}']))
    assert orchestrator.wait(again, timeout=180)["state"] == "SUCCEEDED"
    assert len(runs.read_text().split()) == 3


def test_a_setup_stuck_on_one_node_past_setup_timeout_leaves_it_out_of_a_min_max_job(
        cluster, home, tmp_path):
    """nnodes 2:3 and one node's setup hangs (a mirror that never answers): past
    setup_timeout it is stopped there and that node is out, SETUP_FAILED naming it; the job
    runs on the other two and is not held in LAUNCHING."""
    project(tmp_path, "x")
    stuck = cluster.hosts[2].address
    nap = f"600.{secrets.randbelow(10**6):06d}"
    setup = [f'case "$SSH_CONNECTION" in *" {stuck} "*) echo waiting for the mirror; '
             f"sleep {nap};; esac"]
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "train.py"], hosts=cluster.hosts[:3], nproc_per_node=1,
        sync="proj", workdir="proj", setup=setup, setup_timeout=3, nnodes="2:3"))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert len(result["ranks"]) == 2 and result["restarts"] == 0
    out = [n for n in result["nodes"] if n["host"] == f"root@{stuck}"]
    assert out and out[0]["state"] in ("FAILED", "LOST"), result["nodes"]
    assert out[0]["error"] == \
        f"setup on root@{stuck} did not finish within 3s (setup_timeout): stopped"
    lines = list(orchestrator.logs(job_id))
    assert f"[{stuck}:setup] waiting for the mirror" in lines, lines[:5]
    assert not [c for c in command_lines() if f"sleep {nap}".encode() in c]  # stopped there
    assert_no_job_processes(job_id)
