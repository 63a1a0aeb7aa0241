#!/usr/bin/env python3
"""A cluster of N SSH hosts on one Linux machine: network namespaces on a bridge, each with
its own address and a real OpenSSH sshd with its own host key. Root needed.

    python examples/local-cluster/cluster.py up -n 3        # makes a private dir, prints it
    python examples/local-cluster/cluster.py up -n 3 --slurm --dir DIR  # and a real Slurm
    python examples/local-cluster/cluster.py status --dir DIR  # what runs, what does not
    python examples/local-cluster/cluster.py down --dir DIR  # the dir `up` printed
    python examples/local-cluster/cluster.py cleanup [--all] # leftovers of crashes

Namespaces share the filesystem and the process table with the machine (so the same python
and torch are on every "host"), but each has its own network stack: traffic between hosts
crosses real interfaces, and a host can be cut off with ``link_down``. Addresses come from
10.231.X.0/24; the namespaces have no default route and nothing is NATed, so no packet of
theirs leaves the bridge. Stdlib only; the test suite imports this file.

Every cluster is recorded in ``/run/orc-cluster/<id>.json`` (and ``<workdir>/cluster.json``)
with the process that owns it, so that ``cleanup_stale`` can remove what a crashed run left
behind without touching a cluster that another live process is using.

With ``--slurm`` (``Cluster(n, slurm=True)``) the hosts also form a Slurm cluster (Debian's
slurm-wlm and munge): a private ``munged`` (user munge, its socket in
``/run/orc-cluster-munge/<id>/``), ``slurmctld`` in the root namespace on the bridge address,
and one ``slurmd -N <host name>`` inside each namespace, all configured by ``<dir>/slurm.conf``
(``export SLURM_CONF=<dir>/slurm.conf`` and ``sinfo`` works). Every daemon is stopped through
the pidfile it wrote and whose process names our files on its command line, never by name.

The script runs as root and its sshds accept root logins, so it trusts nothing that another
user could have put in place:

- its state lives in a directory that it creates with mode 0700 (``mkdtemp`` by default); an
  existing directory is used only if it is a real directory owned by root, with mode 0700, in
  a path that no other user can change, holding nothing but files this script makes;
- keys are generated afresh on every ``up``: a key file found in the directory is deleted,
  never used;
- files are written with ``O_NOFOLLOW | O_EXCL`` and an explicit mode, after removing whatever
  was at that path, and modes are set through the open file, so no symlink is ever followed;
- ``cluster.json`` and the registry files are checked before any name in them is acted on:
  every name must be exactly one this script would have generated;
- sshd runs with ``StrictModes yes``; its ``authorized_keys`` lives in root's registry
  directory (``/run/orc-cluster/<id>/``), whose whole path is root's alone.
- munged's directory is made fresh (``O_EXCL``) by root and only then given to user munge;
  the munge key is created only if missing (0400, munge's), never replaced;
- its Slurm takes jobs from root only (``AllowGroups=root``) and shows other users nothing
  (``PrivateData``): munged serves every local user, by its own design.
"""

import argparse
import contextlib
import errno
import fcntl
import functools
import ipaddress
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeGuard

REGISTRY = Path("/run/orc-cluster")
SSHD = "/usr/sbin/sshd"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGED = "/usr/sbin/munged"
MUNGE_KEY = Path("/etc/munge/munge.key")
# munged (user munge) must reach its socket's directory, so it cannot live under the 0700
# cluster directory or registry: a root-owned 0711 tree with one munge-owned dir per cluster.
CGROUP_RUN = Path("/run/orc-cluster-cgroup")  # <id>: the cgroup hierarchies, bound for slurmd
MUNGE_RUN = Path("/run/orc-cluster-munge")
# Each slurmd has its namespace's own port space, so all of them share one port; slurmctld
# listens in the root namespace, where concurrent clusters need distinct ports.
SLURMD_PORT = 16818
SLURMCTLD_PORTS = range(16819, 16919)
# Plain paths only in slurm.conf: its parser knows no quoting (a space or '#' would break it).
_SLURM_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+-]*")
IFNAMSIZ = 15  # Linux interface names are at most 15 bytes
SUBNET_BASE = "10.231"
MAX_STATE_BYTES = 1 << 20  # cluster.json for 240 hosts is ~60 KB
# The only names this script creates in a cluster directory (authorized_keys: older versions).
_OUR_FILES = re.compile(r"cluster\.json|client_ed25519(\.pub)?|known_hosts|ssh_config"
                        r"|authorized_keys|host\d{1,3}_ed25519(\.pub)?|sshd\d{1,3}\.(pid|log)"
                        r"|slurm\.conf|cgroup\.conf")
# ... and the only directory: Slurm's state, spool dirs, pidfiles and logs.
_OUR_DIRS = ("slurm",)


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


def _run(*argv: str, check: bool = True, **popen: Any) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              **popen)
    except FileNotFoundError as exc:
        raise ClusterError(f"{argv[0]} not found (is iproute2 / openssh-server installed? "
                           "With --slurm: slurm-wlm and munge?)") from exc
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done


