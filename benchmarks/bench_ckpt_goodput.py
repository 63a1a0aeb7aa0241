#!/usr/bin/env python3
"""Goodput with a checkpoint every step: the same training (tests/workers/ckpt_goodput_train.py:
2 ranks, gloo, ``--state-mb`` of state per rank saved with ``orchestrator.checkpoint`` every
step) with one rank SIGKILLed every ``--fault-every`` seconds, run by the orchestrator (warm
restarts, saves in the agent's memory) and, as the anchor, by the common workaround: plain
``torchrun --standalone`` relaunched by a shell loop after each failure (``until torchrun
...; do :; done``), the same script saving to files on local disk, synced. Interleaved, in one
invocation.

    python benchmarks/bench_ckpt_goodput.py [--reps 1] [--state-mb 512] [--duration 180]
                                            [--step-time 0.5] [--fault-every 60] [--background]

With ``--background`` the script saves beside the training (``save(..., wait=False)``, waited
for before the state next changes) in both, and each with waiting saves is run as well; the
ratios are against torchrun's loop saving beside the training (writes
``benchmarks/ckpt-goodput-background.{md,json}``).

Each run trains for ``--duration`` seconds from its first step (then it is stopped). Goodput:
the steps' compute (steps advanced x ``--step-time``) over that time; what a save holds the
training, a restart's time and the steps redone are the losses. Per kill: the seconds until
every rank trained again, and the steps redone. Writes ``benchmarks/ckpt-goodput.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import orchestrator  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "ckpt_goodput_train.py")
PY = sys.executable
RANKS = 2
STEP_RE = re.compile(r"STEP \d+ (\d+) (\d+) ([\d.]+)")


def env_of(args: argparse.Namespace, background: bool | None = None) -> dict[str, str]:
    background = args.background if background is None else background
    return {"STEPS": "1000000", "STEP_TIME": str(args.step_time),
            "STATE_MB": str(args.state_mb), "CKPT_EVERY": "1",
            "CKPT_BACKGROUND": "1" if background else "0"}


def run_orchestrator(work: Path, args: argparse.Namespace, background: bool | None = None
                     ) -> tuple[list[str], list[float]]:
    spec = work / f"ckpt-goodput-{uuid.uuid4().hex[:6]}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "ckpt-goodput", "nodes": [{"host": "local"}], "nproc_per_node": RANKS,
        "command": [PY, WORKER], "workdir": str(work), "env": env_of(args, background),
        "max_restarts": 1000, "stop_grace_period": 2, "restart": {"warm": True},
        "restart_backoff": {"initial": 0.1, "max": 0.1}}))
    job = orchestrator.submit(str(spec))

    def pid_of(rank: int) -> int | None:
        shown = orchestrator.status(job)
        return next((r["pid"] for r in shown["ranks"] if shown["state"] == "RUNNING"
                     and r["rank"] == rank and r["state"] == "RUNNING"), None)

    def done() -> bool:
        return orchestrator.status(job)["state"] not in ("PENDING", "LAUNCHING", "RUNNING",
                                                         "RESTARTING")

    kills = kill_on_schedule(args, pid_of, done, lambda: list(orchestrator.logs(job)))
    orchestrator.cancel(job)
    orchestrator.wait(job, timeout=600)
    return list(orchestrator.logs(job)), kills


def run_torchrun_loop(work: Path, args: argparse.Namespace, background: bool | None = None
                      ) -> tuple[list[str], list[float]]:
    token = uuid.uuid4().hex
    ckpt = work / f"files-{token[:6]}"
    torchrun = " ".join([PY, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={RANKS}", WORKER])
    proc = subprocess.Popen(
        ["bash", "-c", f"until {torchrun}; do :; done"], cwd=work,
        env={**os.environ, **env_of(args, background), "ORCHESTRATOR_CHECKPOINT_DIR": str(ckpt),
             "BENCH_TOKEN": token},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()

    def pid_of(rank: int) -> int | None:  # a worker of this run: its token and its RANK
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"BENCH_TOKEN={token}".encode() in env and f"RANK={rank}".encode() in env:
                return int(entry)
        return None

    try:
        kills = kill_on_schedule(args, pid_of, lambda: proc.poll() is not None,
                                 lambda: list(lines))
    finally:
        workers = [pid_of(r) for r in range(RANKS)]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the loop and torchrun
        for pid in filter(None, workers):  # in process groups of their own (torchrun's)
            try:
                os.kill(pid, signal.SIGKILL)  # a worker of the run this benchmark started
            except OSError:
                pass
        proc.wait()
    reader.join(timeout=10)
    return lines, kills


def kill_on_schedule(args, pid_of, done, lines) -> list[float]:
    """SIGKILL rank 0, 1, 0, ... every ``fault_every`` s from the first step, each once every
    rank trained again since the last kill; until ``duration`` s after the first step."""
    while not _rows(lines()) and not done():
        time.sleep(0.1)
    kills: list[float] = []
    next_kill = time.monotonic() + args.fault_every
    end = time.monotonic() + args.duration
    while not done() and time.monotonic() < end:
        time.sleep(0.05)
        if time.monotonic() < next_kill:
            continue
        rows = _rows(lines())
        if kills and len({r for r, _, t in rows if t > kills[-1]}) < RANKS:
            continue  # not training again yet
        pid = pid_of(len(kills) % RANKS)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)  # a worker of the run this benchmark started
        except OSError:
            continue
        kills.append(time.time())
        next_kill = time.monotonic() + args.fault_every
    return kills


def _rows(lines: list[str]) -> list[tuple[int, int, float]]:
    return [(int(m[1]), int(m[2]), float(m[3])) for m in map(STEP_RE.search, lines) if m]


def analyse(lines: list[str], kills: list[float], args: argparse.Namespace) -> dict[str, Any]:
    first = min(t for *_, t in _rows(lines))
    rows = [(r, s, t) for r, s, t in _rows(lines) if t <= first + args.duration]
    advanced = max(s for _, s, _ in rows) + 1
    recover, redone = [], []
    for kill in kills:
        before = [s for _, s, t in rows if t <= kill]
        after = [(r, s, t) for r, s, t in rows if t > kill]
        firsts: dict[int, float] = {}
        for r, _, t in after:
            firsts[r] = min(firsts.get(r, t), t)
        if len(firsts) == RANKS and before:
            recover.append(max(firsts.values()) - kill)
            resumed = min(s for r, s, t in after if t == firsts[r])
            redone.append(max(before) + 1 - resumed)
    return {"goodput": advanced * args.step_time / args.duration, "steps": advanced,
            "kills": len(kills), "recover": recover, "redone": redone}


# Run by RANKS processes at once: the least a save every step holds the training here.
_COPY = """
import statistics, sys, time, torch
n, at = int(float(sys.argv[1]) * (1 << 20)) // 4, float(sys.argv[2])
src, dst = torch.ones(n), torch.zeros(n)
dst.copy_(src)  # its pages exist, as a reused slot's do
took = []
for i in range(7):
    time.sleep(max(0.0, at + i - time.time()))
    t = time.perf_counter()
    dst.copy_(src)
    took.append(time.perf_counter() - t)
