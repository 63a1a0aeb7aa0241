"""The test cluster itself: real sshd on every host, host keys checked, hosts reach each other,
nothing routes out, and link_down really cuts a host off. Also the script's safety as root:
directories, keys, symlinks and state files that another user could have planted."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import _processes_mentioning, local_cluster

NOBODY = 65534


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


# --- safe to run as root ------------------------------------------------------------------------
def keypair(path: Path, comment: str = "planted") -> str:
    """An ed25519 key pair at ``path`` (and .pub), as an attacker would plant it."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return path.with_name(path.name + ".pub").read_text()


def ssh_with_key(key: Path, address: str, *, known_hosts: str = "/dev/null", strict="no"):
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes",
         "-o", "IdentityAgent=none", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
         "-o", f"StrictHostKeyChecking={strict}", "-o", f"UserKnownHostsFile={known_hosts}",
         f"root@{address}", "true"],
        capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)


def registered_dirs() -> set[str]:
    """The ``dir`` of every cluster in the registry."""
    found = set()
    for path in local_cluster.REGISTRY.glob("*.json"):
        try:
            found.add(json.loads(path.read_text())["dir"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return found


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


def test_state_is_private_and_sshd_is_strict(cluster):
    """The directory is 0700, private files 0600, and sshd runs with StrictModes yes, with
    its authorized_keys in a path sshd accepts under StrictModes."""
    assert stat.S_IMODE(cluster.dir.lstat().st_mode) == 0o700
    for path in (cluster.client_key, cluster.dir / "cluster.json", cluster.ssh_config,
                 cluster.dir / "host0_ed25519"):
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, path
    assert not (cluster.dir / "authorized_keys").exists()
    keys = cluster.authorized_keys
    assert keys.read_text() == cluster.client_key.with_suffix(".pub").read_text()
    for p in [keys, *keys.parents]:
        st = p.lstat()
        assert st.st_uid == 0 and not st.st_mode & 0o022, p
    # The effective configuration: the running sshd was started with the command the script
    # builds (its process title shows it), and `sshd -T` with that command says strictmodes.
    pid = int((cluster.dir / "sshd0.pid").read_text())
    title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert " -o StrictModes=yes " in title, title
    argv = cluster.sshd_argv(0)
    assert "StrictModes=yes" in argv and "StrictModes=no" not in argv
    e = argv.index("-E")
    del argv[e:e + 2]  # no log file: -T prints to stdout
    shown = subprocess.run(["ip", "netns", "exec", cluster.hosts[0].netns, *argv, "-T"],
                           capture_output=True, text=True, timeout=20)
    assert shown.returncode == 0, shown.stderr
    assert "strictmodes yes" in shown.stdout.lower().splitlines()
    assert f"authorizedkeysfile {keys}" in shown.stdout.lower().splitlines()
    # And it is enforced: a world-writable authorized_keys no longer lets anyone in. (Debian's
    # sshd accepts group-writable files whose group is the user's private group.)
    address = cluster.hosts[0].address
    known = str(cluster.known_hosts)
    assert ssh_with_key(cluster.client_key, address, known_hosts=known,
                        strict="yes").returncode == 0
    os.chmod(keys, 0o666)
    try:
        run = ssh_with_key(cluster.client_key, address, known_hosts=known, strict="yes")
        assert run.returncode == 255, run
    finally:
        os.chmod(keys, 0o600)
    assert ssh_with_key(cluster.client_key, address, known_hosts=known,
                        strict="yes").returncode == 0


def test_no_dir_given_makes_a_fresh_private_one():
    c = local_cluster.Cluster(1)
    try:
        st = c.dir.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid() and not any(c.dir.iterdir())
    finally:
        c.dir.rmdir()


@pytest.mark.parametrize("how", ["owned by another user", "mode 0755", "a symlink",
                                 "under another user's directory", "foreign content"])
def test_a_directory_another_user_could_have_made_is_refused(tmp_path, how):
    planted = None
    if how == "owned by another user":
        d = private_dir(tmp_path / "cl")
        os.chown(d, NOBODY, NOBODY)
    elif how == "mode 0755":
        d = private_dir(tmp_path / "cl")
        os.chmod(d, 0o755)
    elif how == "a symlink":
        d = tmp_path / "cl"
        d.symlink_to(private_dir(tmp_path / "real"))
    elif how == "under another user's directory":
        parent = tmp_path / "theirs"
        parent.mkdir(mode=0o755)
        os.chown(parent, NOBODY, NOBODY)
        d = parent / "cl"  # does not exist yet: the script would create it
    else:
        d = private_dir(tmp_path / "cl")
        (d / "notes.txt").write_text("mine\n")
    if d.exists():
        planted = keypair(d / "client_ed25519")
        keypair(d / "host0_ed25519")
    before = sorted(p.name for p in d.iterdir()) if d.exists() else None
    with pytest.raises(local_cluster.ClusterError):
        local_cluster.Cluster(1, d).up()
    # Refused before anything was built: no sshd, no namespace, no registry entry, no file.
    assert _processes_mentioning(str(d)) == []
    assert str(d) not in registered_dirs() and str(d.resolve()) not in registered_dirs()
    assert (sorted(p.name for p in d.iterdir()) if d.exists() else None) == before
    if planted:
        assert (d / "client_ed25519.pub").read_text() == planted


def test_planted_keys_in_an_acceptable_directory_are_not_used(tmp_path):
    d = private_dir(tmp_path / "cl")
    planted = d / "client_ed25519"
    planted_pub = keypair(planted)
    planted_host = keypair(d / "host0_ed25519").split()[1]
    attacker = tmp_path / "attacker_key"  # the attacker keeps a copy of the private key
    attacker.write_bytes(planted.read_bytes())
    attacker.chmod(0o600)
    c = local_cluster.Cluster(1, d).up()
    try:
        address = c.hosts[0].address
        assert c.client_key.with_suffix(".pub").read_text() != planted_pub
        assert planted_host not in c.known_hosts.read_text()
        assert planted_pub.split()[1] not in c.authorized_keys.read_text()
        run = ssh_with_key(attacker, address)
        assert run.returncode == 255 and "Permission denied" in run.stderr, run
        run = ssh_with_key(c.client_key, address, known_hosts=str(c.known_hosts),
                           strict="yes")
        assert run.returncode == 0, run.stderr
    finally:
        c.down()
    assert not c.authorized_keys.parent.exists()


@pytest.mark.parametrize("name", ["cluster.json", "known_hosts", "client_ed25519"])
def test_a_planted_symlink_is_not_followed(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o640)
    d = private_dir(tmp_path / "cl")
    (d / name).symlink_to(victim)
    with pytest.raises(local_cluster.ClusterError, match="symlink"):
        local_cluster.Cluster(1, d).up()
    if name == "cluster.json":
        assert local_cluster.main(["down", "--dir", str(d)]) == 1
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o640
    assert _processes_mentioning(str(d)) == []
    # The writer itself replaces a symlink instead of writing through it.
    local_cluster._write_file(d / name, "new\n", 0o600)
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o640
    st = (d / name).lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def fake_state(d: Path, prefix: str = "tmpr", cid: str = "beef", subnet: int = 250,
               owner: dict | None = None) -> dict:
    """A cluster.json as the script writes it, for a cluster that does not exist."""
    net = f"10.231.{subnet}"
    return {"id": cid, "prefix": prefix, "dir": str(d), "n": 2, "subnet": subnet,
            "bridge": f"{prefix}{cid}br", "bridge_address": f"{net}.1",
            "hosts": [{"name": f"{prefix}-{cid}-n{i}", "address": f"{net}.{10 + i}",
                       "ssh_port": 22, "netns": f"{prefix}-{cid}-n{i}",
                       "host_side_veth": f"{prefix}{cid}h{i}", "alias": f"node{i}"}
                      for i in range(2)],
            "owner": owner, "created": 0.0}


FOREIGN_LINK, FOREIGN_NS = "tmprforeign0", "tmpr-foreign"


@pytest.fixture
def foreign():
    """An interface (a bridge) and a namespace that no cluster made: what an attacker would name."""
    subprocess.run(["ip", "link", "add", FOREIGN_LINK, "type", "bridge"], check=True)
    subprocess.run(["ip", "netns", "add", FOREIGN_NS], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "link", "del", FOREIGN_LINK], capture_output=True)
        subprocess.run(["ip", "netns", "del", FOREIGN_NS], capture_output=True)


def foreign_objects_intact() -> None:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f" {FOREIGN_LINK}:" in links
    assert FOREIGN_NS in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                        text=True).stdout.split()
    lo = subprocess.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True)
    assert lo.returncode == 0 and ",UP" in lo.stdout


