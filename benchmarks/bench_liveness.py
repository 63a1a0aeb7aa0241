#!/usr/bin/env python3
"""Liveness under load: how long do healthy nodes go unheard when every core is busy?

A job of ``--nodes`` local nodes x ``--nproc`` workers that each keep a core busy
(tests/workers/spin.py), plus ``--hogs`` busy processes outside the job, runs for
``--minutes``; ``status`` is polled all along. Reports, per node, the longest it went
unheard by the controller (``nodes[].longest_silence_s``: the controller's own stalls are not
counted) and whether any node was declared UNREACHABLE or LOST. With ``--node-timeout`` the
job runs at that setting (default: the spec's default), so a run at the defaults answers
"would a healthy, starved node have been declared lost?".

    python benchmarks/bench_liveness.py [--nodes 16] [--nproc 8] [--minutes 3] [--hogs 0]
                                        [--node-timeout S] [--heartbeat-interval S]

Writes ``benchmarks/liveness.{md,json}`` (``--out`` to change the name).
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

HOG = "while True: pass"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--node-timeout", type=float)
    parser.add_argument("--heartbeat-interval", type=float)
    parser.add_argument("--out", default="liveness")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="liveness-"))
    os.environ["ORCHESTRATOR_HOME"] = str(work / "home")
    health = {k: v for k, v in (("node_timeout", args.node_timeout),
                                ("heartbeat_interval", args.heartbeat_interval)) if v}
    spec = work / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "liveness", "nodes": [{"host": "local"}] * args.nodes,
        "nproc_per_node": args.nproc, "command": [sys.executable,
                                                   str(ROOT / "tests/workers/spin.py")],
        "workdir": str(work), "env": {"SPIN_SECONDS": str(args.minutes * 60)},
        "launch_timeout": 600, "health": health}))
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    try:
        job_id = orchestrator.submit(spec)
        worst: dict[int, float] = {}
        polls: list[float] = []
        while True:
            started = time.monotonic()
            s = orchestrator.status(job_id)
            polls.append(time.monotonic() - started)
            for n in s["nodes"]:
                if n["longest_silence_s"] is not None:
                    worst[n["node_index"]] = max(worst.get(n["node_index"], 0.0),
                                                 n["longest_silence_s"])
            if s["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(2.0)
    finally:
        for hog in hogs:
            hog.kill()
    alarms = [{"node": n["node_index"], "state": state, "times": n["entered"][state]}
              for n in s["nodes"] for state in ("UNREACHABLE", "LOST")
              if n["entered"].get(state)]
    silences = sorted(worst.values())
    result = {
        "nodes": args.nodes, "nproc": args.nproc, "hogs": args.hogs, "cpus": os.cpu_count(),
        "minutes": args.minutes, "node_timeout": args.node_timeout or "default",
        "state": s["state"], "restarts": s["restarts"], "attempts": s["attempt"],
        "longest_silence_max_s": silences[-1] if silences else None,
        "longest_silence_median_s": statistics.median(silences) if silences else None,
        "status_p50_s": statistics.median(polls), "alarms": alarms,
    }
    print(json.dumps(result, indent=1))
    (ROOT / "benchmarks" / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