print(statistics.median(took))
"""


def copy_floor(state_mb: float) -> float:
    """Seconds for every rank to copy its state at once (memory bandwidth is shared): what
    one save holds the training on this machine at the least, the physical floor."""
    at = time.time() + 5  # every process has imported torch and allocated by then
    procs = [subprocess.Popen([PY, "-c", _COPY, str(state_mb), str(at)], text=True,
                              stdout=subprocess.PIPE) for _ in range(RANKS)]
    return max(float(p.communicate()[0]) for p in procs)


def ceiling(step_time: float, fault_every: float, copy: float) -> float:
    """This job's goodput were a restart to take no time at all: each step holds the training
    for the copy, and each kill loses the step it came in, half of one on average."""
    step = step_time + copy
    return (1 - step / 2 / fault_every) * step_time / step


DEFAULT_OUT = str(ROOT / "benchmarks" / "ckpt-goodput")
NODE_TIMEOUT = 2.0  # the cut run's health.node_timeout (heartbeat_interval 0.5)
CUT_MEMORY = "5GiB"  # the cut and drain runs' checkpoint.memory per node (--memory)


def run_cut(args: argparse.Namespace) -> dict[str, Any]:
    """Over SSH on a 3-host namespace cluster (root): 2 participants x 2 ranks and a hot spare,
    a save every step; node rank 1's cable is cut once every rank trained ``cut_after``
    steps, and plugged back in once every rank trains again. Which copies the ranks resumed
    from is what the status said while the next attempt ran."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cluster import load_cluster_module

    local_cluster = load_cluster_module()
    local_cluster.cleanup_stale()
    with tempfile.TemporaryDirectory() as tmp, \
            local_cluster.Cluster(3, Path(tmp) / "cluster") as cluster:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        spec = Path(tmp) / "cut.yaml"
        spec.write_text(yaml.safe_dump({
            "name": "ckpt-cut", "nodes": [{"host": f"root@{h.address}"} for h in cluster.hosts],
            "nnodes": 2, "nproc_per_node": RANKS, "python": PY, "command": [PY, WORKER],
            "workdir": tmp, "env": env_of(args), "max_restarts": 10, "stop_grace_period": 2,
            "restart": {"warm": True}, "restart_backoff": {"initial": 0.1, "max": 0.1},
            # The three "nodes" share this machine's memory: each gets a share of it, not
            # the default half of /dev/shm (three halves are more than there is: a run whose
            # buddies held copies too ran it out of memory, and the kernel killed ranks).
            "checkpoint": {"memory": args.memory},
            "ssh": {"identity_file": str(cluster.client_key),
                    "known_hosts": str(cluster.known_hosts), "connect_timeout": 2},
            "health": {"heartbeat_interval": 0.5, "node_timeout": NODE_TIMEOUT}}))
        job = orchestrator.submit(str(spec))
        ranks = 2 * RANKS

        def rows() -> list[tuple[int, int, float]]:
            return _rows(list(orchestrator.logs(job)))

        _until_trained(job, lambda: len({r for r, s, _ in rows() if s >= args.cut_after})
                       >= ranks, f"trained {args.cut_after} steps on every rank")
        shown = orchestrator.status(job)
        victim = next(n["node_index"] for n in shown["nodes"] if n["node_rank"] == 1)
        cluster.link_down(victim)
        cut = time.time()
        # What each node held as the cable went (as last reported): how far the replicas of
        # the cut node's ranks (the spare's newest: the oldest rank's) were behind its saves.
        held_at_cut = {n["node_index"]: {k: (n.get("checkpoint") or {}).get(k)
                                         for k in ("newest_in_memory", "replicas",
                                                   "newest_elsewhere")}
                       for n in orchestrator.status(job)["nodes"]}
        sources: dict[str, int] = {}
        try:
            deadline = time.monotonic() + 120
            while len({r for r, _, t in rows() if t > cut}) < ranks and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            shown = orchestrator.status(job)
            for node in shown["nodes"]:
                for record in ((node.get("checkpoint") or {}).get("restored") or {}).values():
                    sources[record["source"]] = sources.get(record["source"], 0) + 1
        finally:
            cluster.link_up(victim)
        orchestrator.cancel(job)
        orchestrator.wait(job, timeout=120)
        lines = list(orchestrator.logs(job))  # read once: the rows, phases and holds below
        got = _rows(lines)
        log = Path(tmp) / "home" / "jobs" / job / "controller.log"
        resumed = [ln.split(" INFO ", 1)[-1] for ln in log.read_text().splitlines()
                   if "resumes checkpoint step" in ln]
        _keep_home(args, tmp)
        # Where the time went: when the cut was known, and when the next attempt's slowest
        # rank started, joined its world, allocated its state and loaded it.
        starts: dict[str, float] = {}
        for m in filter(None, map(PHASE_RE.search, lines)):
            starts[m[2]] = max(starts.get(m[2], 0.0), float(m[3]))
        failure = shown["attempts"][0]["failure"] or {}
        detected = failure.get("detected_at")
        # What the next attempt's first save held each rank (its first step's line waits
        # for it).
        holds: dict[int, float] = {}
        for m in filter(None, map(SAVED_RE.search, lines)):
            if m[1] == "1" and int(m[2]) not in holds:
                holds[int(m[2])] = float(m[4])
        before = [s for _, s, t in got if t <= cut]
        firsts: dict[int, tuple[float, int]] = {}
        for r, s, t in got:
            if t > cut and (r not in firsts or t < firsts[r][0]):
                firsts[r] = (t, s)
        again = round(max(t for t, _ in firsts.values()) - cut, 2) \
            if len(firsts) == ranks else None
        return {"recover_s": again, "node_timeout": NODE_TIMEOUT, "sources": sources,
                "held_at_cut": held_at_cut, "victim": victim, "last_step": max(before),
                "resumed": resumed,
                "first_save_held_s": holds,
                "detected_s": None if detected is None else round(detected - cut, 2),
                "restart_phases": {k: round(v - cut, 2) for k, v in starts.items()},
                "timeline": [t for t in shown.get("timeline") or [] if t.get("attempt") == 2],
                "redone": max(before) + 1 - min(s for _, s in firsts.values())
                if firsts else None, "attempt": shown["attempt"]}