def tamper(state: dict, how: str) -> None:
    h = state["hosts"][1]
    if how == "bridge eth0":
        state["bridge"] = "eth0"
    elif how == "bridge foreign":
        state["bridge"] = FOREIGN_LINK
    elif how == "veth lo":
        h["host_side_veth"] = "lo"
    elif how == "veth foreign":
        h["host_side_veth"] = FOREIGN_LINK
    elif how == "netns foreign":
        h["netns"] = h["name"] = FOREIGN_NS
    elif how == "netns path":
        h["netns"] = "../../netns/" + FOREIGN_NS
    elif how == "address":
        h["address"] = "192.168.7.11"
    elif how == "owner pid":
        state["owner"] = {"pid": "1; true", "start": 0}


TAMPERS = ["bridge eth0", "bridge foreign", "veth lo", "veth foreign", "netns foreign",
           "netns path", "address", "owner pid"]


@pytest.mark.parametrize("how", TAMPERS)
def test_down_refuses_a_tampered_cluster_json(tmp_path, foreign, capsys, how):
    d = private_dir(tmp_path / "cl")
    state = fake_state(d)
    local_cluster._write_file(d / "cluster.json", json.dumps(state), 0o600)
    assert local_cluster.Cluster.load(d).bridge == "tmprbeefbr"  # as written, it is accepted
    tamper(state, how)
    local_cluster._write_file(d / "cluster.json", json.dumps(state), 0o600)
    with pytest.raises(local_cluster.ClusterError, match="not written by this script"):
        local_cluster.Cluster.load(d)
    capsys.readouterr()
    assert local_cluster.main(["down", "--dir", str(d)]) == 1
    assert "not written by this script" in capsys.readouterr().err
    with pytest.raises(local_cluster.ClusterError):
        local_cluster.Cluster(1, d).up()  # `up` on that directory refuses it too
    foreign_objects_intact()
    assert (d / "cluster.json").exists()


