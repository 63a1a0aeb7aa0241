#!/usr/bin/env python3
"""Benchmarks on the namespace cluster (root needed): the orchestrator against torchrun typed
by hand over plain ssh, on the same two hosts, in the same invocation.

    python benchmarks/bench_cluster.py [--reps 5] [--only launch,recovery,detect]

- launch:   submit -> a 2-node x 2-process all-reduce job done, against `ssh` + `torchrun`
            on each node, and against the floor: `ssh` + spawning the workers directly.
- recovery: the last rank crashes; time from its crash to every rank running again
            (all READY), for both rendezvous backends, orchestrator vs torchrun --max-restarts.
- detect:   node 1's link is cut; time until the orchestrator marks it LOST (node_timeout 2 s),
            and until torchrun (c10d, --nnodes 1:2) has node 0 running again without it.

Prints medians (and all runs) as a markdown table; ratios are orchestrator / baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import orchestrator  # noqa: E402
from orchestrator.store import Store  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "bench_worker.py")
SLEEPER = str(ROOT / "tests" / "workers" / "sleeper.py")
PY = sys.executable
CAP = 45.0  # seconds after which a run that has not recovered is reported as such


def load_cluster_module():
    spec = importlib.util.spec_from_file_location(
        "local_cluster", ROOT / "examples" / "local-cluster" / "cluster.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = module
    spec.loader.exec_module(module)
    return module


class Bench:
    def __init__(self, cluster, workdir: Path):
        self.c = cluster
        self.dir = workdir
        self.hosts = cluster.hosts[:2]
        self.master = self.hosts[0].address
        self.port = 29600
        self.overhead: dict[str, list[float]] = {"static": [], "c10d": []}

    def next_port(self) -> int:
        self.port += 1
        return self.port

    # --- baselines over plain ssh -------------------------------------------------------
    def ssh(self, i: int, command: str, tag: str) -> subprocess.Popen:
        remote = (f"cd {shlex.quote(str(self.dir))} && "
                  f"env BENCH_TAG={tag} GLOO_SOCKET_IFNAME=eth0 "
                  f"{command}")
        return subprocess.Popen(["ssh", "-F", str(self.c.ssh_config), self.hosts[i].alias,
                                 remote], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def torchrun(self, i: int, backend: str, port: int, args: str, tag: str,
                 nnodes: str = "2", restarts: int = 0) -> subprocess.Popen:
        if backend == "static":
            rdzv = f"--node-rank {i} --master-addr {self.master} --master-port {port}"
        else:
            rdzv = (f"--rdzv-backend c10d --rdzv-endpoint {self.master}:{port} "
                    f"--rdzv-id {tag} --rdzv-conf is_host={int(i == 0)} "
                    f"--local-addr {self.hosts[i].address}")
        return self.ssh(i, f"{PY} -m torch.distributed.run --nnodes {nnodes} --nproc-per-node 2 "
                           f"--max-restarts {restarts} {rdzv} {WORKER} {args}", tag)

    def direct(self, i: int, port: int, args: str, tag: str) -> subprocess.Popen:
        workers = " & ".join(
            f"env RANK={2 * i + lr} LOCAL_RANK={lr} WORLD_SIZE=4 MASTER_ADDR={self.master} "
            f"MASTER_PORT={port} {PY} {WORKER} {args}" for lr in range(2))
        return self.ssh(i, f"sh -c {shlex.quote(workers + ' & wait')}", tag)

    @staticmethod
    def kill_tagged(tag: str) -> None:
        needle = f"BENCH_TAG={tag}".encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass

    # --- the orchestrator ----------------------------------------------------------------------
    def spec(self, command: list[str], **extra) -> Path:
        data = {
            "name": "bench", "nodes": [{"host": f"root@{h.address}"} for h in self.hosts],
            "ssh": {"identity_file": str(self.c.client_key),
                    "known_hosts": str(self.c.known_hosts)},
            "python": PY, "nproc_per_node": 2, "command": command, "workdir": str(self.dir),
            **extra,
        }
        path = self.dir / f"bench-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    # --- measurements ----------------------------------------------------------------------------
    def launch(self, variant: str) -> float:
        tag = uuid.uuid4().hex[:8]
        port = self.next_port()
        started = time.monotonic()
        if variant == "orchestrator":
            job = orchestrator.submit(self.spec([PY, WORKER, "--once"]))
            assert orchestrator.wait(job)["state"] == "SUCCEEDED"
        else:
            make = self.direct if variant == "ssh+python" else (
                lambda i, p, a, t: self.torchrun(i, "static", p, a, t))
            procs = [make(i, port, "--once", tag) for i in range(2)]
            for p in procs:
                out, _ = p.communicate(timeout=120)
                assert p.returncode == 0, out[-2000:]
        return time.monotonic() - started

    def recovery(self, variant: str, backend: str) -> float | None:
        marker = self.dir / f"crash-{uuid.uuid4().hex[:6]}"
        args = ["--crash-marker", str(marker)]
        if variant == "orchestrator":
            job = orchestrator.submit(self.spec(
                [PY, WORKER, *args], max_restarts=1, rendezvous={"backend": backend},
                restart_backoff={"initial": 0.1, "max": 0.1}))
            orchestrator.wait(job, timeout=120)
            lines = list(orchestrator.logs(job))
            crash = _crash_time(lines)
            attempts = Store().get_job(job).attempts
            if crash is not None and len(attempts) == 2:
                # The orchestrator's own part: crash -> every agent told to start attempt 2.
                self.overhead[backend].append(attempts[1].started_at - crash)
            return _recovery_from(lines)
        tag = uuid.uuid4().hex[:8]
        port = self.next_port()
        procs = [self.torchrun(i, backend, port, " ".join(args), tag, restarts=1)
                 for i in range(2)]
        lines = _collect(procs, CAP + 10, until=lambda text: _recovery_from(text.splitlines()))
        self.kill_tagged(tag)
        return _recovery_from(lines)

    def detect(self, variant: str) -> float | None:
        if variant == "orchestrator":
            job = orchestrator.submit(self.spec(
                [PY, SLEEPER], health={"heartbeat_interval": 0.5, "node_timeout": 2}))
            _wait(lambda: orchestrator.status(job)["state"] == "RUNNING", 60)
            time.sleep(1)
            self.c.link_down(1)
            cut = time.monotonic()
            try:
                _wait(lambda: orchestrator.status(job)["nodes"][1]["state"] == "LOST", CAP, 0.02)
                return time.monotonic() - cut
            finally:
                self.c.link_up(1)
                orchestrator.cancel(job)
        tag = uuid.uuid4().hex[:8]
        port = self.next_port()
        marker = self.dir / f"nocrash-{tag}"
        marker.write_text("")  # no crash: the group just runs (and is cut)
        procs = [self.torchrun(i, "c10d", port, f"--crash-marker {marker}", tag, nnodes="1:2",
                               restarts=3) for i in range(2)]
        lines = _collect(procs, 30, until=lambda text: text.count("READY") >= 4)
        self.c.link_down(1)
        cut = time.time()
        try:
            more = _collect(procs[:1], CAP, until=lambda text: "READY" in text)
        finally:
            self.c.link_up(1)
            self.kill_tagged(tag)
            for p in procs:
                p.kill()
        again = [float(m.group(1)) for ln in more if (m := re.search(r"READY \d \d+ ([\d.]+)", ln))]
        del lines
        return (min(again) - cut) if again else None


def _collect(procs, timeout: float, until) -> list[str]:
    """Read the processes' output until ``until(text)`` is truthy, they end, or timeout."""
    import selectors

    sel = selectors.DefaultSelector()
    for p in procs:
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ)
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sel.get_map():
        for key, _ in sel.select(timeout=0.2):
            chunk = key.fileobj.read()
            if not chunk:
                sel.unregister(key.fileobj)
            else:
                text += chunk
        if until(text):
            break
    return text.splitlines()


