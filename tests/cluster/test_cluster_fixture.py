"""The test cluster itself: real sshd on every host, host keys checked, hosts reach each other,
nothing routes out, and link_down really cuts a host off."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


def ssh(cluster, target, *command, options=(), timeout=20):
    return subprocess.run(["ssh", "-F", str(cluster.ssh_config), *options, target, *command],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def banner(address, port=22, timeout=1.0):
    """The first bytes an sshd sends, or None if nothing answers in time."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64)
    except OSError:
        return None


def test_ssh_reaches_every_host_by_alias_and_namespace_name(cluster):
    for i, h in enumerate(cluster.hosts):
        for target in (f"node{i}", h.name):
            run = ssh(cluster, target, "echo $SSH_CONNECTION; id -u")
            assert run.returncode == 0, (target, run.stderr)
            client, _, server, port, uid = run.stdout.split()
            # The session ran on this host's sshd, reached from the root namespace's bridge.
            assert (client, server, port, uid) == (cluster.bridge_address, h.address, "22", "0")


def test_client_key_and_known_hosts_are_usable_as_written(cluster):
    assert cluster.client_key.stat().st_mode & 0o077 == 0
    assert cluster.client_key.with_suffix(".pub").read_text().startswith("ssh-ed25519 ")
    for h in cluster.hosts:
        found = subprocess.run(["ssh-keygen", "-F", h.address, "-f", str(cluster.known_hosts)],
                               capture_output=True, text=True)
        assert found.returncode == 0 and "ssh-ed25519" in found.stdout, h.address
    keys = {line.split()[2] for line in cluster.known_hosts.read_text().splitlines()}
    assert len(keys) == len(cluster.hosts), "every host has its own host key"


@pytest.mark.parametrize("known", ["another host's key", "empty"])
def test_wrong_or_missing_host_key_is_refused(cluster, tmp_path, known):
    forged = tmp_path / "known_hosts"
    if known == "empty":
        forged.write_text("")
    else:  # node0's address, node1's key: what a man in the middle would present
        lines = cluster.known_hosts.read_text().splitlines()
        forged.write_text(" ".join([cluster.hosts[0].address, *lines[1].split()[1:]]) + "\n")
    before = forged.read_text()
    run = ssh(cluster, "node0", "true", options=["-o", f"UserKnownHostsFile={forged}"])
    assert run.returncode == 255, run
    assert "Host key verification failed" in run.stderr, run.stderr
    assert forged.read_text() == before, "a refused key must not be learned"


def test_hosts_reach_each_other_and_nothing_else(cluster):
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    server_code = (
        "import socket,sys\n"
        "s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(1); s.settimeout(10)\n"
        "print(s.getsockname()[1], flush=True)\n"
        "c,peer=s.accept(); c.settimeout(10)\n"
        "c.sendall(c.recv(64)+b' from '+peer[0].encode())\n")
    server = cluster.exec(1, [sys.executable, "-c", server_code, h1.address],
                          stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        assert server.pid in cluster.netns_pids(1)  # ip netns exec execs, no extra process
        client_code = (
            "import socket,sys\n"
            "c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5)\n"
            "c.sendall(b'ping'); print(c.recv(64).decode())\n")
        client = cluster.exec(0, [sys.executable, "-c", client_code, h1.address, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = client.communicate(timeout=10)
        assert client.returncode == 0, err
        assert out.strip() == f"ping from {h0.address}"  # came straight from host 0's eth0
    finally:
        server.kill()
        server.wait()
    for h in cluster.hosts:
        # No default route, no route off the subnet: a node's traffic cannot leave the bridge.
        routes = subprocess.run(["ip", "-n", h.netns, "-4", "route", "show", "table", "main"],
                                capture_output=True, text=True, check=True).stdout
        assert routes.split("\n", 1)[0].startswith(cluster.bridge_address.rsplit(".", 1)[0] +
                                                   ".0/24 dev eth0"), routes
        assert len(routes.strip().splitlines()) == 1, routes
        v6 = subprocess.run(["ip", "-n", h.netns, "-6", "route", "show", "default"],
                            capture_output=True, text=True).stdout
        assert v6.strip() == "", v6


def test_link_down_cuts_one_host_off_and_link_up_restores_it(cluster):
    target, other = cluster.hosts[1], cluster.hosts[2]
    assert (banner(target.address) or b"").startswith(b"SSH-2.0")
    cluster.link_down(1)
    try:
        deadline = time.monotonic() + 2
        while banner(target.address, timeout=0.5) is not None:
            assert time.monotonic() < deadline, "host 1 still answers 2 s after link_down"
        assert (banner(other.address) or b"").startswith(b"SSH-2.0"), "only host 1 is cut"
        # Seen from another node too, not only from the root namespace.
        probe = cluster.exec(0, [sys.executable, "-c",
                                 "import socket,sys\n"
                                 "try: socket.create_connection((sys.argv[1],22),timeout=1)\n"
                                 "except OSError: sys.exit(7)\n", target.address])
        assert probe.wait(timeout=10) == 7
    finally:
        cluster.link_up(1)
    deadline = time.monotonic() + 5
    while not (banner(target.address, timeout=0.5) or b"").startswith(b"SSH-2.0"):
        assert time.monotonic() < deadline, "host 1 unreachable 5 s after link_up"
        time.sleep(0.05)
    run = ssh(cluster, "node1", "true")
    assert run.returncode == 0, run.stderr
