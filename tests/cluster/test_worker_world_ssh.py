"""Over SSH a worker's world is the one ``ssh node 'cd DIR && torchrun ...'`` gives: the
login environment of the user on that node, compared key by key (tests/worker_world.py)."""

from __future__ import annotations

import shlex
import subprocess

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes
from tests.worker_world import differences, load_worlds

WORLD = str(WORKERS / "world.py")


def plain_ssh(cluster, host, command: str) -> subprocess.CompletedProcess[str]:
    """OpenSSH with no client configuration (no SendEnv), as a user's script would run it."""
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", str(cluster.client_key), "-o", "BatchMode=yes",
         "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "StrictHostKeyChecking=yes",
         f"root@{host.address}", command], capture_output=True, text=True, timeout=120)


def test_an_ssh_workers_world_is_ssh_torchruns(cluster, home, tmp_path):
    host = cluster.hosts[1]
    workdir = tmp_path / "project"
    workdir.mkdir()
    reference_dir, ours_dir = tmp_path / "torchrun", tmp_path / "ours"
    reference_dir.mkdir()
    ours_dir.mkdir()
    typed = (f"cd {shlex.quote(str(workdir))} && " + shlex.join(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORLD,
         str(reference_dir)]))
    run = plain_ssh(cluster, host, typed)
    assert run.returncode == 0, run.stderr[-2000:]
    reference = load_worlds(reference_dir)
    job_id = orchestrator.submit(cluster_spec(cluster, tmp_path, [PYTHON, WORLD, str(ours_dir)],
                                              hosts=[host], workdir=str(workdir)))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    ours = load_worlds(ours_dir)
    assert sorted(ours) == sorted(reference) == [0, 1]
    for rank in (0, 1):
        assert differences(reference[rank], ours[rank]) == [], f"rank {rank}"
    assert ours[0]["env"]["SSH_CONNECTION"].split()[2] == host.address  # a login's, truly
    assert "ORCHESTRATOR_HOME" not in ours[0]["env"]  # nothing of the controller's
    assert_no_job_processes(job_id)