def _crash_time(lines: list[str]) -> float | None:
    crash = [float(m.group(1)) for ln in lines if (m := re.search(r"CRASH ([\d.]+)", ln))]
    return crash[0] if crash else None


def _recovery_from(lines: list[str]) -> float | None:
    crash = _crash_time(lines)
    ready = {}
    for ln in lines:
        m = re.search(r"READY 1 (\d+) ([\d.]+)", ln)
        if m:
            ready[int(m.group(1))] = float(m.group(2))
    if crash is None or len(ready) < 4:
        return None
    return max(ready.values()) - crash


def _wait(predicate, timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(interval)


def _fmt(values: list[float | None]) -> str:
    if not values:
        return "not measured"
    done = [v for v in values if v is not None]
    if len(done) < len(values):
        return f"not recovered within {CAP:.0f} s in {len(values) - len(done)}/{len(values)} runs"
    return f"{statistics.median(done):.2f} s"


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if len(done) == len(values) and done else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", default="launch,recovery,detect")
    p.add_argument("--no-baselines", action="store_true",
                   help="recovery and detect: measure the orchestrator only (fast)")
    args = p.parse_args()
    only = set(args.only.split(","))
    cl = load_cluster_module()
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        work = Path(tmp) / "work"
        work.mkdir()
        with cl.Cluster(2, Path(tmp) / "cluster") as cluster:
            bench = Bench(cluster, work)
            if "launch" in only:
                runs: dict[str, list] = {"orchestrator": [], "ssh+torchrun": [], "ssh+python": []}
                for _ in range(args.reps):  # interleaved, so drift hits every variant alike
                    for variant in runs:
                        runs[variant].append(bench.launch(variant))
                base = statistics.median(runs["ssh+torchrun"])
                floor = statistics.median(runs["ssh+python"])
                ours = statistics.median(runs["orchestrator"])
                rows.append(("launch 2x2 all-reduce", f"{ours:.2f} s",
                             f"ssh+torchrun {base:.2f} s / floor ssh+python {floor:.2f} s",
                             f"{ours / base:.2f} / {ours / floor:.2f}"))
                print("launch runs:", {k: [round(x, 2) for x in v] for k, v in runs.items()},
                      flush=True)
            if "recovery" in only:
                for backend in ("static", "c10d"):
                    ours_runs, theirs_runs = [], []
                    for _ in range(args.reps):
                        ours_runs.append(bench.recovery("orchestrator", backend))
                        if not args.no_baselines:
                            theirs_runs.append(bench.recovery("torchrun", backend))
                    m_ours, m_theirs = _median(ours_runs), _median(theirs_runs)
                    ratio = f"{m_ours / m_theirs:.2f}" if m_ours and m_theirs else "-"
                    rows.append((f"crash -> all ranks running ({backend})", _fmt(ours_runs),
                                 f"torchrun {backend} {_fmt(theirs_runs)}", ratio))
                    rows.append((f"  of which crash -> restart sent ({backend})",
                                 _fmt(bench.overhead[backend]), "-", "-"))
                    print(f"recovery {backend}:", ours_runs, theirs_runs, flush=True)
            if "detect" in only:
                ours_runs = [bench.detect("orchestrator") for _ in range(args.reps)]
                theirs_runs = [] if args.no_baselines else [
                    bench.detect("torchrun") for _ in range(max(1, args.reps // 2))]
                rows.append(("link cut -> detected (node_timeout 2 s)", _fmt(ours_runs),
                             f"torchrun c10d: node 0 running again {_fmt(theirs_runs)}", "-"))
                print("detect:", ours_runs, theirs_runs, flush=True)
    print(f"\n| measurement (median of {args.reps}) | orchestrator | baseline | ratio |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
