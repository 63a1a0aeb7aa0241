#!/usr/bin/env python3
"""Goodput under faults: the same training (tests/workers/goodput_train.py: 4 ranks, gloo, a
checkpoint every few steps) with one rank SIGKILLed every ``--fault-every`` seconds, run by
the orchestrator with cold restarts, the orchestrator with warm restarts (``restart: {warm:
true}``), and, as the anchor, torchrun ``--standalone --max-restarts`` on this machine, in
the same invocation, interleaved.

    python benchmarks/bench_goodput.py [--reps 3] [--steps 400] [--fault-every 10]

For each kill: the time until every rank trained again (its first step in the next attempt),
and the steps redone (the last step reached before the kill, less the step the next attempt
resumed at). Goodput: the steps' time at the fault-free pace over the wall time from the
first step to the last. Writes ``benchmarks/goodput.{md,json,png}``; medians of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import orchestrator  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "goodput_train.py")
PY = sys.executable
NPROC = 2  # per node; two local nodes: four ranks, as torchrun's --nproc-per-node 4
STEP_RE = re.compile(r"STEP (\d+) (\d+) (\d+) ([\d.]+)")


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    return {"STEPS": str(args.steps), "STEP_TIME": str(args.step_time),
            "CKPT_EVERY": str(args.ckpt_every)}


def run_orchestrator(work: Path, args: argparse.Namespace, warm: bool, *,
                     nodes: dict[str, object] | None = None, cut: Cut | None = None
                     ) -> tuple[list[str], list[float], float]:
    """One run; ``nodes``: the spec's nodes part (default: two local nodes); ``cut``: cut a
    participant's cable once instead of killing ranks on a schedule."""
    ckpt = work / f"ckpt-{uuid.uuid4().hex[:6]}"
    spec = work / f"goodput-{uuid.uuid4().hex[:6]}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "goodput", "nproc_per_node": NPROC, "command": [PY, WORKER, str(ckpt)],
        "workdir": str(work), "env": worker_env(args), "max_restarts": 1000,
        "stop_grace_period": 2, "restart_backoff": {"initial": 0.1, "max": 0.1},
        "restart": {"warm": warm},
        **(nodes or {"nodes": [{"host": "local"}, {"host": "local"}]})}))
    job = orchestrator.submit(spec)

    def pid_of(rank: int) -> int | None:
        shown = orchestrator.status(job)
        if shown["state"] != "RUNNING":
            return None
        return next((r["pid"] for r in shown["ranks"]
                     if r["rank"] == rank and r["state"] == "RUNNING"), None)

    def done() -> bool:
        return orchestrator.status(job)["state"] not in ("PENDING", "LAUNCHING", "RUNNING",
                                                         "RESTARTING")

    if cut is None:
        kills = _kill_on_schedule(args, pid_of, done,
                                  lambda: _steps_seen(orchestrator.logs(job)))
    else:
        kills = cut.once(job, done)
    ended = time.time()
    if not done():
        orchestrator.cancel(job)
    orchestrator.wait(job, timeout=600)
    return list(orchestrator.logs(job)), kills, ended


def run_torchrun(work: Path, args: argparse.Namespace
                 ) -> tuple[list[str], list[float], float]:
    ckpt = work / f"ckpt-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={2 * NPROC}",
         "--max-restarts=1000", WORKER, str(ckpt)],
        cwd=work, env={**os.environ, **worker_env(args)}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()

    def pid_of(rank: int) -> int | None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
                if parent != proc.pid:
                    continue
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if f"RANK={rank}".encode() in env:
                return int(entry)
        return None

    try:
        kills = _kill_on_schedule(args, pid_of, lambda: proc.poll() is not None,
                                  lambda: _steps_seen(lines))
        ended = time.time()
    finally:
        if proc.poll() is None:  # torchrun stops its workers (in groups of their own) on TERM
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                workers = [pid_of(r) for r in range(2 * NPROC)]
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in filter(None, workers):
                    os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    return lines, kills, ended


class Cut:
    """A participant's cable cut once, after the job trained ``after`` steps on every rank;
    plugged back in once every rank trained again (or after ``give_up``); then the training
    goes on to its end."""

    def __init__(self, cluster: object, after: int, give_up: float):
        self.cluster, self.after, self.give_up = cluster, after, give_up

    def once(self, job: str, done) -> list[float]:
        def steps(attempt: int) -> set[int]:
            return {int(m[2]) for m in map(STEP_RE.search, orchestrator.logs(job))
                    if m and int(m[1]) == attempt}

        while len(steps(0)) < 2 * NPROC or _steps_seen(orchestrator.logs(job)) < \
                self.after * 2 * NPROC:
            if done():
                return []
            time.sleep(0.1)
        shown = orchestrator.status(job)
        # Node rank 1's host: a participant that is not the master's.
        victim = next(n["node_index"] for n in shown["nodes"] if n["node_rank"] == 1)
        self.cluster.link_down(victim)  # type: ignore[attr-defined]
        at = time.time()
        try:
            deadline = time.monotonic() + self.give_up
            while len(steps(1)) < 2 * NPROC and time.monotonic() < deadline and not done():
                time.sleep(0.1)
        finally:
            self.cluster.link_up(victim)  # type: ignore[attr-defined]
        while not done():  # the rest of the training, for the run's goodput
            time.sleep(0.2)
        return [at]


