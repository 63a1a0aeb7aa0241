#!/usr/bin/env python3
"""Is paramiko's cost per node a bottleneck at 256 nodes? (root needed: a namespace host with
a real sshd.)

    sudo python benchmarks/bench_handshake.py [--logins 32] [--mib 64] [--out benchmarks]

- handshake: what one login costs the controller's process in CPU (paramiko: key exchange,
  host key check, public-key auth), for the algorithms paramiko negotiates by default and
  for alternatives (``disabled_algorithms`` steering it), --logins sequential logins each;
  the CPU a connect costs is what 256 nodes cost the controller's cores at launch.
- stream: CPU per MiB received over an exec channel (``head -c N /dev/zero``), per cipher:
  what a flood of output costs on the controller's side.

Medians over the logins; CPU is this process's (getrusage), so the sshd's is not counted
(on a real cluster it is the node's). Writes handshake.md and handshake.json to --out.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import paramiko

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_cluster import load_cluster_module  # noqa: E402

# Each variant: what it forces, by disabling what paramiko would otherwise prefer.
KEX_ALL = list(paramiko.Transport._preferred_kex)
CIPHERS_ALL = list(paramiko.Transport._preferred_ciphers)  # (paramiko has no chacha20)


def only(kind: str, keep: str, every: list[str]) -> dict[str, list[str]]:
    return {kind: [a for a in every if a != keep]}


VARIANTS: dict[str, dict[str, list[str]]] = {
    "default": {},  # paramiko 5's first choice: mlkem768x25519 (post-quantum hybrid)
    "kex curve25519": only("kex", "curve25519-sha256@libssh.org", KEX_ALL),
    "kex ecdh-nistp256": only("kex", "ecdh-sha2-nistp256", KEX_ALL),
    "kex dh-group14": only("kex", "diffie-hellman-group14-sha256", KEX_ALL),
}
STREAM = ["aes128-ctr", "aes256-ctr", "aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def login(cluster: Any, disabled: dict[str, list[str]]) -> tuple[paramiko.SSHClient, float,
                                                                     float]:
    h = cluster.hosts[0]
    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())  # verified, as the product
    wall, cpu = time.monotonic(), _cpu()
    client.connect(h.address, port=h.ssh_port, username="root",
                   key_filename=str(cluster.client_key), look_for_keys=False,
                   allow_agent=False, timeout=30, disabled_algorithms=disabled)
    return client, time.monotonic() - wall, _cpu() - cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logins", type=int, default=32)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = p.parse_args()
    local_cluster = load_cluster_module()
    results: dict[str, Any] = {"handshake": {}, "stream": {}}
    with tempfile.TemporaryDirectory(prefix="bench-hs-") as tmp:
        with local_cluster.Cluster(1, tmp) as cluster:
            for name, disabled in VARIANTS.items():
                walls, cpus, chosen = [], [], ""
                for _ in range(args.logins):
                    client, wall, cpu = login(cluster, disabled)
                    t = client.get_transport()
                    assert t is not None
                    chosen = f"{t.host_key_type}, {t.local_cipher}"
                    client.close()
                    walls.append(wall)
                    cpus.append(cpu)
                results["handshake"][name] = {"wall_s": statistics.median(walls),
                                              "cpu_s": statistics.median(cpus),
                                              "negotiated": chosen}
                print(name, results["handshake"][name], flush=True)
            size = args.mib << 20
            for cipher in STREAM:
                client, _, _ = login(cluster, only("ciphers", cipher, CIPHERS_ALL))
                t = client.get_transport()
                assert t is not None and t.remote_cipher == cipher, t.remote_cipher
                channel = t.open_session()
                wall, cpu = time.monotonic(), _cpu()
                channel.exec_command(f"head -c {size} /dev/zero")
                got = 0
                while data := channel.recv(1 << 20):
                    got += len(data)
                wall, cpu = time.monotonic() - wall, _cpu() - cpu
                client.close()
                assert got == size, (got, size)
                results["stream"][cipher] = {"mib_per_s": args.mib / wall,
                                             "cpu_ms_per_mib": 1000 * cpu / args.mib}
                print(cipher, results["stream"][cipher], flush=True)
    out = Path(args.out)
    (out / "handshake.json").write_text(json.dumps(results, indent=1))
    rows = ["| login (key exchange) | host key, cipher | wall (s) | controller CPU (ms) | "
            "256 logins, CPU (s) |", "| --- | --- | --- | --- | --- |"]
    for name, r in results["handshake"].items():
        rows.append(f"| {name} | {r['negotiated']} | {r['wall_s']:.3f} | "
                    f"{1000 * r['cpu_s']:.1f} | {256 * r['cpu_s']:.1f} |")
    rows += ["", "| cipher | MiB/s received | controller CPU (ms per MiB) |", "| --- | --- | --- |"]
    for cipher, r in results["stream"].items():
        rows.append(f"| {cipher} | {r['mib_per_s']:.0f} | {r['cpu_ms_per_mib']:.1f} |")
    cmd = "python benchmarks/bench_handshake.py " + " ".join(sys.argv[1:])
    (out / "handshake.md").write_text(
        f"# paramiko per node: logins and ciphers\n\n`{cmd.strip()}`; medians of "
        f"{args.logins} logins; one namespace host with OpenSSH's sshd on this machine "
        "(2 cores, shared). CPU is the controller process's only.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
