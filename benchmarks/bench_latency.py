#!/usr/bin/env python3
"""Control-plane latency on the namespace cluster (root needed): a trivial job, submit to done,
on 1, 16, 64 SSH nodes, against plain ``ssh node true`` in the same invocation.

    sudo python benchmarks/bench_latency.py [--nodes 1,16,64] [--reps 3] [--out benchmarks]
                                            [--cli]

- ssh:  ``ssh -F <cluster config> host true`` (a fresh login: key exchange, auth, exec).
- job:  ``orchestrator.submit`` of ``command: [true]``, one worker per node, on the first N
        hosts, then ``orchestrator.wait`` (poll 0.2 s, as ``submit --wait``); the time from
        submit to the terminal state, plus where it went, from the store: submit to the
        attempt's start (connect, agents, ports), start to the last rank RUNNING... and the
        last exit to the end (shutdown, linger). With --cli: the command a user types,
        ``python -m orchestrator submit SPEC --wait`` (its own start and exit included).

Medians of --reps, interleaved. Writes latency.md, latency.json and latency.png (matplotlib,
if installed) to --out. The issue's goals: 1 node at most 2.5x ssh; 16 nodes at most 1.4x and
64 nodes at most 2x one node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import orchestrator  # noqa: E402
from benchmarks.bench_cluster import load_cluster_module  # noqa: E402
from orchestrator.store import Store  # noqa: E402
from orchestrator.timeline import PHASES, shown  # noqa: E402


def plain_ssh(cluster, i: int) -> float:
    start = time.monotonic()
    subprocess.run(["ssh", "-F", str(cluster.ssh_config), cluster.hosts[i].alias, "true"],
                   check=True, capture_output=True, timeout=60)
    return time.monotonic() - start


def parallel_ssh(cluster, n: int, command: str) -> float:
    """The floor for N nodes on this machine: N logins at once, each running ``command``."""
    start = time.monotonic()
    procs = [subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), h.alias, command],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for h in cluster.hosts[:n]]
    for p in procs:
        if p.wait(timeout=120) != 0:
            raise SystemExit(f"ssh {command!r} failed")
    return time.monotonic() - start


def job(cluster, n: int, workdir: Path, cli: bool = False) -> dict[str, float]:
    spec = {
        "name": "latency", "nodes": [{"host": f"root@{h.address}"} for h in cluster.hosts[:n]],
        "ssh": {"identity_file": str(cluster.client_key),
                "known_hosts": str(cluster.known_hosts), "connect_timeout": 10},
        "python": sys.executable, "nproc_per_node": 1, "command": ["true"],
        "workdir": str(workdir), "launch_timeout": 120,
    }
    path = workdir / f"latency-{n}.yaml"
    path.write_text(yaml.safe_dump(spec))
    start, wall = time.monotonic(), time.time()
    if cli:
        done = subprocess.run([sys.executable, "-m", "orchestrator", "submit", str(path),
                               "--wait"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        total = time.monotonic() - start
        if done.returncode != 0:
            raise SystemExit(f"{n} nodes: exit {done.returncode}: {done.stderr.strip()}")
        job_id = done.stderr.split("submitted ", 1)[1].split()[0]
    else:
        job_id = orchestrator.submit(path)
        result = orchestrator.wait(job_id, timeout=300)
        total = time.monotonic() - start
        if result["state"] != "SUCCEEDED":
            raise SystemExit(f"{n} nodes: {result['state']}: {result['failure']}")
    store = Store()
    try:
        record = store.get_job(job_id)
    finally:
        store.close()
    attempt = record.attempts[0]
    out = {"total": total, "to_attempt": attempt.started_at - wall,
           "attempt": (attempt.ended_at or attempt.started_at) - attempt.started_at,
           "after": (record.ended_at or 0) - (attempt.ended_at or 0)}
    # Where the time went, from the controller's phase timeline (orchestrator/timeline.py):
    # each phase's seconds after this benchmark started the submit.
    for mark in shown(record.timeline_json, record.submitted_at):
        out[f"phase:{mark['phase']}"] = mark["seconds"] + (record.submitted_at - wall)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,16,64")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--cli", action="store_true",
                        help="time `python -m orchestrator submit SPEC --wait`, not the API")
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    cl = load_cluster_module()
    runs: dict[str, list[dict[str, float]]] = {str(n): [] for n in sizes}
    floors: dict[str, list[dict[str, float]]] = {str(n): [] for n in sizes}
    ssh_runs: list[float] = []
    # Two Pythons start on each node (the relay, then the agent): the floor runs one.
    python_start = f"{sys.executable} -c 'import json, socket, threading, subprocess'"
    with tempfile.TemporaryDirectory() as tmp, cl.Cluster(max(sizes), Path(tmp) / "c") as c:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")  # not the user's jobs
        work = Path(tmp) / "work"
        work.mkdir()
        for _ in range(args.reps):
            ssh_runs.append(plain_ssh(c, 0))
            for n in sizes:
                floors[str(n)].append({"ssh": parallel_ssh(c, n, "true"),
                                       "ssh_python": parallel_ssh(c, n, python_start)})
                runs[str(n)].append(job(c, n, work, args.cli))
                print(f"{n} nodes: {runs[str(n)][-1]['total']:.2f} s", file=sys.stderr)
    ssh = statistics.median(ssh_runs)
    med = {n: {k: statistics.median(r[k] for r in rs if k in r) for k in rs[0]}
           for n, rs in runs.items()}
    floor = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for n, rs in floors.items()}
    one = med[str(sizes[0])]["total"]
    lines = ["# Control-plane latency on the namespace cluster (medians of "
             f"{args.reps} runs)", "",
             f"`sudo python benchmarks/bench_latency.py --nodes {args.nodes} --reps "
             f"{args.reps}{' --cli' if args.cli else ''}`: a trivial job (`true`, one worker "
             "per node) over SSH, submit to done through "
             f"{'`orchestrator submit --wait`' if args.cli else '`orchestrator.wait`'}. "
             "Machine: 2 cores, noisy.", "",
             f"plain `ssh node true`: {ssh:.2f} s", "",
             "| nodes | submit to done (s) | vs ssh | vs 1 node | submit to attempt start | "
             "attempt | attempt end to job end | floor: N parallel `ssh true` | "
             "N parallel `ssh python` |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n in sizes:
        m, f = med[str(n)], floor[str(n)]
        lines.append(f"| {n} | {m['total']:.2f} | {m['total'] / ssh:.1f}x | "
                     f"{m['total'] / one:.2f}x | {m['to_attempt']:.2f} | {m['attempt']:.2f} | "
                     f"{m['after']:.2f} | {f['ssh']:.2f} | {f['ssh_python']:.2f} |")
    lines += ["", "Where the time goes: each phase of the timeline (`status --json`), seconds "
              "after the submit began (medians):", "",
              "| phase | " + " | ".join(f"{n} node(s)" for n in sizes) + " |",
              "| --- | " + " | ".join("---" for _ in sizes) + " |"]
    for phase in PHASES:
        key = f"phase:{phase}"
        if any(key in med[str(n)] for n in sizes):
            lines.append(f"| {phase} | " + " | ".join(
                f"{med[str(n)][key]:.3f}" if key in med[str(n)] else "" for n in sizes) + " |")
    lines.append(f"| exit of `{'submit --wait' if args.cli else 'wait'}` | " + " | ".join(
        f"{med[str(n)]['total']:.3f}" for n in sizes) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latency.md").write_text("\n".join(lines) + "\n")
    (args.out / "latency.json").write_text(json.dumps(
        {"ssh": ssh_runs, "runs": runs, "medians": med, "floors": floors}, indent=2))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [med[str(n)]["total"] for n in sizes], "o-",
            label="orchestrator, submit to done")
    ax.plot(sizes, [floor[str(n)]["ssh_python"] for n in sizes], "s--",
            label="floor: N parallel ssh + python start")
    ax.axhline(ssh, color="grey", linestyle=":", label="one plain ssh node true")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("SSH nodes")
    ax.set_ylabel("seconds")
    ax.set_title("Trivial job latency (namespace cluster, 2 cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "latency.png", dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
