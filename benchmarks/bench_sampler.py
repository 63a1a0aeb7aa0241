#!/usr/bin/env python3
"""Straggler sampler overhead: a training step loop with the agent's sampler vs without it.

    python benchmarks/bench_sampler.py [--reps 5] [--steps 300] [--json FILE]

Every worker the agent starts imports its sitecustomize shim, which samples the main thread's
stack (is it in a collective?) 10 times a second; see orchestrator/diagnosis.stragglers. This
measures what that costs a step: one process (a gloo world of one, so that every step really
enters all_reduce and the sampler walks real frames) runs --steps steps of a CPU matmul plus an
all_reduce, with the shim on its PYTHONPATH:

- off:     ORCHESTRATOR_SAMPLE_INTERVAL=0 (the shim is imported, the sampler not started)
- default: 0.1 s between samples (what jobs get)
- 10x:     0.01 s, to show the headroom

Reported: the median step time of each variant over --reps runs, interleaved, and its ratio
to `off`. The issue's budget is 1% of step time at the default rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents import source  # noqa: E402

SITECUSTOMIZE = source("agents.shims.sitecustomize")

LOOP = r"""
import os, socket, time
import torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
a, grad = torch.randn(384, 384), torch.ones(4096)
def step():
    for _ in range(8):
        a @ a
    dist.all_reduce(grad)
for _ in range(20):
    step()
t0 = time.perf_counter()
for _ in range(int(os.environ["STEPS"])):
    step()
print((time.perf_counter() - t0) / int(os.environ["STEPS"]))
dist.destroy_process_group()
"""

VARIANTS = {"off": "0", "default": "0.1", "10x": "0.01"}


def run(interval: str, steps: int, shim: str, samples_dir: str) -> float:
    env = dict(os.environ, PYTHONPATH=shim, RANK="0", ORCHESTRATOR_STACK_DIR=samples_dir,
               ORCHESTRATOR_SAMPLE_INTERVAL=interval, STEPS=str(steps), OMP_NUM_THREADS="1")
    env.pop("ORCHESTRATOR_SAMPLED", None)
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shim = os.path.join(tmp, "shim")
        os.mkdir(shim)
        Path(shim, "sitecustomize.py").write_text(SITECUSTOMIZE)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.reps):
            for name, interval in VARIANTS.items():
                times[name].append(run(interval, args.steps, shim, tmp))
        sampled = json.loads(Path(tmp, "waits-0.json").read_text())
    base = statistics.median(times["off"])
    report: dict[str, dict[str, Any]] = {name: {"median_step_s": statistics.median(t),
                     "ratio": statistics.median(t) / base, "runs": t}
              for name, t in times.items()}
    print(f"{'variant':<8} {'step (ms)':>10} {'ratio':>7}")
    for name, r in report.items():
        print(f"{name:<8} {r['median_step_s'] * 1000:>10.2f} {r['ratio']:>7.3f}")
    share = sampled["waiting"] / sampled["samples"]
    print(f"last sampler file: {sampled} (waiting share {share:.2f})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