def _steps_seen(lines) -> int:
    return sum(1 for ln in lines if "STEP " in ln)


def _kill_on_schedule(args, pid_of, done, steps_seen) -> list[float]:
    """SIGKILL rank 0, 1, 2, ... in turn, every ``fault_every`` seconds from the first step,
    but never before every rank trained a few steps again since the last kill (a launcher
    slower to recover than the schedule would otherwise never train again)."""
    while steps_seen() == 0 and not done():
        time.sleep(0.1)
    kills: list[float] = []
    next_kill, seen_then = time.monotonic() + args.fault_every, 0
    while not done():
        time.sleep(0.05)
        if time.monotonic() < next_kill:
            continue
        if steps_seen() < seen_then + 4 * 2 * NPROC:
            if time.monotonic() > next_kill + args.give_up:  # never trained again: stop it
                return kills
            time.sleep(0.2)
            continue
        pid = pid_of(len(kills) % (2 * NPROC))
        if pid is None:  # between attempts: try again shortly
            continue
        seen_then = steps_seen()
        try:
            os.kill(pid, signal.SIGKILL)  # a worker of the job this benchmark started
        except OSError:
            continue
        kills.append(time.time())
        next_kill = time.monotonic() + args.fault_every
    return kills


def analyse(lines: list[str], kills: list[float], ended: float, steps: int
            ) -> dict[str, object]:
    rows = [(int(a), int(r), int(s), float(t)) for m in map(STEP_RE.search, lines) if m
            for a, r, s, t in [m.groups()]]
    first, last = min(t for *_, t in rows), max(t for *_, t in rows)
    advanced = max(s for *_, s, _ in rows) + 1
    # The fault-free pace: rank 0's consecutive steps within one attempt.
    by = sorted((a, s, t) for a, r, s, t in rows if r == 0)
    pace = statistics.median(t2 - t1 for (a1, s1, t1), (a2, s2, t2) in zip(by, by[1:], strict=False)
                             if a1 == a2 and s2 == s1 + 1)
    recover, redone = [], []
    for i, _kill in enumerate(kills):
        before = [s for a, r, s, t in rows if a == i]
        after = [(r, s, t) for a, r, s, t in rows if a == i + 1]
        if not after or not before:
            continue
        firsts = {}
        for r, _s, t in after:
            firsts[r] = min(firsts.get(r, t), t)
        if len(firsts) == 2 * NPROC:
            recover.append(max(firsts.values()) - kills[i])
        redone.append(max(before) + 1 - min(s for _, s, _ in after))
    # Until the last step, or until it was stopped after a kill it never recovered from.
    wall = (last if advanced == steps else ended) - first
    return {"goodput": advanced * pace / wall, "pace": pace, "wall": wall,
            "kills": len(kills), "recover": recover, "redone": redone,
            "completed": advanced == steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--fault-every", type=float, default=10.0)
    p.add_argument("--give-up", type=float, default=60.0,
                   help="seconds after a kill without a new step: the run is stopped")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "goodput"))
    p.add_argument("--replot", action="store_true", help="only redraw <out>.png from <out>.json")
    p.add_argument("--cluster", action="store_true",
                   help="over SSH on a 3-host namespace cluster (root): kills and a node cut")
    args = p.parse_args()
    if args.cluster:
        return main_cluster(args)
    if args.replot:
        plot(json.loads(Path(args.out + ".json").read_text())["summary"], args.out)
        return 0
    variants = ("orchestrator cold", "orchestrator warm", "torchrun")
    results: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        work = Path(tmp) / "work"
        work.mkdir()
        for rep in range(args.reps):  # interleaved, so drift hits every variant alike
            for variant in variants:
                if variant == "torchrun":
                    lines, kills, ended = run_torchrun(work, args)
                else:
                    lines, kills, ended = run_orchestrator(work, args,
                                                           warm=variant.endswith("warm"))
                result = analyse(lines, kills, ended, args.steps)
                results[variant].append(result)
                print(f"rep {rep} {variant}: goodput {result['goodput']:.3f}, recover "
                      f"{[round(x, 2) for x in result['recover']]}, redone {result['redone']}",
                      flush=True)
    report(results, args)
    return 0


NODE_TIMEOUT = 2.0  # the cluster runs' health.node_timeout (heartbeat_interval 0.5)


