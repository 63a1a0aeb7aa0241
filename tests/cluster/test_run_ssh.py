"""``orchestrator run``: a torchrun command line pasted after ``orchestrator run --hosts``
runs over SSH, with nothing but a user's ``~/.ssh/config`` and ``known_hosts`` to say how the
hosts are reached (as a newcomer's would)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from tests.helpers import PYTHON, ROOT, assert_no_job_processes


def test_a_pasted_torchrun_line_runs_on_two_ssh_nodes(cluster, home, tmp_path):
    user = tmp_path / "user"
    (user / ".ssh").mkdir(parents=True, mode=0o700)
    addresses = [h.address for h in cluster.hosts[:2]]
    (user / ".ssh" / "config").write_text(
        f"Host {' '.join(addresses)}\n  User root\n  IdentityFile {cluster.client_key}\n")
    shutil.copy(cluster.known_hosts, user / ".ssh" / "known_hosts")
    env = {**os.environ, "HOME": str(user), "ORCHESTRATOR_HOME": str(home)}
    # What a torchrun user types on node 0, c10d, with the script's own arguments after it.
    torchrun = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{addresses[0]}:29400", "--rdzv-id", "42",
                "examples/ddp_train.py", "--samples", "128", "--epochs", "1"]
    run = subprocess.run([PYTHON, "-m", "orchestrator", "run", "--hosts", ",".join(addresses),
                          "--python", PYTHON, *torchrun], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "note: --rdzv-id" in run.stderr, run.stderr
    found = re.search(r"submitted (\S+)", run.stderr)
    assert found, run.stderr
    # Every rank of both nodes trained: each prints its final weights, all the same.
    digests = dict(re.findall(r"rank (\d) final weights (\w+)", run.stdout))
    assert sorted(digests) == ["0", "1", "2", "3"], run.stdout[-3000:]
    assert len(set(digests.values())) == 1, digests
    for address in addresses:
        assert f"[{address}:" in run.stdout or address in run.stdout, run.stdout[-2000:]
    assert_no_job_processes(found.group(1))
