#!/usr/bin/env python3
"""Endurance, the real soak: a 2 x 2 gloo job over SSH on the namespace cluster for
``--minutes`` (30) with everything a week throws at the submit host, compressed:

- a rank SIGKILLed every ``--kill-every`` seconds (60): each costs one restart, charged;
- the home's disk (``$ORCHESTRATOR_HOME`` on a tmpfs) filled to its last byte for 60 s,
  twice (at 7 and 19 minutes of a 30-minute run): the job must pause, not stop;
- the controller SIGSTOPped for 20 s once (at 12 minutes): nobody may be declared lost;
- an exception injected into the controller once (``ORCHESTRATOR_FAILPOINTS=turn@240x1``: 4
  minutes into the first controller): it is replaced, nothing is charged;
- ``status`` polled every 2 s all along (its latency, and that it never fails).

The training is tests/workers/goodput_train.py (an all-reduce and STEP_TIME of pretend work
a step, a checkpoint every CKPT_EVERY steps, a resume from it), printing ``STEP <restarts>
<rank> <step> <time>`` per step. Every line is counted: in each attempt every rank's steps
must run without a gap or a repeat from the step all ranks resumed at, and the last attempt
to the last step. Targets: restarts charged == ranks killed (none for the disk, the stall or
the exception), no free restart, no node UNREACHABLE or LOST, no line missing.

    python benchmarks/bench_soak.py [--minutes 30] [--kill-every 60]   (as root: it mounts a tmpfs)

Writes ``benchmarks/soak.{md,json}`` (``--name`` to change it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_cluster import load_cluster_module  # noqa: E402

import orchestrator  # noqa: E402
from orchestrator.store import Store  # noqa: E402
from tests.integration.test_endurance import fill  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "goodput_train.py")
STEP_RE = re.compile(r"^STEP (\d+) (\d+) (\d+) ")


class Poller(threading.Thread):
    """``status`` every 2 s: latency, failures, and what it said of pauses and nodes."""

    def __init__(self, job_id: str):
        super().__init__(daemon=True)
        self.job_id = job_id
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.paused_seen = 0
        self.rss: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            try:
                s = orchestrator.status(self.job_id)
                self.latencies.append(time.monotonic() - started)
                self.paused_seen += bool(s["paused"])
                pid = s["controller"]["pid"]
                with contextlib.suppress(OSError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            self.rss.append(int(line.split()[1]) / 1024)
            except Exception as exc:  # noqa: BLE001 (counted: a reader must never fail)
                self.errors.append(repr(exc)[:200])
            self.done.wait(2.0)


def count_lines(job_id: str, attempts: int, ranks: int, steps: int) -> dict[str, object]:
    """Every attempt's steps per rank: contiguous, no repeat, one start for all ranks."""
    store = Store()
    problems: list[str] = []
    total = 0
    for attempt in range(1, attempts + 1):
        starts = set()
        for rank in range(ranks):
            path = store.log_dir(job_id, attempt) / f"rank-{rank}.log"
            got = [int(m.group(3)) for ln in (path.read_text().splitlines()
                                              if path.exists() else [])
                   if (m := STEP_RE.match(ln))]
            total += len(got)
            if not got:
                continue
            starts.add(got[0])
            if got != list(range(got[0], got[0] + len(got))):
                gaps = [b for a, b in zip(got, got[1:], strict=False) if b != a + 1][:5]
                problems.append(f"attempt {attempt} rank {rank}: not contiguous near {gaps}")
            if attempt == attempts and got[-1] != steps - 1:
                problems.append(f"attempt {attempt} rank {rank}: ends at {got[-1]}")
        if len(starts) > 1:
            problems.append(f"attempt {attempt}: ranks resumed at {sorted(starts)}")
    return {"lines": total, "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--name", default="soak")
    args = parser.parse_args()
    local_cluster = load_cluster_module()
    local_cluster.cleanup_stale()
    span = args.minutes * 60
    steps = int(span / (args.step_time + 0.01))  # the steps' own time, roughly
    events = {"disk_full": [0.23 * span, 0.63 * span], "sigstop": 0.4 * span}
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp, \
            local_cluster.Cluster(2, Path(tmp) / "cluster") as cluster:
        home = Path(tmp) / "home"
        home.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs",
                        str(home)], check=True)
        try:
            os.environ["ORCHESTRATOR_HOME"] = str(home)
            os.environ["ORCHESTRATOR_FAILPOINTS"] = "turn@240x1"
            work = Path(tmp) / "work"
            work.mkdir()
            spec = work / "soak.yaml"
            spec.write_text(yaml.safe_dump({
                "name": "soak", "nproc_per_node": 2, "python": sys.executable,
                "nodes": [{"host": f"root@{h.address}"} for h in cluster.hosts],
                "ssh": {"identity_file": str(cluster.client_key),
                        "known_hosts": str(cluster.known_hosts)},
                "command": [sys.executable, WORKER, str(work / "ckpt")],
                "workdir": str(work), "max_restarts": 10_000, "stop_grace_period": 2,
                "restart_backoff": {"initial": 0.1, "max": 0.1},
                "logs": {"min_free_bytes": 8 << 20},
                "env": {"STEPS": str(steps), "STEP_TIME": str(args.step_time),
                        "CKPT_EVERY": "20"}}))
            started = time.monotonic()
            job_id = orchestrator.submit(spec)
            poller = Poller(job_id)
            poller.start()
            kills, next_kill, log = 0, args.kill_every, []
            disk_at, stop_at = list(events["disk_full"]), events["sigstop"]
            while True:
                now = time.monotonic() - started
                s = orchestrator.status(job_id)
                if s["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                if now >= next_kill and s["state"] == "RUNNING" and not s["paused"]:
                    live = [r for r in s["ranks"] if r["pid"] and r["state"] == "RUNNING"]
                    if live:
                        victim = rng.choice(live)
                        with contextlib.suppress(OSError):
                            os.kill(victim["pid"], signal.SIGKILL)
                            kills += 1
                            log.append(f"{now:.0f}s kill rank {victim['rank']}")
                    next_kill = now + args.kill_every
                if disk_at and now >= disk_at[0]:
                    disk_at.pop(0)
                    filler = fill(home)
                    log.append(f"{now:.0f}s disk full")
                    time.sleep(60)
                    filler.unlink()
                    log.append(f"{time.monotonic() - started:.0f}s disk free")
                    next_kill = max(next_kill, time.monotonic() - started + 10)
                if stop_at is not None and now >= stop_at:
                    stop_at = None
                    pid = s["controller"]["pid"]
                    os.kill(pid, signal.SIGSTOP)
                    log.append(f"{now:.0f}s controller stopped")
                    time.sleep(20)
                    os.kill(pid, signal.SIGCONT)
                    log.append(f"{time.monotonic() - started:.0f}s controller continued")
                time.sleep(1.0)
            poller.done.set()
            poller.join()
            result = orchestrator.status(job_id)
            wall = time.monotonic() - started
            lines = count_lines(job_id, result["attempt"], 4, steps)
            controller_log = (Store().job_dir(job_id) / "controller.log").read_text()
        finally:
            subprocess.run(["umount", "-l", str(home)], check=False)
    alarms = [(n["node_index"], state) for n in result["nodes"]
              for state in ("UNREACHABLE", "LOST") for _ in range(n["entered"].get(state, 0))]
    lat = sorted(poller.latencies)
    summary = {
        "minutes": args.minutes, "wall_s": round(wall), "state": result["state"],
        "steps": steps, "kills": kills, "restarts": result["restarts"],
        "free_restarts": result["free_restarts"], "attempts": result["attempt"],
        "unreachable_or_lost": len(alarms), "lines": lines["lines"],
        "line_problems": lines["problems"],
        "status_polls": len(lat), "status_errors": poller.errors[:10],
        "status_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "status_p95_ms": round(1000 * lat[int(0.95 * (len(lat) - 1))], 1) if lat else None,
        "paused_seen": poller.paused_seen,
        "controller_rss_mib": [round(min(poller.rss), 1), round(max(poller.rss), 1)]
        if poller.rss else None,
        "controller_crashes": controller_log.count("InjectedFault: failpoint turn"),
        "pauses": controller_log.count("the home can be written again"),
        "stalls_forgiven": controller_log.count("the controller was stalled for"),
        "events": log,
    }
    print(json.dumps(summary, indent=1))
    ok = (summary["state"] == "SUCCEEDED" and summary["restarts"] == kills
          and not summary["free_restarts"] and not alarms and not lines["problems"]
          and not poller.errors)
    text = "\n".join([
        f"Soak on the namespace cluster (2 hosts x 2 ranks, gloo, over SSH), "
        f"{args.minutes:g} minutes: a rank SIGKILLed every {args.kill_every:g} s, the home's "
        "disk full for 60 s twice, the controller SIGSTOPped for 20 s once and hit by an "
        "injected exception once, `status` polled every 2 s "
        "(as root: `python benchmarks/bench_soak.py`).", "",
        "| measurement | result | target |", "| --- | --- | --- |",
        f"| job | {summary['state']}, {summary['attempts']} attempts | SUCCEEDED |",
        f"| restarts charged / ranks killed | {summary['restarts']} / {kills} | equal |",
        f"| free restarts (not charged) | {summary['free_restarts']} | 0 |",
        f"| nodes UNREACHABLE or LOST | {len(alarms)} | 0 |",
        f"| lines checked (every step of every rank of every attempt) | {lines['lines']:,}, "
        f"{len(lines['problems'])} missing or repeated | 0 missing |",
        f"| pauses (disk full) / controller crashes / stalls forgiven | {summary['pauses']} / "
        f"{summary['controller_crashes']} / {summary['stalls_forgiven']} | 2 / 1 / 1 |",
        f"| status polls, failed | {len(lat)}, {len(poller.errors)} | 0 failed |",
        f"| status p50 / p95 | {summary['status_p50_ms']} / {summary['status_p95_ms']} ms | |",
        f"| controller RSS min / max | {summary['controller_rss_mib']} MiB | bounded |",
        "", f"All targets met: {'yes' if ok else 'NO'}."]) + "\n"
    (ROOT / "benchmarks" / f"{args.name}.md").write_text(text)
    (ROOT / "benchmarks" / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
