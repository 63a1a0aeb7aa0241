#!/usr/bin/env python3
"""A cluster of N SSH hosts on one Linux machine: network namespaces on a bridge, each with
its own address and a real OpenSSH sshd with its own host key. Root needed.

    python examples/local-cluster/cluster.py up -n 3 --dir /tmp/cluster   # prints a spec block
    python examples/local-cluster/cluster.py down --dir /tmp/cluster
    python examples/local-cluster/cluster.py cleanup [--all]              # leftovers of crashes

Namespaces share the filesystem and the process table with the machine (so the same python
and torch are on every "host"), but each has its own network stack: traffic between hosts
crosses real interfaces, and a host can be cut off with ``link_down``. Addresses come from
10.231.X.0/24; the namespaces have no default route and nothing is NATed, so no packet of
theirs leaves the bridge. Stdlib only; the test suite imports this file.

Every cluster is recorded in ``/run/orc-cluster/<id>.json`` (and ``<workdir>/cluster.json``)
with the process that owns it, so that ``cleanup_stale`` can remove what a crashed run left
behind without touching a cluster that another live process is using.
"""

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REGISTRY = Path("/run/orc-cluster")
SSHD = "/usr/sbin/sshd"
IFNAMSIZ = 15  # Linux interface names are at most 15 bytes
SUBNET_BASE = "10.231"


class ClusterError(RuntimeError):
    """A step of building or tearing down the cluster failed (the message names the step)."""


@dataclass
class Host:
    """One fake host: a network namespace with an sshd on ``address:ssh_port``."""

    name: str  # the namespace name; also a Host alias in ssh_config
    address: str
    ssh_port: int
    netns: str
    host_side_veth: str  # the bridge port in the root namespace; link_down sets it down
    alias: str  # node<i>, the friendly Host alias in ssh_config


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise ClusterError(f"{argv[0]} not found (is iproute2 / openssh-server installed?)") \
            from exc
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done


