#!/usr/bin/env python3
"""Log flood benchmark: a job flooding its logs vs the same job quiet vs no orchestrator at all.

Each rank of the flood job prints numbered lines as fast as it can; the quiet job is the same
job printing nothing; the floor is the same processes with no orchestrator.

    python benchmarks/bench_flood.py [--lines 200000] [--reps 3] [--nodes 2] [--nproc 2]
                                     [--ssh] [--timeout 600] [--json FILE]

- quiet: 2 local nodes x 2 ranks of tests/workers/flood.py with FLOOD_LINES=0 (one line each).
- flood: the same job, each rank printing --lines numbered lines; every line is then counted
         in each rank's log (missing, duplicated, out of order) and in combined.log.
- floor: the same 4 processes started directly with subprocess, each writing to a local file.

Times are submit -> done (time.monotonic(), through orchestrator.submit/wait), medians of
--reps runs, interleaved so that drift hits every variant alike. While a job runs, the peak
RSS (VmHWM) of its controller and of its node agents is sampled every 50 ms.

`--ssh` (root needed) also runs the jobs over SSH on a namespace cluster built like the
cluster tests build theirs (examples/local-cluster); the floor stays local processes.

Lost lines are printed loudly and make the exit status 1, as does a job that did not succeed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_cluster import load_cluster_module  # noqa: E402  (the cluster, as loaded there)

FLOOD = str(ROOT / "tests" / "workers" / "flood.py")
PY = sys.executable
SAMPLE_INTERVAL = 0.05  # seconds between RSS samples


# --- peak memory -------------------------------------------------------------------------------
def _proc_mib(pid: int) -> float | None:
    """The process's peak RSS (VmHWM, else VmRSS) in MiB, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    for key in ("VmHWM", "VmRSS"):  # VmHWM catches peaks that fall between two samples
        if key in fields:
            return int(fields[key].split()[0]) / 1024
    return None


class RssSampler(threading.Thread):
    """Samples the job's controller and agents every 50 ms until stopped."""

    def __init__(self, orc: ModuleType, job_id: str):
        super().__init__(daemon=True)
        self.orc = orc
        self.job_id = job_id
        self.controller_pid: int | None = None
        self.agent_pids: dict[int, int] = {}  # node index -> pid
        self.n_nodes: int | None = None
        self.controller_mib = 0.0
        self.agent_mib: dict[int, float] = {}
        self._done = threading.Event()  # not _stop: Thread has one

    def stop(self) -> None:
        self._done.set()
        self.join()

    def _resolve(self) -> None:
        # Only until every pid is known: a status() read per 50 ms would itself load the
        # 2-core machine that the measurement runs on.
        try:
            st = self.orc.status(self.job_id)
        except Exception:  # the job is still being recorded, or the API is mid-change
            st = {}
        if self.controller_pid is None:
            self.controller_pid = (st.get("controller") or {}).get("pid")
        if self.controller_pid is None:
            try:
                from orchestrator.store import Store

                store = Store()
                try:
                    self.controller_pid = store.get_job(self.job_id).controller_pid
                finally:
                    store.close()
            except Exception:
                pass
        nodes = st.get("nodes") or []
        if nodes:
            self.n_nodes = len(nodes)
        for node in nodes:
            if node.get("agent_pid"):
                self.agent_pids[node.get("node_index", len(self.agent_pids))] = node["agent_pid"]

    def _sample(self) -> None:
        if self.controller_pid is None or self.n_nodes is None \
                or len(self.agent_pids) < self.n_nodes:
            self._resolve()
        if self.controller_pid:
            mib = _proc_mib(self.controller_pid)
            if mib is not None:
                self.controller_mib = max(self.controller_mib, mib)
        for index, pid in self.agent_pids.items():
            mib = _proc_mib(pid)
            if mib is not None:
                self.agent_mib[index] = max(self.agent_mib.get(index, 0.0), mib)

    def run(self) -> None:
        while True:
            self._sample()
            if self._done.wait(SAMPLE_INTERVAL):
                self._sample()  # once more: VmHWM read late is the whole run's peak
                return


# --- counting lines -----------------------------------------------------------------------------
@dataclass
class RankCheck:
    rank: int
    lines: int = 0        # lines in the file
    missing: int = 0      # indices 0..N-1 never seen
    duplicated: int = 0   # occurrences of an index beyond its first
    out_of_order: int = 0  # lines whose index is lower than the line before's
    garbled: int = 0      # lines that are not this rank's flood lines (cut, joined, foreign)
    done_ok: bool = False  # the last line is "flood r done N", and it appears once

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.out_of_order or self.garbled) \
            and self.done_ok


