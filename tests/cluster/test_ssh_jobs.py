"""Multi-node jobs over real SSH between network namespaces, with real torch gloo traffic."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    command_lines,
    wait_for,
    write_spec,
)


def cluster_spec(cluster, tmp_path, command, *, hosts=None, ssh=None, **extra):
    hosts = cluster.hosts if hosts is None else hosts
    data = {
        "name": "ssh-test",
        "nodes": [{"host": f"root@{h.address}"} for h in hosts],
        "ssh": {"identity_file": str(cluster.client_key),
                "known_hosts": str(cluster.known_hosts), "connect_timeout": 3, **(ssh or {})},
        "python": PYTHON,  # non-interactive SSH has the system PATH; use the test's python
        "nproc_per_node": 2,
        "command": command,
        "workdir": str(tmp_path),
        "stop_grace_period": 2,
        "launch_timeout": 30,
        **extra,
    }
    return write_spec(tmp_path, data)


def final_digests(job_id):
    found = {}
    for line in orchestrator.logs(job_id):
        m = re.match(r"^\[([\d.]+):(\d+)\] rank \d+ final weights (\w+)", line)
        if m:
            found[int(m.group(2))] = (m.group(1), m.group(3))
    return found


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_three_node_ddp_over_ssh(cluster, home, tmp_path, backend):
    spec = cluster_spec(cluster, tmp_path,
                        [PYTHON, str(ROOT / "examples" / "ddp_train.py"), "--epochs", "2",
                         "--samples", "192"],
                        rendezvous={"backend": backend})
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=240)
    tail = list(orchestrator.logs(job_id))[-15:]
    assert result["state"] == "SUCCEEDED", (result["failure"], tail)
    if backend == "static":
        digests = final_digests(job_id)
        assert sorted(digests) == list(range(6))
        # Every rank ran on the host the plan put it on, and all ended with the same weights.
        assert {r: h for r, (h, _) in digests.items()} == {
            r: cluster.hosts[r // 2].address for r in range(6)}
        assert len({d for _, d in digests.values()}) == 1
    else:
        lines = list(orchestrator.logs(job_id))
        # torch's rendezvous chose the ranks; each line is still filed under its rank.
        digests = final_digests(job_id)
        assert sorted(digests) == list(range(6)), lines[-20:]
        assert len({d for _, d in digests.values()}) == 1
        assert any("world_size 6" in ln for ln in lines)
        assert list(orchestrator.logs(job_id, rank=0)), "no lines filed under rank 0"
    assert_no_job_processes(job_id)


def test_collectives_cross_nodes_on_the_right_interface(cluster, home, tmp_path):
    spec = cluster_spec(cluster, tmp_path, [PYTHON, str(WORKERS / "collectives.py")],
                        hosts=cluster.hosts[:2])
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=120)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", lines[-20:]
    ok = [ln for ln in lines if "COLLECTIVES OK" in ln]
    assert len(ok) == 4 and all(ln.endswith("via eth0") for ln in ok), ok
    assert_no_job_processes(job_id)


def test_rank_failing_on_node1_stops_node0_promptly(cluster, home, tmp_path):
    spec = cluster_spec(cluster, tmp_path, [PYTHON, str(WORKERS / "fail_rank.py")],
                        hosts=cluster.hosts[:2], env={"FAIL_RANK": "3", "FAIL_CODE": "9",
                                                      "FAIL_AFTER": "1"})
    started = time.monotonic()
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED"
    failure = result["failure"]
    assert (failure["rank"], failure["exit_code"], failure["node_rank"]) == (3, 9, 1)
    assert failure["host"] == f"root@{cluster.hosts[1].address}"
    assert time.monotonic() - started < 25
    assert {r["state"] for r in result["ranks"] if r["rank"] != 3} == {"STOPPED"}
    assert_no_job_processes(job_id)


def test_secrets_never_on_a_command_line(cluster, home, tmp_path):
    secret = "s3cr3t-token-value-1234"
    spec = cluster_spec(cluster, tmp_path, [PYTHON, str(WORKERS / "sleeper.py")],
                        hosts=cluster.hosts[:2], env={"API_TOKEN": secret})
    job_id = orchestrator.submit(spec)
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 60, what="RUNNING")
    seen = [c for c in command_lines() if secret.encode() in c]
    orchestrator.cancel(job_id)
    assert seen == []
    assert_no_job_processes(job_id)


def test_unknown_host_key_is_refused_before_anything_starts(cluster, home, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    spec = cluster_spec(cluster, tmp_path, ["true"], ssh={"known_hosts": str(empty)})
    with pytest.raises(orchestrator.LaunchError, match="not in known_hosts") as info:
        orchestrator.submit(spec)
    assert cluster.hosts[0].address in str(info.value)
    assert orchestrator.list_jobs() == []  # nothing recorded, nothing started
    assert empty.read_text() == ""
    # The CLI says it in one line and exits 1.
    run = subprocess.run([PYTHON, "-m", "orchestrator", "submit", str(spec), "--wait"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1 and run.stderr.startswith("error: ") and "known_hosts" in run.stderr


def test_changed_host_key_is_refused_even_with_accept_new(cluster, home, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, blob = other.with_suffix(".pub").read_text().split()[:2]
    forged = tmp_path / "known_hosts_forged"
    forged.write_text("".join(f"{h.address} {kind} {blob}\n" for h in cluster.hosts))
    spec = cluster_spec(cluster, tmp_path, ["true"],
                        ssh={"known_hosts": str(forged), "host_key_policy": "accept-new"})
    result = orchestrator.wait(orchestrator.submit(spec), timeout=30)
    assert result["state"] == "FAILED"
    assert "does not match known_hosts" in result["failure"]["message"]
    assert result["attempts"] == []


def test_accept_new_records_unknown_keys(cluster, home, tmp_path):
    fresh = tmp_path / "known_hosts_new"
    spec = cluster_spec(cluster, tmp_path, ["true"], hosts=cluster.hosts[:1], nproc_per_node=1,
                        ssh={"known_hosts": str(fresh), "host_key_policy": "accept-new"})
    result = orchestrator.wait(orchestrator.submit(spec), timeout=60)
    assert result["state"] == "SUCCEEDED", result["failure"]
    recorded = fresh.read_text().split()
    expected = cluster.known_hosts.read_text().splitlines()[0].split()
    assert recorded[:3] == expected[:3]


@pytest.mark.parametrize("fault", ["bad key", "unreachable", "closed port"])
def test_connection_faults_fail_fast_naming_the_host(cluster, home, tmp_path, fault):
    target = cluster.hosts[1]
    node = {"host": f"root@{target.address}"}
    ssh = {"identity_file": str(cluster.client_key), "known_hosts": str(cluster.known_hosts),
           "connect_timeout": 3}
    if fault == "bad key":
        wrong = tmp_path / "wrong_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)],
                       check=True)
        node["identity_file"] = str(wrong)
    elif fault == "closed port":
        node["port"] = 2222
    spec = write_spec(tmp_path, {
        "name": "fault", "nodes": [{"host": f"root@{cluster.hosts[0].address}"}, node],
        "ssh": ssh, "python": PYTHON, "command": ["true"]})
    if fault == "unreachable":
        cluster.link_down(1)  # the host is there, its cable is not
    started = time.monotonic()
    try:
        if fault == "bad key":  # only a real SSH handshake finds this: the controller fails
            result = orchestrator.wait(orchestrator.submit(spec), timeout=60)
            assert result["state"] == "FAILED" and result["failure"]["cause"] == "LAUNCH_FAILED"
            assert result["failure"]["host"] == node["host"] and result["attempts"] == []
            message = result["failure"]["message"]
        else:  # submit's own preflight refuses it before recording anything
            with pytest.raises(orchestrator.LaunchError) as info:
                orchestrator.submit(spec)
            message = str(info.value)
            assert orchestrator.list_jobs() == []
    finally:
        cluster.link_up(1)
    elapsed = time.monotonic() - started
    assert target.address in message, message
    expected = {"bad key": "authentication failed", "unreachable": "timed out|unreachable",
                "closed port": "refused"}[fault]
    assert re.search(expected, message, re.I), message
    assert elapsed < 3 + 8, elapsed  # connect_timeout 3 s, plus start-up


def test_check_reports_every_node(cluster, home, tmp_path):
    spec = cluster_spec(cluster, tmp_path, ["true"])
    run = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(spec), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    import json

    report = json.loads(run.stdout)
    assert report["ok"] is True
    nodes = report["nodes"]
    assert [n["host"] for n in nodes] == [f"root@{h.address}" for h in cluster.hosts]
    for n in nodes:
        assert n["reachable"] and n["auth"] and n["host_key"] == "verified"
        assert n["torch"] and n["python"]
        assert n["interface"] == "eth0" and n["master_port_reachable"] is True
        # These hosts have both hierarchies; the agent takes v2's cgroup.kill.
        assert n["containment"].startswith("cgroup v2 (cgroup.kill) under /"), n
    table = subprocess.run([PYTHON, "-m", "orchestrator", "check", str(spec)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert table.returncode == 0 and cluster.hosts[2].address in table.stdout
    assert f"node 2 (root@{cluster.hosts[2].address}) contains its workers' processes by: " \
        "cgroup v2" in table.stdout, table.stdout


def test_plain_ssh_works_with_the_generated_config(cluster):
    assert shutil.which("ssh"), "the ssh client (openssh-client) is part of the test cluster"
    for h in cluster.hosts:
        run = subprocess.run(["ssh", "-F", str(cluster.ssh_config), h.name, "ip", "-o", "-4",
                              "addr", "show", "eth0"], capture_output=True, text=True, timeout=20)
        assert run.returncode == 0, run.stderr
        assert h.address in run.stdout


def test_ssh_channels_use_aes_gcm_with_the_host_key_verified(cluster, tmp_path):
    """The transport asks for AES-GCM first (half the controller's CPU per MiB of output of
    paramiko's default aes128-ctr: benchmarks/handshake.md), still verifying the host key."""
    from orchestrator.spec import parse_jobspec
    from orchestrator.transport.ssh import SSHConnection

    spec = parse_jobspec(cluster_spec(cluster, tmp_path, ["true"]).read_text())
    conn = SSHConnection(spec.nodes[0], spec)
    client = conn.connect()
    try:
        transport = client.get_transport()
        assert transport is not None
        assert (transport.local_cipher, transport.remote_cipher) == \
            ("aes256-gcm@openssh.com", "aes256-gcm@openssh.com")
        key = transport.get_remote_server_key()
        assert client.get_host_keys().check(cluster.hosts[0].address, key)
    finally:
        client.close()