class Cluster:
    """N hosts in network namespaces joined by a bridge, each running its own sshd.

    The controller runs in the root namespace and reaches the hosts through the bridge, whose
    address there is ``bridge_address`` (10.231.X.1); host i is 10.231.X.(10+i).
    """

    def __init__(self, n: int, workdir: str | os.PathLike[str], *, prefix: str = "orc",
                 subnet: int | None = None):
        if not 1 <= n <= 240:
            raise ValueError(f"n must be in 1..240 (hosts are .10 to .249 of a /24), got {n}")
        if not re.fullmatch(r"[a-z][a-z0-9]*", prefix):
            raise ValueError(f"prefix must match [a-z][a-z0-9]*, got {prefix!r}")
        # Longest interface name: <prefix><4 hex id>h<i>.
        longest = len(prefix) + 4 + 1 + len(str(n - 1))
        if longest > IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} too long for {n} hosts: interface names "
                             f"would be {longest} > {IFNAMSIZ} characters")
        if subnet is not None and not 0 <= subnet <= 255:
            raise ValueError(f"subnet must be in 0..255, got {subnet}")
        self.n = n
        self.dir = Path(workdir).resolve()
        self.prefix = prefix
        self.subnet = subnet
        self.id = ""
        self.bridge = ""
        self.bridge_address = ""
        self.hosts: list[Host] = []
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self._up = False

    # --- lifecycle -------------------------------------------------------------------------
    def up(self, *, owner: int | None = -1, timeout: float = 15.0) -> "Cluster":
        """Build the namespaces, bridge and sshds; return once every sshd answers.

        ``owner`` is the pid whose death makes the cluster stale (default: this process);
        ``None`` marks a cluster meant to outlive its creator (the ``up`` command). On any
        failure, whatever was built is torn down again before the error propagates.
        """
        if self._up:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        owner_pid = os.getpid() if owner == -1 else owner
        try:
            with _registry_lock():
                # Choosing names and the subnet and creating the bridge under one lock keeps two
                # concurrent up() calls (two pytest sessions) from picking the same ones.
                self._allocate()
                self._save(owner_pid)
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            self._keys()
            for h in self.hosts:
                _run("ip", "netns", "add", h.netns)
                _run("ip", "-n", h.netns, "link", "set", "lo", "up")
                _run("ip", "link", "add", h.host_side_veth, "type", "veth",
                     "peer", "name", "eth0", "netns", h.netns)
                _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
                _run("ip", "link", "set", h.host_side_veth, "master", self.bridge, "up")
            for i in range(self.n):
                self._start_sshd(i)
            deadline = time.monotonic() + timeout
            for i, h in enumerate(self.hosts):
                _wait_for_banner(h.address, h.ssh_port, deadline,
                                 log=self.dir / f"sshd{i}.log")
        except BaseException:
            self.down()
            raise
        self._up = True
        return self

    def down(self) -> None:
        """Stop every sshd and every process in our namespaces; delete namespaces, veths and
        bridge. Things already gone are skipped silently; this never raises."""
        for i in range(len(self.hosts)):
            with contextlib.suppress(Exception):
                _stop_pidfile(self.dir / f"sshd{i}.pid")
        for h in self.hosts:
            with contextlib.suppress(Exception):
                # Whatever still runs in our namespace was started through it (ssh sessions,
                # agents, workers, exec()): ours to kill.
                _kill_pids(_netns_pids(h.netns))
            with contextlib.suppress(Exception):
                _run("ip", "netns", "del", h.netns, check=False)
            with contextlib.suppress(Exception):
                _run("ip", "link", "del", h.host_side_veth, check=False)  # usually gone with ns
        if self.bridge:
            with contextlib.suppress(Exception):
                _run("ip", "link", "del", self.bridge, check=False)
        if self.id:
            with contextlib.suppress(Exception):
                (REGISTRY / f"{self.id}.json").unlink(missing_ok=True)
        self._up = False

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- faults and helpers ------------------------------------------------------------------
    def link_down(self, i: int) -> None:
        """Cut host i off the network: its bridge port goes down (the cable is unplugged).

        The host keeps its address and route; packets to and from it are silently dropped,
        so open TCP connections hang and new ones time out, as with a real cut cable.
        """
        _run("ip", "link", "set", self.hosts[i].host_side_veth, "down")

    def link_up(self, i: int) -> None:
        """Plug host i's cable back in (the bridge has no STP, so it forwards at once)."""
        _run("ip", "link", "set", self.hosts[i].host_side_veth, "up")

    def exec(self, i: int, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host i's network namespace (``ip netns exec``)."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i].netns, *argv],
                                **popen_kwargs)

    def netns_pids(self, i: int) -> list[int]:
        """Pids of every process in host i's network namespace (``ip netns pids``)."""
        return _netns_pids(self.hosts[i].netns)

    def spec_block(self) -> str:
        """YAML for a job spec's ``nodes:`` and ``ssh:`` that points at this cluster."""
        lines = ["nodes:"] + [f"  - host: root@{h.address}" for h in self.hosts]
        lines += ["ssh:", f"  identity_file: {self.client_key}",
                  f"  known_hosts: {self.known_hosts}",
                  "# non-interactive SSH gets the system PATH: name the interpreter with torch",
                  f"python: {sys.executable}"]
        return "\n".join(lines)

    def alive(self) -> bool:
        """Whether every namespace exists and every sshd still runs."""
        namespaces = _run("ip", "netns", "list", check=False).stdout.split()
        return bool(self.hosts) and all(
            h.netns in namespaces and _pidfile_process(self.dir / f"sshd{i}.pid") is not None
            for i, h in enumerate(self.hosts))

    @classmethod
    def load(cls, workdir: str | os.PathLike[str]) -> "Cluster":
        """The cluster recorded in ``workdir`` (by ``up``), for ``down`` or inspection."""
        state = json.loads((Path(workdir) / "cluster.json").read_text())
        return cls._from_state(state)

    # --- internals ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        links = _run("ip", "-o", "link", "show").stdout
        namespaces = set(_run("ip", "netns", "list", check=False).stdout.split())
        for _ in range(100):
            cid = secrets.token_hex(2)
            if (not (REGISTRY / f"{cid}.json").exists() and f"{self.prefix}{cid}" not in links
                    and not any(ns.startswith(f"{self.prefix}-{cid}-") for ns in namespaces)):
                break
        else:
            raise ClusterError("could not find an unused cluster id")
        self.id = cid
        if self.subnet is None:
            self.subnet = _free_subnet()
        net = f"{SUBNET_BASE}.{self.subnet}"
        self.bridge = f"{self.prefix}{cid}br"
        self.bridge_address = f"{net}.1"
        self.hosts = [
            Host(name=f"{self.prefix}-{cid}-n{i}", address=f"{net}.{10 + i}", ssh_port=22,
                 netns=f"{self.prefix}-{cid}-n{i}", host_side_veth=f"{self.prefix}{cid}h{i}",
                 alias=f"node{i}")
            for i in range(self.n)]

    def _keys(self) -> None:
        if not self.client_key.exists():
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "orc-cluster-client",
                 "-f", str(self.client_key))
        self.client_key.chmod(0o600)
        (self.dir / "authorized_keys").write_text(
            self.client_key.with_suffix(".pub").read_text())
        known, config = [], []
        for i, h in enumerate(self.hosts):
            key = self.dir / f"host{i}_ed25519"
            if not key.exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.alias,
                     "-f", str(key))
            kind, blob = key.with_suffix(".pub").read_text().split()[:2]
            known.append(f"{h.address} {kind} {blob}")
            config.append(
                f"Host {h.alias} {h.name}\n  HostName {h.address}\n  Port {h.ssh_port}\n"
                f"  User root\n  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.known_hosts}\n  GlobalKnownHostsFile /dev/null\n"
                f"  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n")
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("\n".join(config))

    def _start_sshd(self, i: int) -> None:
        h = self.hosts[i]
        options = {
            "ListenAddress": h.address, "Port": str(h.ssh_port),
            "HostKey": str(self.dir / f"host{i}_ed25519"),
            "PidFile": str(self.dir / f"sshd{i}.pid"),
            "AuthorizedKeysFile": str(self.dir / "authorized_keys"),
            "StrictModes": "no", "UsePAM": "no", "PermitRootLogin": "prohibit-password",
            "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
            "AllowAgentForwarding": "no", "X11Forwarding": "no",
            # Benchmarks and tests open many sessions at once; the defaults (10:30:100, 10)
            # would drop connections under a burst.
            "MaxStartups": "100", "MaxSessions": "50",
            "Subsystem": "sftp internal-sftp",
        }
        if _sshd_version() >= (9, 8):
            # Newer sshd penalises a source address after failed logins; every test connects
            # from the bridge address, and fault tests fail logins on purpose.
            options["PerSourcePenalties"] = "no"
        # -f /dev/null: the system's sshd_config (and its Include, ports, keys) stays out.
        argv = ["ip", "netns", "exec", h.netns, SSHD, "-f", "/dev/null",
                "-E", str(self.dir / f"sshd{i}.log")]
        for k, v in options.items():
            argv += ["-o", f"{k}={v}"]
        _run(*argv)

    def _state(self, owner_pid: int | None) -> dict[str, Any]:
        return {"id": self.id, "prefix": self.prefix, "dir": str(self.dir), "n": self.n,
                "subnet": self.subnet, "bridge": self.bridge,
                "bridge_address": self.bridge_address,
                "hosts": [asdict(h) for h in self.hosts],
                "owner": None if owner_pid is None else
                {"pid": owner_pid, "start": _start_time(owner_pid)},
                "created": time.time()}

    def _save(self, owner_pid: int | None) -> None:
        text = json.dumps(self._state(owner_pid), indent=2)
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.id}.json").write_text(text)
        (self.dir / "cluster.json").write_text(text)

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> "Cluster":
        c = cls(len(state["hosts"]) or 1, state["dir"], prefix=state["prefix"],
                subnet=state.get("subnet"))
        c.id, c.bridge = state["id"], state["bridge"]
        c.hosts = [Host(**{"alias": f"node{i}", **h}) for i, h in enumerate(state["hosts"])]
        c.bridge_address = state.get("bridge_address", "")
        return c