def check_rank_log(path: Path, rank: int, n: int) -> RankCheck:
    """Is ``path`` exactly ``flood r 0`` .. ``flood r N-1`` then ``flood r done N``?"""
    check = RankCheck(rank)
    seen = bytearray(n)
    prefix = f"flood {rank} "
    done = f"flood {rank} done {n}"
    done_count = 0
    last = ""
    previous = -1
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError:
        check.missing = n
        return check
    with f:
        for raw in f:
            line = raw.rstrip("\n")
            check.lines += 1
            last = line
            if line == done:
                done_count += 1
                continue
            parts = line[len(prefix):].split(" ") if line.startswith(prefix) else []
            # A padded line (FLOOD_WIDTH) carries one more field, all 'x'.
            if not (1 <= len(parts) <= 2 and parts[0].isdigit()
                    and (len(parts) == 1 or parts[1].strip("x") == "")):
                check.garbled += 1
                continue
            i = int(parts[0])
            if i >= n:
                check.garbled += 1
                continue
            if seen[i]:
                check.duplicated += 1
            seen[i] = 1
            if i < previous:
                check.out_of_order += 1
            previous = i
    check.missing = n - sum(seen)
    check.done_ok = done_count == 1 and last == done
    return check


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


# --- runs ---------------------------------------------------------------------------------------
@dataclass
class Run:
    variant: str  # quiet, flood or floor
    wall_s: float
    job_id: str | None = None
    state: str = "SUCCEEDED"
    failure: Any = None
    controller_peak_mib: float | None = None
    agent_peak_mib: dict[int, float] = field(default_factory=dict)
    ranks: list[RankCheck] = field(default_factory=list)
    combined_lines: int | None = None
    combined_expected: int | None = None

    @property
    def lost(self) -> int:
        """Lines the rank logs lack (a missing done line counts as one)."""
        return sum(r.missing + (not r.done_ok) for r in self.ranks)

    @property
    def sound(self) -> bool:
        combined_ok = self.combined_expected is None or \
            self.combined_lines == self.combined_expected
        return self.state == "SUCCEEDED" and all(r.ok for r in self.ranks) and combined_ok


class Bench:
    def __init__(self, orc: ModuleType, work: Path, args: argparse.Namespace):
        self.orc = orc
        self.work = work
        self.lines: int = args.lines
        self.nodes: int = args.nodes
        self.nproc: int = args.nproc
        self.timeout: float = args.timeout
        self.home = Path(os.environ["ORCHESTRATOR_HOME"])

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    def spec(self, transport: str, cluster: Any, lines: int) -> Path:
        data: dict[str, Any] = {
            "name": "flood" if lines else "quiet",
            "nproc_per_node": self.nproc,
            "command": [PY, FLOOD],
            "workdir": str(self.work),
            "env": {"FLOOD_LINES": str(lines)},
            "stop_grace_period": 2,
        }
        if transport == "local":
            data["nodes"] = [{"host": "local"} for _ in range(self.nodes)]
        else:  # as tests/cluster/test_ssh_jobs.py's cluster_spec
            data["nodes"] = [{"host": f"root@{h.address}"} for h in cluster.hosts[:self.nodes]]
            data["ssh"] = {"identity_file": str(cluster.client_key),
                           "known_hosts": str(cluster.known_hosts), "connect_timeout": 3}
            data["python"] = PY  # non-interactive SSH has the system PATH; use ours
            data["launch_timeout"] = 30
        path = self.work / f"{data['name']}-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def job(self, transport: str, cluster: Any, lines: int) -> Run:
        spec = self.spec(transport, cluster, lines)
        started = time.monotonic()
        job_id = self.orc.submit(str(spec))
        sampler = RssSampler(self.orc, job_id)
        sampler.start()
        try:
            result = self.orc.wait(job_id, timeout=self.timeout)
        finally:
            sampler.stop()
        wall = time.monotonic() - started
        run = Run("flood" if lines else "quiet", wall, job_id, result.get("state", "?"),
                  result.get("failure"), sampler.controller_mib or None, sampler.agent_mib)
        if run.state not in ("SUCCEEDED", "FAILED", "CANCELLED"):  # still running at timeout
            self.orc.cancel(job_id)
        if lines:
            logs = self.home / "jobs" / job_id / "logs" / "attempt-1"
            run.ranks = [check_rank_log(logs / f"rank-{r}.log", r, lines)
                         for r in range(self.world)]
            run.combined_lines = count_lines(logs / "combined.log")
            run.combined_expected = self.world * (lines + 1)
        return run

    def floor(self) -> Run:
        out = self.work / f"floor-{uuid.uuid4().hex[:6]}"
        out.mkdir()
        files = [open(out / f"rank-{r}.log", "w") for r in range(self.world)]
        started = time.monotonic()
        try:
            procs = [subprocess.Popen([PY, FLOOD], stdout=f, stderr=subprocess.STDOUT,
                                      env={**os.environ, "RANK": str(r),
                                           "FLOOD_LINES": str(self.lines)})
                     for r, f in enumerate(files)]
            codes = [p.wait() for p in procs]
        finally:
            for f in files:
                f.close()
        run = Run("floor", time.monotonic() - started,
                  state="SUCCEEDED" if not any(codes) else f"exit codes {codes}")
        run.ranks = [check_rank_log(out / f"rank-{r}.log", r, self.lines)
                     for r in range(self.world)]
        return run


