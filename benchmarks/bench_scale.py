#!/usr/bin/env python3
"""Simulated scale: the real controller against thousands of in-process fake agents.

    python benchmarks/bench_scale.py [--nodes 1000 4000] [--reps 3] [--nproc 1]
                                     [--lines-per-s 2] [--node-timeout 5] [--out benchmarks]

Every node is a FakeAgent (orchestrator/transport/fake.py) on one driver thread that sends
what a real agent sends unprompted: a heartbeat every 0.5 s and each rank's output, one
numbered line per message, --lines-per-s per rank. The controller is the real one (node
pool, attempt, restart policy, SQLite store with synchronous=FULL, log files), run in this
process. One run:

  launch    submit to every agent attached and every worker started (job RUNNING);
  steady    3 s of heartbeats and output;
  lost      one node (not node 0) goes silent: time until the controller marks it LOST
            (goal: within node_timeout + 1 s);
  restart   LOST to every worker of attempt 2 started on the other nodes
            (nnodes N-1:N, restart_backoff 0.1 s), and to the job's state RUNNING again
            (what `status` shows: the controller writes it once it has seen every start);
  end       2 s later every worker exits 0; the job must end SUCCEEDED.

Then it checks, exactly: every worker of both attempts started, every output line is in
its rank's log exactly once and in order, and in combined.log; the node was lost once and
the job restarted once. CPU is the process's CPU (getrusage) minus the fake driver's own
thread time, per phase; peak RSS is the process's VmHWM (fakes included: an upper bound);
threads are sampled every 50 ms. Medians of --reps runs. Writes scale.md and scale.png to
--out with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.controller import Controller  # noqa: E402
from orchestrator.spec import parse_jobspec  # noqa: E402
from orchestrator.state import JobState, NodeState  # noqa: E402
from orchestrator.store import Store  # noqa: E402
from orchestrator.transport.fake import FakeCluster  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rusage() -> dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "sys_s": r.ru_stime,
            "context_switches": float(r.ru_nvcsw + r.ru_nivcsw)}


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def spec_yaml(nodes: int, nproc: int, heartbeat_interval: float, node_timeout: float) -> str:
    hosts = ", ".join(f"{{host: n{i:05d}}}" for i in range(nodes))
    return f"""
name: sim
nodes: [{hosts}]
nproc_per_node: {nproc}
nnodes: "{nodes - 1}:{nodes}"
command: [train]
max_restarts: 1
restart_backoff: {{initial: 0.1, max: 0.1}}
launch_timeout: 120
health: {{heartbeat_interval: {heartbeat_interval}, node_timeout: {node_timeout},
         controller_grace: 1}}  # the dead node: stop trying soon after the end