def cleanup_stale(prefix: str = "orc", *, include_detached: bool = False) -> list[str]:
    """Tear down clusters left behind by runs that died before ``down()``; return their ids.

    A cluster is stale when the process recorded as its owner is gone. Clusters made by the
    ``up`` command have no owner and are only removed with ``include_detached``. Only objects
    recorded in our registry are touched, and only processes inside our own namespaces or
    named by our sshd pidfiles are killed.
    """
    removed: list[str] = []
    if not REGISTRY.is_dir():
        return removed
    for path in sorted(REGISTRY.glob("*.json")):
        try:
            state = json.loads(path.read_text())
            if state.get("prefix") != prefix:
                continue
            owner = state.get("owner")
            if owner is None and not include_detached:
                continue
            if owner is not None and _start_time(owner["pid"]) == owner["start"] \
                    and owner["start"] is not None:
                continue  # its owner still runs: a live cluster, not ours to remove
            cluster = Cluster._from_state(state)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a state file we understand: leave it alone
        cluster.down()
        removed.append(state["id"])
    return removed


# --- helpers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _free_subnet() -> int:
    """The lowest 10.231.X.0/24 that overlaps no address, route or recorded cluster here."""
    text = _run("ip", "-o", "addr").stdout + _run("ip", "route", "show", "table", "all",
                                                   check=False).stdout
    used = [ipaddress.ip_network(m, strict=False)
            for m in re.findall(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?:/\d{1,2})?\b", text)]
    recorded = set()
    for path in REGISTRY.glob("*.json") if REGISTRY.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            recorded.add(int(json.loads(path.read_text())["subnet"]))
    for x in range(1, 255):
        candidate = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        if x not in recorded and not any(candidate.overlaps(net) for net in used):
            return x
    raise ClusterError(f"no free {SUBNET_BASE}.X.0/24: every one overlaps a network here")


def _wait_for_banner(address: str, port: int, deadline: float, log: Path | None = None) -> None:
    while True:
        try:
            with socket.create_connection((address, port), timeout=1) as s:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                if s.recv(64).startswith(b"SSH-2.0"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = ""
            with contextlib.suppress(OSError):
                if log:
                    tail = " | ".join(log.read_text().splitlines()[-5:])
            raise ClusterError(f"sshd on {address}:{port} did not answer in time"
                               + (f"; its log: {tail}" if tail else ""))
        time.sleep(0.02)


def _start_time(pid: int) -> int | None:
    """A process's start time in clock ticks: with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pidfile_process(path: Path) -> int | None:
    """The pid in an sshd pidfile, if that process is still the sshd that wrote it."""
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    # Guard against pid reuse: our sshd has its pidfile's path on its command line.
    return pid if str(path).encode() in cmdline else None


def _stop_pidfile(path: Path, grace: float = 2.0) -> None:
    pid = _pidfile_process(path)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _pidfile_process(path) == pid and time.monotonic() < deadline:
            time.sleep(0.02)
        if _pidfile_process(path) == pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)


def _netns_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: list[int]) -> None:
    me = os.getpid()
    for pid in pids:
        if pid != me:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


_SSHD_VERSION: tuple[int, int] | None = None


def _sshd_version() -> tuple[int, int]:
    global _SSHD_VERSION
    if _SSHD_VERSION is None:
        # `sshd -V` exists from 9.x; older ones print the version in their usage text.
        out = _run(SSHD, "-V", check=False)
        m = re.search(r"OpenSSH_(\d+)\.(\d+)", out.stderr + out.stdout)
        _SSHD_VERSION = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return _SSHD_VERSION


# --- command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the hosts and start sshd (they keep running)")
    up.add_argument("-n", type=int, default=3, help="number of hosts (default 3)")
    up.add_argument("--dir", required=True, help="where keys, ssh_config, logs and state go")
    up.add_argument("--prefix", default="orc")
    up.add_argument("--subnet", type=int, help="use 10.231.SUBNET.0/24 (default: a free one)")
    down = sub.add_parser("down", help="tear down the cluster in --dir")
    down.add_argument("--dir", required=True)
    clean = sub.add_parser("cleanup", help="tear down clusters left by crashed runs")
    clean.add_argument("--prefix", default="orc")
    clean.add_argument("--all", action="store_true",
                       help="also clusters made by `up` (they have no owner process)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("error: network namespaces need root", file=sys.stderr)
        return 2
    try:
        if args.cmd == "up":
            state = Path(args.dir) / "cluster.json"
            if state.exists():
                old = Cluster.load(args.dir)
                if old.alive():
                    print(f"already up (cluster {old.id}); `down --dir {args.dir}` first",
                          file=sys.stderr)
                    _print_cluster(old)
                    return 0
                old.down()  # half-dead leftovers of an earlier `up` in this directory
            c = Cluster(args.n, args.dir, prefix=args.prefix, subnet=args.subnet)
            c.up(owner=None)
            _print_cluster(c)
        elif args.cmd == "down":
            if not (Path(args.dir) / "cluster.json").exists():
                print(f"error: no cluster recorded in {args.dir}", file=sys.stderr)
                return 2
            Cluster.load(args.dir).down()
            print("down")
        else:
            removed = cleanup_stale(args.prefix, include_detached=args.all)
            print("removed:", " ".join(removed) or "nothing")
    except (ClusterError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_cluster(c: Cluster) -> None:
    print(f"cluster {c.id}: {c.n} hosts on bridge {c.bridge} ({c.bridge_address}/24)")
    for h in c.hosts:
        print(f"  {h.alias}  {h.address}  netns {h.netns}")
    print(f"\nssh_config: {c.ssh_config}\ntry:  ssh -F {c.ssh_config} node0 hostname\n")
    print(f"# paste into a job spec:\n{c.spec_block()}")


if __name__ == "__main__":
    sys.exit(main())