@pytest.mark.parametrize("how", ["bridge foreign", "veth foreign", "netns foreign"])
def test_cleanup_skips_a_tampered_registry_file(foreign, how):
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = fake_state(Path("/nonexistent/tmpr"), owner={"pid": dead.pid, "start": 1})
    tamper(state, how)
    local_cluster._registry()
    path = local_cluster.REGISTRY / f"{state['id']}.json"
    local_cluster._write_file(path, json.dumps(state), 0o600, exclusive=True)
    try:
        assert local_cluster.cleanup_stale("tmpr") == []
        foreign_objects_intact()
        assert path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_down_lets_what_runs_in_the_namespaces_clean_up_after_itself(tmp_path):
    """Teardown ends a host's processes with SIGTERM first: a shell's EXIT trap runs. A login
    shell killed outright in its profile left a lock (pyenv's rehash) that every later SSH
    login on this machine waited 60 s for, and every cluster test after it failed."""
    c = local_cluster.Cluster(1, private_dir(tmp_path / "cl")).up()
    left = tmp_path / "released"
    try:
        shell = c.exec(0, ["bash", "-c", f"trap 'touch {left}' EXIT; while :; do sleep 0.05; done"])
        deadline = time.monotonic() + 10
        while shell.pid not in c.netns_pids(0) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        c.down()
    shell.wait(timeout=10)
    assert left.exists()


def test_a_stale_pyenv_rehash_lock_goes_and_a_live_ones_stays(tmp_path, monkeypatch):
    """A login ended mid-rehash left pyenv's lock, and every later login waited 60 s for it
    (every job after a day's cut-node benchmarks failed "agent did not answer"): the cluster
    script lets go of one no rehash holds any more, never of a fresh one."""
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    lock = tmp_path / "shims" / ".pyenv-shim"
    lock.parent.mkdir()
    lock.touch()
    local_cluster._release_stale_rehash_lock()
    assert lock.exists()  # a rehash under way holds it
    old = time.time() - local_cluster.REHASH_STALE - 1
    os.utime(lock, (old, old))
    local_cluster.cleanup_stale(prefix="none-of-ours")
    assert not lock.exists()