"""


def simulate(nodes: int, *, nproc: int = 1, lines_per_s: float = 2.0,
             heartbeat_interval: float = 1.0, node_timeout: float = 5.0, steady: float = 3.0,
             after_restart: float = 2.0, home: str | None = None,
             timeout: float = 300.0) -> dict[str, Any]:
    """One simulated job (see the module doc). Returns timings, resources and the checks'
    counts; raises AssertionError when a check fails."""
    tmp = tempfile.TemporaryDirectory(prefix="bench-scale-") if home is None else None
    base = Path(home or tmp.name)  # type: ignore[union-attr]
    spec = parse_jobspec(spec_yaml(nodes, nproc, heartbeat_interval, node_timeout))
    store = Store(base / "home", durable=True)  # as the controller process opens it
    job_id = "sim-000001"
    store.create_job(job_id, spec.name, spec.model_dump_json(), str(base), spec.max_restarts,
                     [n.host for n in spec.nodes])
    cluster = FakeCluster(heartbeat_interval=heartbeat_interval, lines_per_s=lines_per_s,
                          run=True)
    controller = Controller(store, job_id, spec, str(base), cluster)
    victim = controller.nodes[nodes // 2]
    out: dict[str, Any] = {"nodes": nodes, "nproc": nproc, "lines_per_s": lines_per_s,
                           "node_timeout": node_timeout}
    marks: dict[str, tuple[float, float, float]] = {}  # phase -> (wall, cpu, fake cpu)
    threads = [threading.active_count()]
    errors: list[BaseException] = []

    def mark(name: str) -> None:
        marks[name] = (time.monotonic(), _cpu(), cluster.cpu_s)

    def until(cond: Any, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            threads.append(threading.active_count())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g}s")
            if controller.state.is_terminal():
                raise AssertionError(f"{what}: the job ended {controller.state.value}")
            time.sleep(0.005)

    def running(number: int) -> bool:
        a = controller.current
        return a is not None and a.number == number and a.all_started

    def shown_running(number: int) -> bool:  # what `status` reads: the state written
        a = controller.current
        return a is not None and a.number == number and controller.state == JobState.RUNNING

    def drive() -> None:
        try:
            until(lambda: running(1), "launch")
            mark("launched")
            out["attached_s"] = max(0.0, *(t for t in attach_times.values())) - marks["t0"][0]
            time.sleep(steady)
            mark("steady")
            cluster.kill(victim.host)
            mark("killed")
            until(lambda: victim.state == NodeState.LOST, "lost")
            mark("lost")
            until(lambda: running(2), "restart")
            mark("restarted")
            until(lambda: shown_running(2), "restart shown")
            mark("shown")
            time.sleep(after_restart)
            threads.append(threading.active_count())
            cluster.finish()
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)
            controller.request_cancel()

    attach_times: dict[int, float] = {}

    def on_attached(node: Any, channel: Any) -> None:  # when each agent answered
        attach_times.setdefault(node.index, time.monotonic())

    controller.engine.on_attached = on_attached
    mark("t0")
    observer = threading.Thread(target=drive, daemon=True)
    observer.start()
    try:
        final = controller.run()
        mark("end")
    finally:
        cluster.close()
        observer.join(timeout=10)
    if errors:
        raise errors[0]

    def span(a: str, b: str) -> dict[str, float]:
        wall = marks[b][0] - marks[a][0]
        cpu = (marks[b][1] - marks[a][1]) - (marks[b][2] - marks[a][2])
        return {"s": wall, "cpu_s": cpu, "cores": cpu / wall if wall else 0.0}

    out.update({
        "launch_s": span("t0", "launched")["s"],
        "launch_cores": span("t0", "launched")["cores"],
        "steady_cores": span("launched", "steady")["cores"],
        "detect_s": span("killed", "lost")["s"],
        "restart_s": span("lost", "restarted")["s"],
        "restart_shown_s": span("lost", "shown")["s"],
        "total_s": span("t0", "end")["s"],
        "total_cores": span("t0", "end")["cores"],
        "fake_cpu_s": cluster.cpu_s,
        # Where the CPU goes (the whole process, fakes included): kernel time and context
        # switches are what a thread per channel costs.
        **_rusage(),
        "peak_rss_mib": _vm_hwm_mib(),
        "threads_max": max(threads),
    })

    # --- correctness, exactly --------------------------------------------------------------
    job = store.get_job(job_id)
    assert final == JobState.SUCCEEDED, (final, job.failure)
    assert job.attempt == 2 and job.restarts == 1, (job.attempt, job.restarts)
    first = job.attempts[0].failure or {}
    assert first.get("cause") == "NODE_FAIL" and first.get("host") == victim.host, first
    events = [e for e in job.nodes[victim.index].history if e.state == NodeState.LOST]
    assert len(events) == 1, events
    world = {1: nodes * nproc, 2: (nodes - 1) * nproc}
    attempts = {a.number: a for a in (controller.previous, controller.current) if a}
    started = {number: len(attempts[number].started) for number in world}
    assert started == world, (started, world)
    printed = {number: sum(1 for (a, _r) in cluster.sent_lines if a == number)
               for number in world}
    assert printed == world, ("ranks that printed", printed, world)
    lines = 0
    for (number, rank), count in sorted(cluster.sent_lines.items()):
        path = store.log_dir(job_id, number) / f"rank-{rank}.log"
        got = path.read_text().splitlines() if path.exists() else []
        want = [f"line {i}" for i in range(count)]
        assert got == want, f"attempt {number} rank {rank}: {len(got)} lines, want {count}"
        lines += count
    for number in world:
        combined = store.log_dir(job_id, number) / "combined.log"
        n = len(combined.read_text().splitlines()) if combined.exists() else 0
        assert n == sum(c for (a, _), c in cluster.sent_lines.items() if a == number), number
    out["lines"] = lines
    out["ranks_started"] = {str(k): v for k, v in started.items()}
    store.close()
    if tmp is not None:
        tmp.cleanup()
    return out


# --- the benchmark ---------------------------------------------------------------------------
KEYS = [("launch_s", "launch: submit to all workers started (s)", "{:.2f}"),
        ("attached_s", "... of which all agents attached (s)", "{:.2f}"),
        ("detect_s", "lost node detected after it went silent (s)", "{:.2f}"),
        ("restart_s", "restart: LOST to all workers of attempt 2 started (s)", "{:.2f}"),
        ("restart_shown_s", "... to the job's state RUNNING again, as `status` shows (s)",
         "{:.2f}"),
        ("launch_cores", "controller CPU during launch (cores)", "{:.2f}"),
        ("steady_cores", "controller CPU, steady state (cores)", "{:.2f}"),
        ("total_cores", "controller CPU, whole job (cores)", "{:.2f}"),
        ("peak_rss_mib", "peak RSS, process incl. fakes (MiB)", "{:.0f}"),
        ("threads_max", "threads (max)", "{:.0f}"),
        ("user_s", "process CPU, user (s, fakes included)", "{:.1f}"),
        ("sys_s", "process CPU, kernel (s, fakes included)", "{:.1f}"),
        ("context_switches", "context switches (process)", "{:.0f}"),
        ("lines", "output lines, each checked in its log", "{:.0f}")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 4000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--lines-per-s", type=float, default=2.0)
    p.add_argument("--node-timeout", type=float, default=5.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    p.add_argument("--name", default="scale", help="file stem for the .md/.png/.json")
    args = p.parse_args()
    import subprocess

    results: dict[int, list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for n in args.nodes:
            # A fresh process per run: peak RSS and thread counts are the run's own.
            call = (f"simulate({n}, nproc={args.nproc}, lines_per_s={args.lines_per_s!r}, "
                    f"node_timeout={args.node_timeout!r})")
            cmd = [sys.executable, "-c",
                   f"import json,sys;sys.path.insert(0,{str(Path(__file__).parent)!r});"
                   f"from bench_scale import simulate;print('RESULT'+json.dumps({call}))"]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            r = json.loads(line[len("RESULT"):])
            results.setdefault(n, []).append(r)
            print(f"rep {rep + 1} nodes {n}: " + ", ".join(
                f"{k}={r[k]:.2f}" for k, _, _ in KEYS if isinstance(r.get(k), float)),
                flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k, _, _ in KEYS}
           for n, rs in results.items()}
    cmd = "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    rows = ["| measurement | " + " | ".join(f"{n} nodes" for n in med) + " |",
            "| --- |" + " --- |" * len(med)]
    for k, label, fmt in KEYS:
        rows.append(f"| {label} | " + " | ".join(fmt.format(med[n][k]) for n in med) + " |")
    (out / f"{args.name}.md").write_text(
        f"# Simulated scale (medians of {args.reps} runs)\n\n`{cmd.strip()}`; "
        f"{args.nproc} rank(s) per node, {args.lines_per_s:g} output lines/s per rank, "
        f"heartbeats every 0.5 s, node_timeout {args.node_timeout:g} s. Machine: "
        f"{os.cpu_count()} cores, shared and noisy.\n\n" + "\n".join(rows) + "\n")
    _plot(med, out / f"{args.name}.png", args)
    print("\n".join(rows))
    return 0


def _plot(med: dict[int, dict[str, float]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(med)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for k, label in (("launch_s", "launch"), ("detect_s", "lost node detected"),
                     ("restart_s", "restart")):
        ax1.plot(ns, [med[n][k] for n in ns], marker="o", label=label)
    ax1.axhline(args.node_timeout + 1, ls=":", c="gray", label="node_timeout + 1 s")
    ax1.set_xlabel("fake nodes")
    ax1.set_ylabel("seconds (median)")
    ax1.legend()
    ax2.plot(ns, [med[n]["total_cores"] for n in ns], marker="o", label="controller cores")
    ax2.plot(ns, [med[n]["peak_rss_mib"] / 1024 for n in ns], marker="s",
             label="peak RSS (GiB)")
    ax2.axhline(1.0, ls=":", c="gray", label="goal: 1 core, 1 GiB")
    ax2.set_xlabel("fake nodes")
    ax2.legend()
    fig.suptitle(f"Simulated scale, medians of {args.reps} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