def report_run(transport: str, run: Run) -> None:
    text = f"{transport:5} {run.variant:5} {run.wall_s:7.2f} s  {run.state}"
    if run.job_id:  # the floor has no controller or agents
        peak = f"{run.controller_peak_mib:.0f}" if run.controller_peak_mib else "?"
        agents = max(run.agent_peak_mib.values(), default=0.0)
        text += f"  controller {peak} MiB  agents {agents:.0f} MiB"
    if run.combined_expected:
        text += f"  combined.log {run.combined_lines}/{run.combined_expected} lines"
    print(text, flush=True)
    if run.state != "SUCCEEDED":
        print(f"!!! {transport} {run.variant} job {run.job_id} ended {run.state}: {run.failure}",
              flush=True)
    bad = [r for r in run.ranks if not r.ok]
    combined_short = run.combined_expected is not None and \
        run.combined_lines != run.combined_expected
    if bad or combined_short:
        # Loud on purpose: a fast number from a run that dropped lines is worthless.
        print(f"!!! LINES LOST OR MANGLED ({transport} {run.variant}, job {run.job_id}):",
              flush=True)
        for r in bad:
            print(f"!!!   rank {r.rank}: {r.lines} lines, missing {r.missing}, duplicated "
                  f"{r.duplicated}, out of order {r.out_of_order}, garbled {r.garbled}, "
                  f"done line {'ok' if r.done_ok else 'MISSING/WRONG'}", flush=True)
        if combined_short:
            print(f"!!!   combined.log: {run.combined_lines} lines, expected "
                  f"{run.combined_expected}", flush=True)