ATTEMPT_RE = re.compile(r"STEP (\d+) (\d+) (\d+) ([\d.]+)")
SAVED_RE = re.compile(r"SAVED (\d+) (\d+) (\d+) ([\d.]+)")
PHASE_RE = re.compile(r"PHASE 1 (\d+) (\w+) ([\d.]+)")


def run_drain(args: argparse.Namespace) -> dict[str, Any]:
    """3 local nodes x 2 ranks, nnodes 2 (the third a hot spare), a save every
    ``--ckpt-every`` steps; node rank 1 drained once every rank trained 20 steps. The pause:
    from the ranks' last step before the move to every rank training again."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        spec = Path(tmp) / "drain.yaml"
        spec.write_text(yaml.safe_dump({
            "name": "ckpt-drain", "nodes": [{"host": "local"}] * 3, "nnodes": 2,
            "nproc_per_node": RANKS, "command": [PY, WORKER], "workdir": tmp,
            "env": {**env_of(args), "CKPT_EVERY": str(args.ckpt_every)}, "max_restarts": 0,
            "stop_grace_period": 2, "restart": {"warm": True},
            # The three nodes share this machine: half of /dev/shm each (the default) is
            # more memory than it has.
            "checkpoint": {"memory": args.memory}}))
        job = orchestrator.submit(str(spec))

        def rows() -> list[tuple[int, int, int, float]]:
            return [(int(m[1]), int(m[2]), int(m[3]), float(m[4]))
                    for m in map(ATTEMPT_RE.search, orchestrator.logs(job)) if m]

        _until_trained(job, lambda: len({r for _, r, s, _ in rows() if s >= 20})
                       >= 2 * RANKS, "trained 20 steps on every rank")
        leaving = next(n["node_index"] for n in orchestrator.status(job)["nodes"]
                       if n["node_rank"] == 1)
        drained = time.time()
        orchestrator.drain_node(str(leaving), job=job, reason="benchmark")
        deadline = time.monotonic() + 180
        while len({r for a, r, _, _ in rows() if a == 1}) < 2 * RANKS and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        shown = orchestrator.status(job)
        # Then the first save of the next attempt after a step of its own: the pause ends at
        # its first step, and a save after it can cost what the pause did not show.
        if len({r for a, r, _, _ in rows() if a == 1}) == 2 * RANKS:
            first = min(s for a, _, s, _ in rows() if a == 1)
            later = (first // args.ckpt_every + 1) * args.ckpt_every
            while len({r for a, r, s, _ in rows() if a == 1 and s >= later}) < 2 * RANKS \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
        orchestrator.cancel(job)
        got = rows()
        # What each rank's saves held its training (attempt, rank, step -> seconds).
        holds = {(int(m[1]), int(m[2]), int(m[3])): float(m[4])
                 for m in map(SAVED_RE.search, orchestrator.logs(job)) if m}
        # When the next attempt's slowest rank started, loaded and joined its world.
        starts: dict[str, float] = {}
        for m in filter(None, map(PHASE_RE.search, orchestrator.logs(job))):
            starts[m[2]] = max(starts.get(m[2], 0.0), float(m[3]))
        log = Path(tmp) / "home" / "jobs" / job / "controller.log"
        # The agreed step, every rank's save in memory, then everywhere it must be.
        phases = [ln.split(": ", 1)[-1] for ln in log.read_text().splitlines()
                  if "after the move began" in ln or "agreed step" in ln]
        _keep_home(args, tmp)
    before = [(s, t) for a, _, s, t in got if a == 0]
    after: dict[int, tuple[float, int]] = {}
    for a, r, s, t in got:
        if a == 1 and (r not in after or t < after[r][0]):
            after[r] = (t, s)
    stopped = max(t for _, t in before)
    failure = shown["attempts"][0]["failure"] or {}
    # The pause spans two steps done, the held one (a save) and the first after it (a save
    # or not, by its number): what they take as training goes (rank 0's medians, the first
    # save's fresh pages left out) is not what the move cost; the rest is.
    ticks = sorted((s, t) for a, r, s, t in got if a == 0 and r == 0)
    took = {s: t - t0 for (s0, t0), (s, t) in zip(ticks, ticks[1:], strict=False) if s == s0 + 1}
    saving = statistics.median(t for s, t in took.items() if s % args.ckpt_every == 0
                               and s > args.ckpt_every)
    plain = statistics.median(t for s, t in took.items() if s % args.ckpt_every)
    first = min((s for _, s in after.values()), default=0)
    steps_s = saving + (plain if first % args.ckpt_every else saving)
    pause = max(t for t, _ in after.values()) - stopped if len(after) == 2 * RANKS else None
    # The next attempt's first save after a step it trained (every rank's line of that step
    # after every rank's line of the step before).
    resumed = sorted((s, t) for a, _, s, t in got if a == 1)
    later = (first // args.ckpt_every + 1) * args.ckpt_every
    ends = [t for s, t in resumed if s == later]
    begins = [t for s, t in resumed if s == later - 1]
    first_save = max(ends) - max(begins) if len(ends) == len(begins) == 2 * RANKS else None
    return {"drain_to_stop_s": round(stopped - drained, 2),
            "pause_s": None if pause is None else round(pause, 2),
            "step_s": round(plain, 2), "save_step_s": round(saving, 2),
            "lost_s": None if pause is None else round(pause - steps_s, 2),
            "first_save_s": None if first_save is None else round(first_save, 2),
            # That save, what it held each rank (ranks 2 and 3 now on the spare).
            "first_save_held_s": {r: h for (a, r, s), h in sorted(holds.items())
                                  if a == 1 and s == later},
            # Every save's longest hold over the ranks: "attempt/step" -> seconds.
            "save_held_s": {f"{a}/{s}": max(h for (a2, _, s2), h in holds.items()
                                              if (a2, s2) == (a, s))
                            for a, s in sorted({(a, s) for a, _, s in holds})},
            "restart_phases": {k: round(v - stopped, 2) for k, v in starts.items()},
            # The held step's line is never printed (its rank is stopped while it waits
            # there): the last printed is one before it, hence the max with 0.
            "redone": max(0, max(s for s, _ in before) + 1 - min(s for _, s in after.values()))
            if after else None,
            "restarts": shown["restarts"], "cause": failure.get("cause"),
            "message": failure.get("message"), "phases": phases,
            "timeline": [t for t in shown.get("timeline") or [] if t.get("attempt") in (1, 2)]}


def _write(args: argparse.Namespace, suffix: str, text: str, result: dict[str, Any]) -> None:
    print(text)
    Path(args.out + suffix + ".md").write_text(text)
    Path(args.out + suffix + ".json").write_text(json.dumps({"args": vars(args), **result},
                                                           indent=1))


def _keep_home(args: argparse.Namespace, tmp: str) -> None:
    """The job's home (the controller's log, every rank's) copied to ``--keep-home``."""
    if args.keep_home:
        shutil.copytree(Path(tmp) / "home", args.keep_home, dirs_exist_ok=True)


