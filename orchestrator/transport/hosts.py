"""Where an SSH node is (host, port, user, identity) and whether its host key is known,
without paramiko: submit's quick check runs on the path of every submit, and importing
paramiko (60-90 ms here) there would only delay the controller, which imports it anyway
(transport/ssh.py). ``~/.ssh/config``, when there is one, is still read with paramiko's
parser: OpenSSH's config language is not ours to reimplement."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from typing import Any

from orchestrator.spec import JobSpec, NodeSpec


def resolve_target(node: NodeSpec, spec: JobSpec) -> dict[str, Any]:
    """Hostname, port, user and identity for a node: the spec first, then ~/.ssh/config."""
    user, hostname, port = node.resolved(spec.ssh)
    identity = node.identity_file or spec.ssh.identity_file
    config_path = os.path.expanduser("~/.ssh/config")
    if os.path.exists(config_path):
        import paramiko

        entry = paramiko.SSHConfig.from_path(config_path).lookup(hostname)
        hostname = entry.get("hostname", hostname)
        if user is None and entry.get("user"):
            user = entry["user"]
        if node.explicit_port is None and entry.get("port"):
            port = int(entry["port"])
        if identity is None and entry.get("identityfile"):
            identity = entry["identityfile"][0]
    return {
        "hostname": hostname,
        "port": port,
        "username": user or _local_user(),
        "key_filename": os.path.expanduser(identity) if identity else None,
    }


def known_hosts_path(spec: JobSpec) -> str:
    return os.path.expanduser(spec.ssh.known_hosts or "~/.ssh/known_hosts")


def known_host_names(spec: JobSpec, hostname: str, port: int) -> bool:
    """Does known_hosts hold a key for this host (as ssh names it: ``[host]:port`` if not
    22)? What paramiko's ``HostKeys.lookup`` matches: a name of an entry's comma-separated
    list, plain or hashed (``|1|salt|hash``, HMAC-SHA1), no patterns; lines of fewer than
    three fields and comments are skipped. An entry whose key paramiko cannot parse counts
    here and is refused by the controller's connect (an error then, not now)."""
    name = hostname if port == 22 else f"[{hostname}]:{port}"
    try:
        with open(known_hosts_path(spec), encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3 or fields[0].startswith("#"):
                    continue
                if any(_matches(name, entry) for entry in fields[0].split(",")):
                    return True
    except OSError:
        return False
    return False


def _matches(name: str, entry: str) -> bool:
    if entry == name:
        return True
    if not entry.startswith("|1|"):
        return False
    try:
        salt, digest = (base64.b64decode(p) for p in entry[3:].split("|", 1))
    except (ValueError, binascii.Error):
        return False
    mine = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(mine, digest)


def _local_user() -> str:
    import getpass

    return getpass.getuser()