class Cluster:
    """N hosts in network namespaces joined by a bridge, each running its own sshd.

    The controller runs in the root namespace and reaches the hosts through the bridge, whose
    address there is ``bridge_address`` (10.231.X.1); host i is 10.231.X.(10+i).

    With ``slurm=True``, ``up`` also starts munged, slurmctld (root namespace, on the bridge
    address) and one slurmd per host (inside its namespace, Slurm node name = ``Host.name``,
    NodeAddr = ``Host.address``), all in one default partition ``debug``; clients need only
    ``slurm_env`` (``SLURM_CONF``).
    """

    def __init__(self, n: int, workdir: str | os.PathLike[str] | None = None, *,
                 prefix: str = "orc", subnet: int | None = None, slurm: bool = False):
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
        # No workdir: a fresh private one (0700, made with O_EXCL semantics by mkdtemp).
        self.dir = _canonical(tempfile.mkdtemp(prefix="orc-cluster-") if workdir is None
                              else workdir)
        self.prefix = prefix
        self.subnet = subnet
        self.id = ""
        self.bridge = ""
        self.bridge_address = ""
        self.hosts: list[Host] = []
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.authorized_keys: Path | None = None  # in the registry, once an id is chosen
        self.slurm = slurm
        self.slurm_conf: Path | None = self.dir / "slurm.conf" if slurm else None
        self.slurmctld_port = 0  # chosen with the id, under the registry lock
        self.slurmd_port = SLURMD_PORT if slurm else 0
        self.proctrack = "cgroup" if os.path.exists("/sys/fs/cgroup/freezer/tasks") else \
            "linuxproc"
        self._up = False

    # --- lifecycle -------------------------------------------------------------------------
    def up(self, *, owner: int | None = -1, timeout: float = 15.0,
           slurm_timeout: float = 60.0) -> "Cluster":
        """Build the namespaces, bridge and sshds; return once every sshd answers (and, with
        ``slurm``, once every Slurm node is idle, within ``slurm_timeout``).

        ``owner`` is the pid whose death makes the cluster stale (default: this process);
        ``None`` marks a cluster meant to outlive its creator (the ``up`` command). On any
        failure, whatever was built is torn down again before the error propagates.

        The directory is created (0700) if missing; an existing one is refused unless it is
        root's alone and holds only files of ours (see ``_prepare_dir``), and every file of
        ours in it, keys included, is deleted and made afresh.
        """
        if self._up:
            return self
        if self.slurm:
            _check_slurm_installed()
            if not _SLURM_SAFE_PATH.fullmatch(str(self.dir)):
                raise ClusterError(f"{self.dir}: slurm.conf cannot quote paths; use a directory "
                                   "whose path has only letters, digits and . _ / + -")
        _prepare_dir(self.dir)
        names = _our_entries(self.dir)
        if "cluster.json" in names:
            old = Cluster.load(self.dir)  # validated: refuses a state file it did not write
            if old.alive():
                raise ClusterError(f"{self.dir} holds the running cluster {old.id}: "
                                   "take it down first (`down --dir`) or use another directory")
            old.down()  # half-dead leftovers of an earlier `up` in this directory
        for name in names:  # never reuse a key (or anything else) found here
            if name in _OUR_DIRS:
                # rmtree works through directory fds and does not follow symlinks inside.
                _rmtree(self.dir / name)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)
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
            self._bind_cgroups()
            for i in range(self.n):
                self._start_sshd(i)
            deadline = time.monotonic() + timeout
            for i, h in enumerate(self.hosts):
                _wait_for_banner(h.address, h.ssh_port, deadline,
                                 log=self.dir / f"sshd{i}.log")
            if self.slurm:
                self._start_slurm(time.monotonic() + slurm_timeout)
        except BaseException:
            self.down()
            raise
        self._up = True
        return self

    def down(self) -> None:
        """Stop every sshd, Slurm daemon and munged of ours and every process in our
        namespaces; delete namespaces, veths and bridge. Things already gone are skipped
        silently; this never raises."""
        if self.slurm:
            # slurmd first (SIGTERM lets it leave cleanly); what its jobs left (slurmstepd,
            # tasks) lives in the namespaces and goes with them below.
            for h in self.hosts:
                with contextlib.suppress(Exception):
                    _stop_pidfile(self._slurmd_pidfile(h), *self._slurmd_marks(h))
        for i in range(len(self.hosts)):
            with contextlib.suppress(Exception):
                _stop_pidfile(self.dir / f"sshd{i}.pid")
        with contextlib.suppress(Exception):
            # Whatever still runs in our namespaces was started through them (ssh sessions,
            # agents, workers, exec()): ours to end.
            _end_netns_processes([h.netns for h in self.hosts])
        with contextlib.suppress(Exception):
            _release_stale_rehash_lock()
        for h in self.hosts:
            with contextlib.suppress(Exception):
                _run("ip", "netns", "del", h.netns, check=False)
            with contextlib.suppress(Exception):
                _run("ip", "link", "del", h.host_side_veth, check=False)  # usually gone with ns
        if self.slurm:
            with contextlib.suppress(Exception):
                # slurmctld saves its state on SIGTERM: give it longer than a daemon that
                # has nothing to save.
                _stop_pidfile(self._slurm_dir / "slurmctld.pid", str(self.slurm_conf),
                              grace=10.0)
            if self.id:
                with contextlib.suppress(Exception):
                    _stop_pidfile(self._munge_dir / "munged.pid",
                                  str(self._munge_dir / "munged.pid"))
                with contextlib.suppress(Exception):
                    _rmtree(self._munge_dir)
        if self.id:
            with contextlib.suppress(Exception):
                self._release_cgroups()
        if self.bridge:
            with contextlib.suppress(Exception):
                _run("ip", "link", "del", self.bridge, check=False)
        if self.id:
            keys = REGISTRY / self.id  # the id is 4 hex digits (checked): no path tricks
            with contextlib.suppress(Exception):
                (keys / "authorized_keys").unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                keys.rmdir()
            with contextlib.suppress(Exception):
                (REGISTRY / f"{self.id}.json").unlink(missing_ok=True)
        self._up = False

    def _bind_cgroups(self) -> None:
        """`ip netns exec` mounts a fresh /sys for each host's sshd and slurmd, hiding
        /sys/fs/cgroup, which a real node has: the hierarchies are bound (not shared: no
        unmount travels back) under /run, which it leaves alone, so that every host sees
        them (agents contain their workers in cgroups; slurmd's proctrack/cgroup)."""
        if not os.path.ismount("/sys/fs/cgroup") or os.path.ismount(self._cgroup_dir):
            return
        self._cgroup_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _run("mount", "--rbind", "/sys/fs/cgroup", str(self._cgroup_dir))
        _run("mount", "--make-rslave", str(self._cgroup_dir))

    def _release_cgroups(self) -> None:
        """Remove the (empty) cgroups our slurmds made, then unbind the hierarchies."""
        mounted = self._cgroup_dir
        if not os.path.ismount(mounted):
            return
        for hierarchy in mounted.iterdir():
            for h in self.hosts:
                top = hierarchy / f"slurm_{h.name}"
                if not top.is_dir():
                    continue
                for sub, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                    with contextlib.suppress(OSError):
                        os.rmdir(sub)  # a cgroup goes once nothing runs in it
        _run("umount", "--recursive", str(mounted), check=False)
        with contextlib.suppress(OSError):
            mounted.rmdir()

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

    def slow_link(self, i: int, mbit: int | None) -> None:
        """Throttle host i's cable to ``mbit`` megabits a second each way (a token bucket on
        both ends of its veth: a bad cable, a port negotiated down); None: full speed again."""
        for prefix, dev in ((["ip", "netns", "exec", self.hosts[i].netns], "eth0"),
                            ([], self.hosts[i].host_side_veth)):
            if mbit is None:
                _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                     f"{mbit}mbit", "burst", "32kbit", "latency", "400ms")

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
        """Whether every namespace exists and every daemon of ours (sshd; with ``slurm``,
        munged, slurmctld and every slurmd) still runs."""
        return bool(self.hosts) and all(self.health().values())

    def health(self) -> dict[str, bool]:
        """Each part of the cluster (``netns <name>``, ``sshd <alias>``, and with ``slurm``:
        ``munged``, ``slurmctld``, ``slurmd <name>``) and whether it exists or runs."""
        namespaces = _run("ip", "netns", "list", check=False).stdout.split()
        parts: dict[str, bool] = {}
        for i, h in enumerate(self.hosts):
            parts[f"netns {h.netns}"] = h.netns in namespaces
            parts[f"sshd {h.alias}"] = _pidfile_process(self.dir / f"sshd{i}.pid") is not None
        if self.slurm:
            parts["munged"] = _pidfile_process(self._munge_dir / "munged.pid",
                                               str(self._munge_dir / "munged.pid")) is not None
            parts["slurmctld"] = _pidfile_process(self._slurm_dir / "slurmctld.pid",
                                                  str(self.slurm_conf)) is not None
            for h in self.hosts:
                parts[f"slurmd {h.name}"] = self._slurmd_runs(h)
        return parts

    @property
    def slurm_env(self) -> dict[str, str]:
        """What a Slurm client (sinfo, srun, salloc, ...) needs in its environment."""
        if self.slurm_conf is None:
            raise ClusterError("this cluster has no Slurm (make it with slurm=True)")
        return {"SLURM_CONF": str(self.slurm_conf)}

    @property
    def slurm_nodes(self) -> list[str]:
        """Slurm node names, host i's at index i (the same as ``Host.name``)."""
        return [h.name for h in self.hosts] if self.slurm else []

    @classmethod
    def load(cls, workdir: str | os.PathLike[str]) -> "Cluster":
        """The cluster recorded in ``workdir`` (by ``up``), for ``down`` or inspection.

        The directory must pass the checks ``up`` makes, and ``cluster.json`` must name only
        objects this script would have made; otherwise ClusterError, and nothing is touched.
        """
        d = _canonical(workdir)
        _check_private_dir(d)
        path = d / "cluster.json"
        return cls._from_state(_validated_state(_read_state(path), path), workdir=d)

    # --- internals ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        links = _run("ip", "-o", "link", "show").stdout
        namespaces = set(_run("ip", "netns", "list", check=False).stdout.split())
        for _ in range(100):
            cid = secrets.token_hex(2)
            if (not os.path.lexists(REGISTRY / f"{cid}.json")
                    and not os.path.lexists(REGISTRY / cid)
                    and not os.path.lexists(MUNGE_RUN / cid)
                    and f"{self.prefix}{cid}" not in links
                    and not any(ns.startswith(f"{self.prefix}-{cid}-") for ns in namespaces)):
                break
        else:
            raise ClusterError("could not find an unused cluster id")
        self.id = cid
        self.authorized_keys = REGISTRY / cid / "authorized_keys"
        if self.subnet is None:
            self.subnet = _free_subnet()
        if self.slurm:
            self.slurmctld_port = _free_slurmctld_port()
        net = f"{SUBNET_BASE}.{self.subnet}"
        self.bridge = f"{self.prefix}{cid}br"
        self.bridge_address = f"{net}.1"
        self.hosts = [
            Host(name=f"{self.prefix}-{cid}-n{i}", address=f"{net}.{10 + i}", ssh_port=22,
                 netns=f"{self.prefix}-{cid}-n{i}", host_side_veth=f"{self.prefix}{cid}h{i}",
                 alias=f"node{i}")
            for i in range(self.n)]

    def _keys(self) -> None:
        assert self.authorized_keys is not None
        client_pub = _keygen(self.client_key, "orc-cluster-client")
        # sshd (StrictModes yes) wants the file and every directory above it root's and not
        # group/world-writable: /run/orc-cluster/<id>/ is, a directory under /tmp is not.
        _write_file(self.authorized_keys, client_pub, 0o600)
        known, config = [], []
        for i, h in enumerate(self.hosts):
            kind, blob = _keygen(self.dir / f"host{i}_ed25519", h.alias).split()[:2]
            known.append(f"{h.address} {kind} {blob}")
            config.append(
                f"Host {h.alias} {h.name}\n  HostName {h.address}\n  Port {h.ssh_port}\n"
                f"  User root\n  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.known_hosts}\n  GlobalKnownHostsFile /dev/null\n"
                f"  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n")
        _write_file(self.known_hosts, "\n".join(known) + "\n", 0o644)
        _write_file(self.ssh_config, "\n".join(config), 0o600)

    def _start_sshd(self, i: int) -> None:
        _run(*self.sshd_argv(i))

    # --- Slurm -----------------------------------------------------------------------------
    @property
    def _slurm_dir(self) -> Path:
        return self.dir / "slurm"

    @property
    def _munge_dir(self) -> Path:
        return MUNGE_RUN / self.id  # the id is 4 hex digits (checked): no path tricks

    @property
    def _cgroup_dir(self) -> Path:
        return CGROUP_RUN / self.id  # the id is 4 hex digits (checked): no path tricks

    def _slurmd_pidfile(self, h: Host) -> Path:
        return self._slurm_dir / f"slurmd-{h.name}.pid"  # SlurmdPidFile with %n expanded

    def _slurmd_runs(self, h: Host) -> bool:
        return _pidfile_process(self._slurmd_pidfile(h), *self._slurmd_marks(h)) is not None

    def _slurmd_marks(self, h: Host) -> tuple[str, str]:
        # What only our slurmd of this node has on its command line (`-N <name> -f <conf>`).
        return f"\0{h.name}\0", str(self.slurm_conf)

    def slurm_conf_text(self, hostname: str, cpus: int) -> str:
        """slurm.conf for this cluster: ``hostname`` is this machine's short hostname (which
        slurmctld insists on finding in SlurmctldHost), ``cpus`` each node's CPU count."""
        d, munge = self._slurm_dir, self._munge_dir
        lines = [
            f"# Written by cluster.py for cluster {self.id}; rewritten on every `up`.",
            f"ClusterName={self.prefix}{self.id}",
            # Root namespace, reached by the nodes on the bridge address.
            f"SlurmctldHost={hostname}({self.bridge_address})",
            f"SlurmctldPort={self.slurmctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={munge / 'munge.socket'}",  # our munged, not the system's
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdSpoolDir={d / '%n'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            # Processes tracked as production clusters do, by cgroup (a step that ends takes
            # every process of it along, daemons too), where cgroup v1's freezer is mounted;
            # by process tree otherwise. No task plugin: all nodes share this machine's CPUs.
            f"ProctrackType=proctrack/{self.proctrack}",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "SwitchType=switch/none", "MpiDefault=none", "MailProg=/bin/true",
            # Jobs take CPUs, not whole nodes; the node sizes below are taken as written,
            # whatever topology slurmd detects (one machine seen N times).
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2", "SlurmdTimeout=60", "InactiveLimit=0",
            "KillWait=5", "MinJobAge=60",
            # Preemption by partition priority, as shared clusters do it: a job of a partition
            # of a higher PriorityTier (none here until one is created with `scontrol create
            # partition`) takes a lower one's nodes; the preempted job's steps get SIGTERM,
            # its partition's GraceTime, then SIGKILL.
            "PreemptType=preempt/partition_prio", "PreemptMode=CANCEL",
        ]
        lines += [f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN"
                  for h in self.hosts]
        # OverSubscribe=YES: jobs that ask (--oversubscribe) may share CPUs; others do not.
        # AllowGroups=root: the cluster is root's (it takes root to build); any other local
        # user can reach munged and slurmctld, but may run nothing on the namespace nodes,
        # and PrivateData hides root's jobs, nodes and partitions from them.
        lines.append("PrivateData=accounts,events,jobs,nodes,partitions,reservations,usage,"
                     "users")
        lines.append(f"PartitionName=debug Nodes={','.join(h.name for h in self.hosts)} "
                     "Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES "
                     "AllowGroups=root")
        return "\n".join(lines) + "\n"

    def _start_slurm(self, deadline: float) -> None:
        """munged, then slurmctld, then the slurmds; returns once every node is idle."""
        assert self.slurm_conf is not None
        hostname = socket.gethostname().split(".")[0]
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", hostname):
            raise ClusterError(f"hostname {hostname!r} cannot go into slurm.conf")
        cpus = len(os.sched_getaffinity(0))
        os.mkdir(self._slurm_dir, 0o700)  # up() removed any earlier one
        _write_file(self.slurm_conf, self.slurm_conf_text(hostname, cpus), 0o644)
        # Next to slurm.conf is where Slurm looks for it.
        cgroup = "CgroupPlugin=cgroup/v1\n"
        if self.proctrack == "cgroup" and os.path.ismount(self._cgroup_dir):
            # Each slurmd keeps to slurm_<its node name> in the bound hierarchies.
            cgroup += f"CgroupMountpoint={self._cgroup_dir}\n"
        _write_file(self.dir / "cgroup.conf", cgroup, 0o644)
        self._start_munged(deadline)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(self.slurm_conf)}
        _run(SLURMCTLD, "-f", str(self.slurm_conf), env=env, cwd="/")
        ctld_log = self._slurm_dir / "slurmctld.log"
        _wait_until(lambda: _pidfile_process(self._slurm_dir / "slurmctld.pid",
                                             str(self.slurm_conf)) is not None
                    and _port_open(self.bridge_address, self.slurmctld_port),
                    deadline, "slurmctld did not start", ctld_log)
        for h in self.hosts:
            _run("ip", "netns", "exec", h.netns, SLURMD, "-N", h.name,
                 "-f", str(self.slurm_conf), env=env, cwd="/")
        for h in self.hosts:
            _wait_until(functools.partial(self._slurmd_runs, h), deadline,
                        f"slurmd {h.name} did not start",
                        self._slurm_dir / f"slurmd-{h.name}.log")

        def all_idle() -> bool:
            out = _run("sinfo", "-h", "-N", "-o", "%N %T", check=False, env=env).stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            return all(states.get(h.name) == "idle" for h in self.hosts)
        _wait_until(all_idle, deadline, "Slurm nodes did not all become idle", ctld_log)

    def _start_munged(self, deadline: float) -> None:
        """A munged of our own, as user munge, with its socket in ``MUNGE_RUN/<id>/``."""
        try:
            munge = pwd.getpwnam("munge")
        except KeyError as exc:
            raise ClusterError("no user munge: install munge (apt-get install munge)") from exc
        _ensure_munge_key(munge.pw_uid, munge.pw_gid)
        d = self._munge_dir
        _munge_run()
        try:
            # Fresh (a leftover would have made _allocate pick another id); 0711: munged
            # refuses to start unless every local user can reach its socket (a credential
            # only says who its holder is). Who may run jobs is Slurm's to say: see
            # AllowGroups in slurm_conf_text.
            os.mkdir(d, 0o711)
        except OSError as exc:
            raise ClusterError(f"cannot create {d}: {exc.strerror}") from exc
        os.chown(d, munge.pw_uid, munge.pw_gid, follow_symlinks=False)
        _chmod(d, 0o711)
        sock = d / "munge.socket"
        _run(MUNGED, f"--socket={sock}", f"--pid-file={d / 'munged.pid'}",
             f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}",
             f"--key-file={MUNGE_KEY}", user=munge.pw_uid, group=munge.pw_gid,
             extra_groups=[], cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        _wait_until(lambda: _pidfile_process(d / "munged.pid", str(d / "munged.pid"))
                    is not None and _unix_socket_open(sock),
                    deadline, "munged did not start", d / "munged.log")

    def sshd_argv(self, i: int) -> list[str]:
        """The command that starts host i's sshd (in its namespace, with our options only)."""
        h = self.hosts[i]
        options = {
            "ListenAddress": h.address, "Port": str(h.ssh_port),
            "HostKey": str(self.dir / f"host{i}_ed25519"),
            "PidFile": str(self.dir / f"sshd{i}.pid"),
            "AuthorizedKeysFile": str(self.authorized_keys),
            # sshd refuses keys in files or directories that others could write.
            "StrictModes": "yes", "UsePAM": "no", "PermitRootLogin": "prohibit-password",
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
        return argv

    def _state(self, owner_pid: int | None) -> dict[str, Any]:
        return {"id": self.id, "prefix": self.prefix, "dir": str(self.dir), "n": self.n,
                "subnet": self.subnet, "bridge": self.bridge,
                "bridge_address": self.bridge_address,
                "hosts": [asdict(h) for h in self.hosts],
                "slurm": {"slurmctld_port": self.slurmctld_port,
                          "slurmd_port": self.slurmd_port} if self.slurm else None,
                "owner": None if owner_pid is None else
                {"pid": owner_pid, "start": _start_time(owner_pid)},
                "created": time.time()}

    def _save(self, owner_pid: int | None) -> None:
        text = json.dumps(self._state(owner_pid), indent=2)
        registry = _registry()
        _write_file(registry / f"{self.id}.json", text, 0o600, exclusive=True)
        os.mkdir(registry / self.id, 0o700)  # for authorized_keys; _allocate saw it free
        _write_file(self.dir / "cluster.json", text, 0o600)

    @classmethod
    def _from_state(cls, state: dict[str, Any],
                    workdir: str | os.PathLike[str] | None = None) -> "Cluster":
        """A cluster from a state that ``_validated_state`` accepted."""
        slurm = state.get("slurm")  # absent in files of older versions
        c = cls(len(state["hosts"]), workdir or state["dir"], prefix=state["prefix"],
                subnet=state["subnet"], slurm=slurm is not None)
        if slurm is not None:
            c.slurmctld_port, c.slurmd_port = slurm["slurmctld_port"], slurm["slurmd_port"]
        c.id, c.bridge = state["id"], state["bridge"]
        c.hosts = [Host(**{"alias": f"node{i}", **h}) for i, h in enumerate(state["hosts"])]
        c.bridge_address = state["bridge_address"]
        c.authorized_keys = REGISTRY / c.id / "authorized_keys"
        return c


def cleanup_stale(prefix: str = "orc", *, include_detached: bool = False) -> list[str]:
    """Tear down clusters left behind by runs that died before ``down()``; return their ids.

    A cluster is stale when the process recorded as its owner is gone. Clusters made by the
    ``up`` command have no owner and are only removed with ``include_detached``. Only objects
    recorded in our registry are touched, and only processes inside our own namespaces or
    named by our sshd pidfiles are killed. A registry file that fails validation (a name this
    script would not have generated, a symlink, ...) is reported on stderr and left alone.
    """
    removed: list[str] = []
    _release_stale_rehash_lock()  # a run that died mid-login left it: every login waits
    if not os.path.lexists(REGISTRY):
        return removed
    _registry()  # refuses a registry that is not root's alone
    for path in sorted(REGISTRY.glob("*.json")):
        try:
            state = _validated_state(_read_state(path), path)
        except ClusterError as exc:
            print(f"warning: skipping {path}: {exc}", file=sys.stderr)
            continue  # not a state file we trust: leave it (and what it names) alone
        if state["prefix"] != prefix:
            continue
        owner = state["owner"]
        if owner is None and not include_detached:
            continue
        if owner is not None and owner["start"] is not None \
                and _start_time(owner["pid"]) == owner["start"]:
            continue  # its owner still runs: a live cluster, not ours to remove
        cluster = Cluster._from_state(state)
        cluster.down()
        removed.append(state["id"])
    return removed


# --- helpers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    fd = os.open(_registry() / ".lock",
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ClusterError(f"{REGISTRY / '.lock'} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _registry() -> Path:
    """``REGISTRY``, created 0700, or checked to be a real directory that only root can write
    (and then tightened to 0700) in a path that only root can change."""
    _check_trusted_dir(REGISTRY.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(REGISTRY, 0o700)
    try:
        fd = os.open(REGISTRY, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ClusterError(f"registry {REGISTRY} is not a directory (a symlink?): "
                           f"{exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ClusterError(f"registry {REGISTRY} is owned by uid {st.st_uid} with mode "
                               f"{stat.S_IMODE(st.st_mode):o}: it must be root's alone")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return REGISTRY


# --- files: no symlink followed, nothing trusted that another user could have put there -------
def _canonical(path: str | os.PathLike[str]) -> Path:
    """An absolute path whose parent has its symlinks resolved but whose last component does
    not, so that a symlink there is seen (and refused) rather than followed."""
    p = Path(os.path.abspath(os.fspath(path)))
    return Path(os.path.realpath(p.parent)) / p.name if p.name else p


def _check_trusted_dir(path: Path) -> None:
    """Refuse ``path`` unless it and every directory above it are real directories owned by
    root (or our euid) that no one else can write to, or sticky like /tmp (where others
    cannot rename or delete root's entries). Then only root can swap what is under it."""
    for d in [path, *path.parents]:
        try:
            st = os.lstat(d)
        except OSError as exc:
            raise ClusterError(f"cannot check {d}: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ClusterError(f"{d} is not a directory (a symlink?)")
        if st.st_uid not in (0, os.geteuid()):
            raise ClusterError(f"{d} belongs to uid {st.st_uid}: another user could replace "
                               "what is under it; use a directory of root's")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ClusterError(f"{d} (mode {stat.S_IMODE(st.st_mode):o}) is writable by "
                               "others: they could replace what is under it")


def _check_private_dir(path: Path) -> None:
    """Refuse ``path`` unless it is a real directory (not a symlink) owned by us (root) with
    no group or other permissions, in a path that only root can change."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise ClusterError(f"{path} does not exist") from exc
    if stat.S_ISLNK(st.st_mode):
        raise ClusterError(f"{path} is a symlink: refusing it (give the real directory)")
    if not stat.S_ISDIR(st.st_mode):
        raise ClusterError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ClusterError(f"{path} belongs to uid {st.st_uid}, not to root: this script did "
                           "not make it; refusing it (omit --dir for a fresh one)")
    if st.st_mode & 0o077:
        raise ClusterError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}; a cluster "
                           "directory must be 0700 (omit --dir for a fresh one)")
    _check_trusted_dir(path.parent)


def _prepare_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700 under a trusted directory, or
    check an existing one with ``_check_private_dir``."""
    if os.path.lexists(path):
        _check_private_dir(path)
        return
    missing = [path]
    while not os.path.lexists(missing[-1].parent):
        missing.append(missing[-1].parent)
    _check_trusted_dir(missing[-1].parent)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except OSError as exc:
            raise ClusterError(f"cannot create {d}: {exc.strerror}") from exc
        _chmod(d, 0o700)  # the umask may have taken bits off, never added any
    _check_private_dir(path)


def _our_entries(path: Path) -> list[str]:
    """The entries of a cluster directory; refuses one holding anything this script does not
    make (e.g. --dir /root/.ssh), or one of our names that is not a regular file."""
    names = []
    with os.scandir(path) as it:
        for entry in it:
            if entry.name in _OUR_DIRS:
                if not entry.is_dir(follow_symlinks=False):
                    raise ClusterError(f"{path / entry.name} is not a directory (a symlink?): "
                                       "refusing the directory")
                names.append(entry.name)
                continue
            if not _OUR_FILES.fullmatch(entry.name):
                raise ClusterError(f"{path} holds {entry.name!r}, which this script does not "
                                   "make: use an empty directory (or omit --dir)")
            if not entry.is_file(follow_symlinks=False):
                raise ClusterError(f"{path / entry.name} is not a regular file (a symlink?): "
                                   "refusing the directory")
            names.append(entry.name)
    return names


def _write_file(path: Path, text: str, mode: int, *, exclusive: bool = False) -> None:
    """Write a new file with ``mode``: whatever was at ``path`` (a file, a symlink) is removed
    first, not written through; ``exclusive``: refuse if anything is there."""
    if not exclusive:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise ClusterError(f"{path} is a directory")
            os.unlink(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode)
    except OSError as exc:
        raise ClusterError(f"cannot create {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)
        f.write(text)


def _chmod(path: Path, mode: int) -> None:
    """chmod through an fd opened without following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _read_private(path: Path, limit: int = MAX_STATE_BYTES) -> bytes:
    """A regular file of ours (root's, not writable by others), read without following a
    symlink and at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise ClusterError(f"refusing {path}: {why}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClusterError(f"refusing {path}: not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ClusterError(f"refusing {path}: owned by uid {st.st_uid} with mode "
                               f"{stat.S_IMODE(st.st_mode):o}, so not written by this script")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ClusterError(f"refusing {path}: larger than {limit} bytes")
    return data


def _keygen(path: Path, comment: str) -> str:
    """A fresh ed25519 key pair at ``path`` (0600) and ``path``.pub (0644); returns the public
    key. Whatever was at those paths is deleted first: a key found on disk is never used."""
    pub = path.with_name(path.name + ".pub")
    for p in (path, pub):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    _chmod(path, 0o600)
    _chmod(pub, 0o644)
    return _read_private(pub, 4096).decode()


def _read_state(path: Path) -> Any:
    try:
        return json.loads(_read_private(path))
    except ValueError as exc:
        raise ClusterError(f"{path} is not valid JSON: {exc}") from exc


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _validated_state(state: Any, source: Path) -> dict[str, Any]:
    """``state`` if every name, address and number in it is one this script would have written
    (names are regenerated from prefix and id and must match exactly); else ClusterError."""
    def bad(what: str) -> ClusterError:
        return ClusterError(f"{source} was not written by this script ({what}); refusing to "
                            "act on it, nothing was changed")

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    prefix, cid = state.get("prefix"), state.get("id")
    if not (isinstance(prefix, str) and re.fullmatch(r"[a-z][a-z0-9]*", prefix)):
        raise bad(f"prefix {prefix!r}")
    if not (isinstance(cid, str) and re.fullmatch(r"[0-9a-f]{4}", cid)):
        raise bad(f"id {cid!r}")
    subnet, hosts = state.get("subnet"), state.get("hosts")
    if not (_is_int(subnet) and 0 <= subnet <= 255):
        raise bad(f"subnet {subnet!r}")
    if not (isinstance(hosts, list) and 1 <= len(hosts) <= 240):
        raise bad("hosts is not a list of 1 to 240 hosts")
    if state.get("n") != len(hosts) or not _is_int(state.get("n")):
        raise bad(f"n {state.get('n')!r} for {len(hosts)} hosts")
    if len(prefix) + 4 + 1 + len(str(len(hosts) - 1)) > IFNAMSIZ:
        raise bad(f"prefix {prefix!r} too long")
    net = f"{SUBNET_BASE}.{subnet}"
    for key, expected in (("bridge", f"{prefix}{cid}br"), ("bridge_address", f"{net}.1")):
        if state.get(key) != expected:
            raise bad(f"{key} {state.get(key)!r}, expected {expected!r}")
    for i, h in enumerate(hosts):
        if not isinstance(h, dict):
            raise bad(f"host {i} is not an object")
        expected_host: dict[str, Any] = {
            "name": f"{prefix}-{cid}-n{i}", "address": f"{net}.{10 + i}", "ssh_port": 22,
            "netns": f"{prefix}-{cid}-n{i}", "host_side_veth": f"{prefix}{cid}h{i}",
            "alias": f"node{i}"}
        if set(h) - set(expected_host) or set(expected_host) - set(h) - {"alias"}:
            raise bad(f"host {i} has fields {sorted(h)}")
        for key, value in h.items():
            if value != expected_host[key] or type(value) is not type(expected_host[key]):
                raise bad(f"host {i} {key} {value!r}, expected {expected_host[key]!r}")
    d = state.get("dir")
    if not (isinstance(d, str) and os.path.isabs(d) and "\0" not in d
            and os.path.normpath(d) == d):
        raise bad(f"dir {d!r}")
    slurm = state.get("slurm")
    if slurm is not None:
        if not (isinstance(slurm, dict) and set(slurm) == {"slurmctld_port", "slurmd_port"}
                and all(_is_int(v) and 1024 <= v <= 65535 for v in slurm.values())):
            raise bad(f"slurm {slurm!r}")
        if not _SLURM_SAFE_PATH.fullmatch(d):
            raise bad(f"dir {d!r} for a Slurm cluster")
    owner = state.get("owner")
    if owner is not None:
        if not (isinstance(owner, dict) and set(owner) == {"pid", "start"}):
            raise bad(f"owner {owner!r}")
        pid, start = owner["pid"], owner["start"]
        if not (_is_int(pid) and pid > 0) or not (start is None or _is_int(start)):
            raise bad(f"owner {owner!r}")
    return state


def _free_subnet() -> int:
    """The lowest 10.231.X.0/24 that overlaps no address, route or recorded cluster here."""
    text = _run("ip", "-o", "addr").stdout + _run("ip", "route", "show", "table", "all",
                                                   check=False).stdout
    used = [ipaddress.ip_network(m, strict=False)
            for m in re.findall(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?:/\d{1,2})?\b", text)]
    recorded = set()
    for path in REGISTRY.glob("*.json") if REGISTRY.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ClusterError):
            recorded.add(int(_read_state(path)["subnet"]))
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


def _pidfile_process(path: Path, *marks: str) -> int | None:
    """The pid in a daemon's pidfile, if that process is still the daemon that wrote it:
    its command line holds every one of ``marks`` (default: the pidfile's own path)."""
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    # Guard against pid reuse: our daemons have our files' paths on their command lines.
    return pid if all(m.encode() in cmdline for m in marks or (str(path),)) else None


def _stop_pidfile(path: Path, *marks: str, grace: float = 2.0) -> None:
    pid = _pidfile_process(path, *marks)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _pidfile_process(path, *marks) == pid and time.monotonic() < deadline:
            time.sleep(0.02)
        if _pidfile_process(path, *marks) == pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)


# Lines after which a Slurm daemon or munged exits: no point waiting for it any longer.
_FATAL = re.compile(r"\bfatal:|not a valid controller|^\S+ \S+ \S+ Error:", re.M)


def _wait_until(ready: Callable[[], bool], deadline: float, what: str,
                log: Path | None = None) -> None:
    """Poll ``ready`` until it holds; past ``deadline``, or as soon as ``log`` reports a fatal
    error, ClusterError with the log's tail."""
    while not ready():
        text = ""
        with contextlib.suppress(OSError):
            if log:
                text = log.read_text(errors="replace")
        if time.monotonic() > deadline or _FATAL.search(text):
            tail = " | ".join(text.splitlines()[-5:])
            raise ClusterError(what + (f"; {log}: {tail}" if tail else ""))
        time.sleep(0.1)


def _port_open(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
        return True
    return False


def _unix_socket_open(path: Path) -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1)
        s.connect(str(path))
        return True
    return False


def _rmtree(path: Path) -> None:
    """Delete a directory tree of ours without following any symlink in it."""
    if not shutil.rmtree.avoids_symlink_attacks:
        raise ClusterError(f"cannot delete {path} safely on this platform")
    if os.path.lexists(path):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise ClusterError(f"{path} is not a directory (a symlink?): not deleting it")
        shutil.rmtree(path)


def _check_slurm_installed() -> None:
    missing = [p for p in (SLURMCTLD, SLURMD, MUNGED) if not os.access(p, os.X_OK)]
    missing += [p for p in ("sinfo", "srun") if shutil.which(p) is None]
    if missing:
        raise ClusterError(f"--slurm needs {', '.join(missing)}: "
                           "apt-get install -y slurm-wlm munge")


def _ensure_munge_key(uid: int, gid: int) -> None:
    """Create ``MUNGE_KEY`` (random, 0400, munge's) if it is missing; one that exists is
    left as it is (munged itself refuses a key with unsafe ownership or mode)."""
    keydir = MUNGE_KEY.parent
    if not os.path.lexists(keydir):
        os.mkdir(keydir, 0o700)
        os.chown(keydir, uid, gid, follow_symlinks=False)
    if os.path.lexists(MUNGE_KEY):
        return
    try:
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o400)
    except OSError as exc:
        raise ClusterError(f"cannot create {MUNGE_KEY}: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o400)
        f.write(secrets.token_bytes(128))  # what `mungekey` makes: 1024 bits


def _munge_run() -> Path:
    """``MUNGE_RUN``: created root's 0711 (munged must traverse it), or checked to be a real
    directory that only root can write, in a path only root can change."""
    _check_trusted_dir(MUNGE_RUN.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(MUNGE_RUN, 0o711)
    st = os.lstat(MUNGE_RUN)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ClusterError(f"{MUNGE_RUN} must be a directory of root's that no one else can "
                           "write (is it a symlink?)")
    return MUNGE_RUN


def _free_slurmctld_port() -> int:
    """A port for slurmctld (root namespace) that no recorded cluster uses and nothing here
    listens on; called under the registry lock."""
    taken = set()
    for path in REGISTRY.glob("*.json") if REGISTRY.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ClusterError):
            taken.add(int(_read_state(path)["slurm"]["slurmctld_port"]))
    for port in SLURMCTLD_PORTS:
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # slurmctld binds INADDR_ANY
            except OSError:
                continue
        return port
    raise ClusterError(f"no free slurmctld port in {SLURMCTLD_PORTS.start}.."
                       f"{SLURMCTLD_PORTS.stop - 1}")


def _netns_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    me = os.getpid()
    for pid in pids:
        if pid != me:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _end_netns_processes(namespaces: list[str], grace: float = 1.0) -> None:
    """Every process in ``namespaces``: SIGTERM, then SIGKILL to what is left after
    ``grace`` seconds. Not SIGKILL at once: a login shell killed in the middle of its profile
    can leave a lock that every later login of the machine's user waits for (pyenv's rehash,
    run by a ~/.bashrc, takes one and lets go of it in an EXIT trap, which SIGTERM runs and
    SIGKILL does not: seen after a benchmark's teardown, every SSH login of the next
    clusters waited 60 s for it, and their jobs failed "agent did not answer")."""
    for netns in namespaces:
        _kill_pids(_netns_pids(netns), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_netns_pids(n) for n in namespaces) and time.monotonic() < deadline:
        time.sleep(0.05)
    for netns in namespaces:
        _kill_pids(_netns_pids(netns))


REHASH_STALE = 30.0  # seconds after which pyenv's rehash lock is no live rehash's


def _release_stale_rehash_lock() -> None:
    """pyenv's rehash lock, where a login shell that took it is gone: rehash holds it for a
    moment and lets go of it in an EXIT trap, which a session ended before it set the trap
    (or SIGKILLed after the grace above, or in a namespace deleted under it) never runs.
    Every later login of the user then waits 60 s for it (``PYENV_REHASH_TIMEOUT``): seen
    twice in a day of cut-node benchmarks despite the SIGTERM first, and every job after
    failed "agent did not answer". Only one older than REHASH_STALE seconds goes."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    lock = root / "shims" / ".pyenv-shim"
    try:
        if time.time() - lock.stat().st_mtime > REHASH_STALE:
            lock.unlink()
    except OSError:
        pass  # none (most machines), or gone meanwhile


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
    up.add_argument("--dir", help="where keys, ssh_config, logs and state go: a new or "
                    "empty directory of root's with mode 0700 (default: a fresh one in $TMPDIR)")
    up.add_argument("--prefix", default="orc")
    up.add_argument("--subnet", type=int, help="use 10.231.SUBNET.0/24 (default: a free one)")
    up.add_argument("--slurm", action="store_true",
                    help="also run Slurm: munged, slurmctld here, a slurmd on every host "
                    "(needs slurm-wlm and munge); prints the SLURM_CONF to export")
    status = sub.add_parser("status", help="what of the cluster in --dir runs (exit 1 if "
                            "anything does not)")
    status.add_argument("--dir", required=True)
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
            if args.dir is not None and os.path.lexists(Path(args.dir) / "cluster.json"):
                old = Cluster.load(args.dir)  # checked: refuses a state it did not write
                if old.alive():
                    print(f"already up (cluster {old.id}); `down --dir {old.dir}` first",
                          file=sys.stderr)
                    _print_cluster(old)
                    return 0
                # else up() takes the half-dead leftovers down before reusing the directory
            c = Cluster(args.n, args.dir, prefix=args.prefix, subnet=args.subnet,
                        slurm=args.slurm)
            c.up(owner=None)
            _print_cluster(c)
        elif args.cmd == "status":
            if not os.path.lexists(Path(args.dir) / "cluster.json"):
                print(f"error: no cluster recorded in {args.dir}", file=sys.stderr)
                return 2
            c = Cluster.load(args.dir)
            health = c.health()
            print(f"cluster {c.id}: {c.n} hosts on bridge {c.bridge} ({c.bridge_address}/24)"
                  + (", with Slurm" if c.slurm else ""))
            for part, ok in health.items():
                print(f"  {part}: {'up' if ok else 'DOWN'}")
            if c.slurm_conf is not None:
                print(f"export SLURM_CONF={c.slurm_conf}")
            return 0 if all(health.values()) else 1
        elif args.cmd == "down":
            if not os.path.lexists(Path(args.dir) / "cluster.json"):
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
    print(f"\nstate, keys and logs (root only): {c.dir}")
    print(f"ssh_config: {c.ssh_config}\ntry:  ssh -F {c.ssh_config} node0 hostname")
    if c.slurm_conf is not None:
        print(f"\nSlurm: slurmctld on {c.bridge_address}:{c.slurmctld_port}, nodes "
              f"{','.join(c.slurm_nodes)} in partition debug; then sinfo, srun, salloc:")
        print(f"export SLURM_CONF={c.slurm_conf}\n")
    print(f"down: {sys.argv[0]} down --dir {c.dir}\n")
    print(f"# paste into a job spec:\n{c.spec_block()}")


if __name__ == "__main__":
    sys.exit(main())
