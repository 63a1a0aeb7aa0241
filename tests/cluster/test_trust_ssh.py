"""Trust boundaries over real SSH: torch's rendezvous store is not advertised in any command
line, and `check` warns when the master port is open beyond the node list."""

from __future__ import annotations

import json
import secrets
import subprocess

import yaml

import orchestrator
from tests.cluster.test_ssh_jobs import cluster_spec
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    command_lines,
    wait_for_output,
)
from tests.integration.test_trust import (
    SECRET_NAMES,
    assert_secrets_arrived,
    secret_spec,
    submit_with_secrets,
)


def test_c10d_endpoint_and_run_id_never_on_a_command_line(cluster, home, tmp_path):
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], hosts=cluster.hosts[:2],
        rendezvous={"backend": "c10d"}))
    wait_for_output(job_id, "sleeping", 4)
    attempt = orchestrator.status(job_id)["attempts"][-1]
    endpoint = f"{attempt['master_addr']}:{attempt['master_port']}".encode()
    run_id = f"{job_id}-1".encode()
    seen = [c for c in command_lines() if endpoint in c or run_id in c or b"rdzv" in c]
    assert not seen, seen
    assert orchestrator.cancel(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)


def test_check_warns_that_the_store_port_is_open_beyond_the_nodes(cluster, home, tmp_path):
    spec = cluster_spec(cluster, tmp_path, ["true"], hosts=cluster.hosts[:2])
    run = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(spec), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    # This test's machine (the root namespace) is not a node, and reaches the port.
    assert any("firewall" in w and "not one of the job's nodes" in w
               for w in report["warnings"]), report["warnings"]


def test_a_node_flooding_its_channel_stderr_does_not_disturb_the_job(cluster, home, tmp_path):
    # The relay's interpreter first floods its stderr (the SSH channel's stderr) with 20 MB
    # and no newline: the controller drains it in bounded pieces, keeping a short tail.
    wrapper = tmp_path / "noisy-python"
    wrapper.write_text("#!/bin/sh\nhead -c 20000000 /dev/zero | tr '\\0' x >&2\n"
                       f'exec {PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    job_id = orchestrator.submit(cluster_spec(
        cluster, tmp_path, [PYTHON, "-c", "print('fine')"], hosts=cluster.hosts[:1],
        nproc_per_node=1, python=str(wrapper)))
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    log = (home / "jobs" / job_id / "controller.log").read_text()
    assert "Traceback" not in log
    assert_no_job_processes(job_id)


def test_no_secret_reaches_a_command_line_on_any_node(cluster, home, tmp_path):
    """The spec's env, --env KEY, --env-file and a secret in a setup line, over SSH: while
    the job runs, no command line on this machine or on the nodes holds any of them."""
    values = {n: f"{n.lower()}-{secrets.token_hex(8)}" for n in SECRET_NAMES}
    plain = secret_spec(tmp_path, values)  # the local spec's env and setup, on SSH nodes
    data = yaml.safe_load(plain.read_text())
    path = cluster_spec(cluster, tmp_path, data["command"], hosts=cluster.hosts[:2],
                        nproc_per_node=1, env=data["env"], setup=data["setup"])
    job_id = submit_with_secrets(tmp_path, path, values)
    assert_secrets_arrived(job_id, values, ranks=2)
    assert_no_job_processes(job_id)