def main_cluster(args: argparse.Namespace) -> int:
    """The same training over SSH on the namespace cluster: kills every ``fault_every`` s on
    two hosts, cold and warm; and one cable cut with a third host as the spare, cold and
    warm. No torchrun anchor here: its multi-node restarts never recover (bench_cluster.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cluster import load_cluster_module

    local_cluster = load_cluster_module()
    local_cluster.cleanup_stale()
    variants = ("ssh cold", "ssh warm", "ssh cold + spare, node cut",
                "ssh warm + spare, node cut")
    results: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, \
            local_cluster.Cluster(3, Path(tmp) / "cluster") as cluster:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        work = Path(tmp) / "work"
        work.mkdir()
        for rep in range(args.reps):
            for variant in variants:
                spare = "spare" in variant
                nodes = {
                    "nodes": [{"host": f"root@{h.address}"}
                              for h in cluster.hosts[:3 if spare else 2]],
                    "nnodes": 2, "python": PY,
                    "ssh": {"identity_file": str(cluster.client_key),
                            "known_hosts": str(cluster.known_hosts), "connect_timeout": 2},
                    "health": {"heartbeat_interval": 0.5, "node_timeout": NODE_TIMEOUT}}
                cut = Cut(cluster, after=40, give_up=args.give_up) if spare else None
                lines, kills, ended = run_orchestrator(work, args, "warm" in variant,
                                                       nodes=nodes, cut=cut)
                result = analyse(lines, kills, ended, args.steps)
                results[variant].append(result)
                print(f"rep {rep} {variant}: goodput {result['goodput']:.3f}, recover "
                      f"{[round(x, 2) for x in result['recover']]}, redone {result['redone']}",
                      flush=True)
    summary = {v: {"goodput": _median([r["goodput"] for r in runs]),  # type: ignore[misc]
                   "recover_all_s": [x for r in runs for x in r["recover"]],  # type: ignore[attr-defined]
                   "kills": sum(r["kills"] for r in runs)}  # type: ignore[misc]
               for v, runs in results.items()}
    for s in summary.values():
        s["recover_median_s"] = _median(s["recover_all_s"])  # type: ignore[arg-type]
    lines = [
        f"Over SSH on the namespace cluster (2 hosts x {NPROC} ranks, gloo; a third host as "
        f"the spare where named), {args.steps} steps of {args.step_time:g} s + an all-reduce, "
        f"a checkpoint every {args.ckpt_every} steps; kills: a rank SIGKILLed every "
        f"{args.fault_every:g} s; node cut: node rank 1's cable cut once (`node_timeout` "
        f"{NODE_TIMEOUT:g} s); medians of {args.reps} runs "
        "(`sudo python benchmarks/bench_goodput.py --cluster`).", "",
        "| variant | goodput | fault -> all ranks training again (median) | x cold | faults "
        "recovered |", "| --- | --- | --- | --- | --- |"]
    for v, s in summary.items():
        cold = summary[v.replace("warm", "cold")]["recover_median_s"]
        lines.append(f"| {v} | {s['goodput']:.3f} | {s['recover_median_s']:.2f} s | "
                     f"{s['recover_median_s'] / cold:.2f} | "
                     f"{len(s['recover_all_s'])}/{s['kills']} |")  # type: ignore[arg-type]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = args.out + "-ssh"
    Path(out + ".md").write_text(text)
    Path(out + ".json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                               "runs": results}, indent=1))
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, list[dict[str, object]]], args: argparse.Namespace) -> None:
    summary = {}
    for variant, runs in results.items():
        recover = [x for r in runs for x in r["recover"]]  # type: ignore[attr-defined]
        redone = [x for r in runs for x in r["redone"]]  # type: ignore[attr-defined]
        summary[variant] = {
            "goodput": _median([r["goodput"] for r in runs]),  # type: ignore[misc]
            "recover_median_s": _median(recover), "recover_all_s": recover,
            "redone_median": _median(redone), "kills": sum(r["kills"] for r in runs),  # type: ignore[misc]
            "recovered": f"{len(recover)}/{sum(r['kills'] for r in runs)}",  # type: ignore[misc]
            "completed": f"{sum(bool(r['completed']) for r in runs)}/{len(runs)}"}
    anchor = summary["torchrun"]
    lines = [
        f"Goodput under faults: 4 ranks (gloo) on this machine, {args.steps} steps of "
        f"{args.step_time:g} s compute + an all-reduce, a checkpoint every {args.ckpt_every} "
        f"steps, one rank SIGKILLed every {args.fault_every:g} s; medians of {args.reps} runs "
        "per variant (`python benchmarks/bench_goodput.py`).", "",
        "| variant | goodput | x torchrun | kill -> all ranks training again (median) "
        "| x cold | kills recovered | runs completed | steps redone per kill |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    cold = summary["orchestrator cold"]["recover_median_s"]
    for variant, s in summary.items():
        lines.append(f"| {variant} | {s['goodput']:.3f} | {s['goodput'] / anchor['goodput']:.2f} "
                     f"| {s['recover_median_s']:.2f} s | {s['recover_median_s'] / cold:.2f} "
                     f"| {s['recovered']} | {s['completed']} | {s['redone_median']:g} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                    "runs": results}, indent=1))
    plot(summary, args.out)


def plot(summary: dict[str, dict[str, object]], out: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = list(summary)
    a.bar(names, [summary[n]["goodput"] for n in names], color=["#999", "#2a7", "#c63"])
    a.set_ylabel("goodput")
    a.set_ylim(0, 1)
    b.boxplot([summary[n]["recover_all_s"] or [float("nan")] for n in names])
    b.set_xticks(range(1, len(names) + 1), names)
    b.set_ylabel("kill -> all ranks training (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