def measure(bench: Bench, transport: str, cluster: Any, reps: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {"quiet": [], "flood": [], "floor": []}
    for _ in range(reps):  # interleaved, so drift hits every variant alike
        for variant in runs:
            if variant == "floor":
                run = bench.floor()
            else:
                run = bench.job(transport, cluster, bench.lines if variant == "flood" else 0)
            report_run(transport, run)
            runs[variant].append(run)
    return runs


def summarize(bench: Bench, runs: dict[str, list[Run]]) -> dict[str, Any]:
    quiet = statistics.median(r.wall_s for r in runs["quiet"])
    flood = statistics.median(r.wall_s for r in runs["flood"])
    floor = statistics.median(r.wall_s for r in runs["floor"])
    total = bench.world * bench.lines
    return {
        "quiet_s": quiet, "flood_s": flood, "floor_s": floor,
        "lines_per_s": total / flood, "flood_over_quiet": flood / quiet,
        "flood_over_floor": flood / floor,
        "controller_peak_mib": max((r.controller_peak_mib or 0.0 for r in runs["flood"]),
                                   default=0.0),
        "controller_peak_quiet_mib": max((r.controller_peak_mib or 0.0
                                          for r in runs["quiet"]), default=0.0),
        "agent_peak_mib": max((max(r.agent_peak_mib.values(), default=0.0)
                               for r in runs["flood"]), default=0.0),
        "lines_lost": sum(r.lost for r in runs["flood"]),
        "flood_runs_unsound": sum(not r.sound for r in runs["flood"]),
        "jobs_failed": sum(r.state != "SUCCEEDED" for v in ("quiet", "flood") for r in runs[v]),
    }


def print_table(args: argparse.Namespace, bench: Bench, summary: dict[str, dict]) -> None:
    names = list(summary)
    total = bench.world * bench.lines
    rows: list[tuple[str, ...]] = [
        ("quiet job (FLOOD_LINES=0), submit to done",
         *(f"{summary[t]['quiet_s']:.2f} s" for t in names)),
        (f"flood job ({total:,} lines), submit to done",
         *(f"{summary[t]['flood_s']:.2f} s" for t in names)),
        ("floor: same processes, direct to local files",
         *(f"{summary[t]['floor_s']:.2f} s" for t in names)),
        ("lines/s end to end (flood)", *(f"{summary[t]['lines_per_s']:,.0f}" for t in names)),
        ("flood / quiet (goal <= 3x)",
         *(f"{summary[t]['flood_over_quiet']:.2f}x" for t in names)),
        ("flood / floor", *(f"{summary[t]['flood_over_floor']:.2f}x" for t in names)),
        ("controller peak RSS, flood (quiet)",
         *(f"{summary[t]['controller_peak_mib']:.0f} MiB "
           f"({summary[t]['controller_peak_quiet_mib']:.0f} MiB)" for t in names)),
        ("agent peak RSS, flood (largest agent)",
         *(f"{summary[t]['agent_peak_mib']:.0f} MiB" for t in names)),
        ("lines lost (must be 0)",
         *(str(summary[t]["lines_lost"]) if not summary[t]["flood_runs_unsound"]
           else f"**{summary[t]['lines_lost']} lost; {summary[t]['flood_runs_unsound']} "
                f"unsound runs**" for t in names)),
        ("jobs that did not succeed (must be 0)",
         *(str(summary[t]["jobs_failed"]) if not summary[t]["jobs_failed"]
           else f"**{summary[t]['jobs_failed']}**" for t in names)),
    ]
    print(f"\n{bench.nodes} nodes x {bench.nproc} ranks, {bench.lines:,} lines per rank")
    print(f"| measurement (median of {args.reps}) | " + " | ".join(names) + " |")
    print("| --- | " + " | ".join("---" for _ in names) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=200_000, help="lines per rank")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node (nproc_per_node)")
    p.add_argument("--ssh", action="store_true",
                   help="also run over SSH on a namespace cluster (root needed)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job at most")
    p.add_argument("--json", metavar="FILE", help="write the raw numbers here")
    args = p.parse_args()
    if args.ssh and os.geteuid() != 0:
        p.error("--ssh builds network namespaces: run as root")

    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        # A private state directory, set before the orchestrator is first imported or used:
        # the benchmark's jobs must not mix with (or be slowed by) the user's own.
        os.environ["ORCHESTRATOR_HOME"] = str(Path(tmp) / "home")
        import orchestrator

        work = Path(tmp) / "work"
        work.mkdir()
        bench = Bench(orchestrator, work, args)
        all_runs: dict[str, dict[str, list[Run]]] = {}
        all_runs["local"] = measure(bench, "local", None, args.reps)
        if args.ssh:
            local_cluster = load_cluster_module()
            local_cluster.cleanup_stale()
            cluster = local_cluster.Cluster(args.nodes, Path(tmp) / "cluster").up()
            try:
                all_runs["ssh"] = measure(bench, "ssh", cluster, args.reps)
            finally:
                cluster.down()

    summary = {t: summarize(bench, runs) for t, runs in all_runs.items()}
    print_table(args, bench, summary)
    if args.json:
        raw = {"args": vars(args), "summary": summary,
               "runs": {t: {v: [{**asdict(r), "lost": r.lost, "sound": r.sound} for r in rs]
                            for v, rs in runs.items()} for t, runs in all_runs.items()}}
        Path(args.json).write_text(json.dumps(raw, indent=2))
    lost = sum(s["lines_lost"] + s["flood_runs_unsound"] for s in summary.values())
    failed = sum(s["jobs_failed"] for s in summary.values())
    if lost or failed:
        problems = ["LINES WERE LOST OR MANGLED"] if lost else []
        problems += [f"{failed} job(s) did not succeed"] if failed else []
        print(f"\n!!! {'; '.join(problems)}: the numbers above do not count", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