def _until_trained(job: str, reached: Any, what: str) -> None:
    """Wait until ``reached()``; give up on a job that ended or after 600 s."""
    started = time.monotonic()
    while not reached():
        if time.monotonic() > started + 600 or orchestrator.status(job)["state"] in (
                "FAILED", "CANCELLED", "SUCCEEDED"):
            orchestrator.cancel(job)
            raise SystemExit(f"{job} never {what}: {orchestrator.status(job)['failure']}")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--state-mb", type=float, default=512)
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--step-time", type=float, default=0.5)
    p.add_argument("--fault-every", type=float, default=60.0)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--cut", action="store_true",
                   help="instead: a node's cable cut once over SSH with a spare (root)")
    p.add_argument("--cut-after", type=int, default=10)
    p.add_argument("--drain", action="store_true",
                   help="instead: a participant drained once, with a hot spare (local)")
    p.add_argument("--ckpt-every", type=int, default=1)
    p.add_argument("--background", action="store_true",
                   help="saves beside the training (wait=False) in both, and their "
                        "waiting saves as two more variants")
    p.add_argument("--keep-home", help="--drain, --cut: copy the job's home (its logs) here")
    p.add_argument("--memory", default=CUT_MEMORY,
                   help="checkpoint.memory per node of --cut and --drain (they share the machine)")
    args = p.parse_args()
    if args.drain:
        runs = [run_drain(args) for _ in range(args.reps)]
        result = {**runs[-1], "runs": runs}
        pauses = [r["pause_s"] for r in runs if r["pause_s"] is not None]
        losses = [r["lost_s"] for r in runs if r["lost_s"] is not None]
        firsts = [r["first_save_s"] for r in runs if r["first_save_s"] is not None] or [0.0]
        text = (f"`orchestrator drain` of a participant, local: 2 nodes x {RANKS} ranks and a "
                f"hot spare, {args.state_mb:g} MiB of state per rank, steps of "
                f"{args.step_time:g} s, a save every {args.ckpt_every} step(s) and the one "
                f"the move asks for, `checkpoint.memory` {args.memory} per node (`python "
                f"benchmarks/bench_ckpt_goodput.py --drain`).\n\n"
                f"- drain -> the ranks' last step before the move: {result['drain_to_stop_s']} s\n"
                f"- pause (that step -> every rank training again on the spare): "
                f"{result['pause_s']} s, of which two steps of training (as training goes: "
                f"{result['step_s']} s a step, {result['save_step_s']} s one that saves): "
                f"lost {result['lost_s']} s\n"
                f"- the next attempt's first save after a step of its own (a step that saves, as "
                f"training goes: {result['save_step_s']} s): {result['first_save_s']} s (each "
                f"rank held, s: {result['first_save_held_s']})\n"
                f"- the next attempt's slowest rank, seconds after that step: " + ", ".join(
                    f"{k} {v}" for k, v in result["restart_phases"].items()) + "\n"
                + (f"- {len(runs)} runs: pause {pauses}, median {statistics.median(pauses)} "
                   f"s; lost {losses}, median {statistics.median(losses)} s; the first save "
                   f"after {firsts}, median {statistics.median(firsts)} s\n"
                   if len(runs) > 1 and pauses and losses else "") +
                f"- steps redone: {result['redone']}; restarts charged: {result['restarts']}\n"
                f"- {result['cause']}: {result['message']}\n"
                + "".join(f"- the controller: {p}\n" for p in result["phases"])
                + "- the timeline (attempt: phase at seconds since submit): " + ", ".join(
                    f"{t['attempt']}: {t['phase']} {t['seconds']}" for t in result["timeline"])
                + "\n")
        _write(args, "-drain", text, result)
        return 0
    if args.cut:
        result = run_cut(args)
        text = (f"A cut node with a hot spare, over SSH on the namespace cluster: 2 nodes x "
                f"{RANKS} ranks and a spare, {args.state_mb:g} MiB of state per rank saved "
                f"every step of {args.step_time:g} s; node rank 1's cable cut after step "
                f"{args.cut_after} (`python benchmarks/bench_ckpt_goodput.py --cut --step-time "
                f"{args.step_time:g}`; `checkpoint.memory` {args.memory} per node).\n\n"
                f"- cut -> every rank training again: {result['recover_s']} s "
                f"(node_timeout {NODE_TIMEOUT:g} s)\n"
                f"- steps redone: {result['redone']}\n"
                f"- restored from: {result['sources']}\n"
                f"- held as the cable went (node index: newest step in its memory, replicas "
                f"of other nodes' ranks, the newest step of its own ranks on other nodes; as last "
                f"reported): {result['held_at_cut']}\n"
                f"- the controller: {'; '.join(result['resumed'])}\n"
                f"- cut known after {result['detected_s']} s; the next attempt's slowest rank, "
                f"seconds after the cut: {result['restart_phases']}; its first save held each rank "
                f"(s): {result['first_save_held_s']}\n")
        _write(args, "-cut", text, result)
        return 0
    variants = {"orchestrator warm, memory": run_orchestrator,
                "torchrun in a shell loop, files": run_torchrun_loop}
    if args.background:
        variants = {"orchestrator warm, memory, beside the training": run_orchestrator,
                    "orchestrator warm, memory, waiting":
                        functools.partial(run_orchestrator, background=False),
                    "torchrun in a shell loop, files, waiting":
                        functools.partial(run_torchrun_loop, background=False),
                    "torchrun in a shell loop, files, beside the training": run_torchrun_loop}
        if args.out == DEFAULT_OUT:
            args.out += "-background"
    ours_name, anchor_name = list(variants)[0], list(variants)[-1]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        work = Path(tmp) / "work"
        work.mkdir()
        for rep in range(args.reps):
            for name, run in variants.items():
                result = analyse(*run(work, args), args)
                results[name].append(result)
                print(f"rep {rep} {name}: goodput {result['goodput']:.3f}, recover "
                      f"{[round(x, 2) for x in result['recover']]}, redone {result['redone']}",
                      flush=True)
    anchor = statistics.median(r["goodput"] for r in results[anchor_name])
    copy = copy_floor(args.state_mb)
    anchor_label = "the loop beside the training" if args.background else "torchrun loop"
    # Beside the training a save holds it for no copy at all, at best.
    best = ceiling(args.step_time, args.fault_every, 0.0 if args.background else copy)
    out = [f"Goodput with a checkpoint every step: {RANKS} ranks (gloo) on this machine, "
           f"{args.state_mb:g} MiB of state per rank, {args.duration:g} s of steps of "
           f"{args.step_time:g} s pretend compute + an all-reduce, one rank SIGKILLed every "
           f"{args.fault_every:g} s; "
           f"medians of {args.reps} run(s) per variant "
           f"(`python benchmarks/bench_ckpt_goodput.py"
           f"{' --background' if args.background else ''}`).", "",
           f"| variant | goodput | x {anchor_label} | kill -> all ranks training again "
           "(median) | steps redone per kill | kills | steps |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        goodput = statistics.median(r["goodput"] for r in runs)
        recover = [x for r in runs for x in r["recover"]]
        redone = [x for r in runs for x in r["redone"]]
        out.append(f"| {name} | {goodput:.3f} | {goodput / anchor:.2f} | "
                   f"{statistics.median(recover) if recover else float('nan'):.2f} s | "
                   f"{statistics.median(redone) if redone else float('nan'):g} | "
                   f"{sum(r['kills'] for r in runs)} | "
                   f"{statistics.median(r['steps'] for r in runs):g} |")
    ours = statistics.median(r["goodput"] for r in results[ours_name])
    out += [f"| the ceiling: restarts that take no time | {best:.3f} | {best / anchor:.2f} | "
            "0 s | 0 | | |", "",
            (f"The ceiling is the goodput of this job were a restart free and a save to hold "
             f"the training for nothing (its copy, {copy:.3f} s here with {RANKS} ranks copying "
             f"at once, made beside the step): each kill loses the step it came in, half of "
             f"one on average. The orchestrator saving beside the training reaches "
             f"{ours / best:.2f} of it." if args.background else
             f"The ceiling is the goodput of this job were a restart free: every step holds the "
             f"training for one copy of the state ({copy:.3f} s here, {RANKS} ranks copying "
             f"at once, measured in this run), and each kill loses the step it came in, half of "
             f"one on average. The orchestrator reaches {ours / best:.2f} of it.")]
    text = "\n".join(out) + "\n"
    print("\n" + text)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "runs": results,
                                                    "copy_s": copy, "ceiling": best},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
