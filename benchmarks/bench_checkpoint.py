#!/usr/bin/env python3
"""What a checkpoint costs the training loop, and what a restore costs: ``checkpoint.save``
into the agent's memory against the physical floor (one copy of the state) and against the
usual ways to disk, in one invocation, per state size.

    python benchmarks/bench_checkpoint.py [--sizes 64,512] [--reps 5] [--out benchmarks]
                                          [--gpu] [--job]

Per size (MiB of float32 per rank, one process):

- memcpy:          one copy of the state into memory already touched (the floor);
- save (memory):   ``checkpoint.save`` into this rank's slots on /dev/shm (reused: the
                   steady state of a training that saves every step), what the loop waits for;
- torch.save+fsync to local disk (``$TMPDIR``), and ``dcp.save`` / ``dcp.async_save``
  (torch.distributed.checkpoint, no process group) to the same disk: the time the call holds
  the caller (for async_save, until it returns, not until the write is done);
- load (memory):   ``checkpoint.load`` of that step, sealed by the agent first (so its
                   checksums are verified), and copied into the model's tensors (what
                   ``load_state_dict`` does after it).

With ``--gpu`` (a CUDA device): the same state on the GPU; the floor is one copy into pinned
host memory, and save copies straight into the slot, registered with CUDA (pinned).
With ``--job``: a real job of 2 ranks on the local transport, ``restart: {warm: true}``, a
rank SIGKILLed right after a save: the seconds from the kill to every rank training again,
and the steps redone (README, "Checkpoints").

Medians of --reps; ratios against the floor of the same run. Writes checkpoint.md and
checkpoint.json (or checkpoint-gpu.*) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from agents.shims import orchestrator_checkpoint as ckpt  # noqa: E402
from agents.shims import orchestrator_checkpoint_format as F  # noqa: E402


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median_of(reps: int, fn: Any, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    return statistics.median(timed(fn) for _ in range(reps))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seal(memory: str, step: int) -> None:
    """What the node's agent does to a save before a load: its manifest of checksums (so that
    the load verifies it)."""
    base = os.path.join(memory, "rank-0", F.step_name(step))
    meta_bytes = Path(base + ".meta").read_bytes()
    meta = json.loads(meta_bytes)
    data = Path(memory, "rank-0", f"slot-{meta['slot']}").read_bytes()[:meta["size"]]
    crcs = F.checksums(memoryview(data), meta["size"])
    F.write_file(base + ".manifest",
                 json.dumps(F.manifest(meta_bytes, crcs, meta["size"])).encode())


def one_size(mib: int, reps: int, device: str, disk: str) -> dict[str, float | None]:
    state = {"w": torch.randn((mib << 20) // 4, device=device)}
    row: dict[str, float | None] = {}
    if device == "cuda":
        pinned = torch.empty((mib << 20) // 4, pin_memory=True)
        row["floor"] = median_of(reps, lambda: (pinned.copy_(state["w"], non_blocking=True),
                                                sync(device)))
        del pinned
    else:
        dst = torch.empty_like(state["w"])
        row["floor"] = median_of(reps, lambda: dst.copy_(state["w"]))
        del dst
    memory = tempfile.mkdtemp(prefix="bench-ckpt-", dir="/dev/shm")
    os.environ.update({F.MEMORY_VAR: memory, F.BUDGET_VAR: str(1 << 62), "RANK": "0"})
    os.environ.pop(F.PERSIST_VAR, None)
    step = iter(range(1 << 30))
    try:
        row["save"] = median_of(reps, lambda: ckpt.save(next(step), state), warm=2)
        last = next(step) - 1
        seal(memory, last)
        os.environ[F.STEP_VAR] = str(last)
        into = torch.empty_like(state["w"])  # the model's tensor a load_state_dict fills
        row["load"] = median_of(reps, lambda: (into.copy_(ckpt.load()[1]["w"]), sync(device)),
                                warm=0)
        assert torch.equal(ckpt.load()[1]["w"], state["w"].cpu()), "load differs from save"
    finally:
        os.environ.pop(F.STEP_VAR, None)
        os.environ.pop(F.MEMORY_VAR, None)
        ckpt.release()
        shutil.rmtree(memory, ignore_errors=True)
    path = os.path.join(disk, "state.pt")

    def torch_save() -> None:
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    row["torch.save+fsync"] = median_of(max(1, reps // 2), torch_save, warm=0)
    os.unlink(path)
    row["dcp.save"] = row["dcp.async_save"] = None
    try:
        import torch.distributed.checkpoint as dcp
        target = os.path.join(disk, "dcp")
        row["dcp.save"] = median_of(max(1, reps // 2),
                                    lambda: dcp.save(state, checkpoint_id=target), warm=0)
        blocked = []
        for i in range(max(1, reps // 2)):  # the time the call holds the caller; then done
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=f"{target}-async-{i}")
            blocked.append(time.perf_counter() - started)
            future.result()
        row["dcp.async_save"] = statistics.median(blocked)
        shutil.rmtree(target, ignore_errors=True)
    except Exception as exc:  # an older torch, or one that wants a process group
        print(f"dcp: {exc!r}", file=sys.stderr)
    return row


def job_restore(mib: int, reps: int) -> dict[str, Any]:
    """A 2-rank local job, warm restarts, rank 1 SIGKILLed after its save of step 20."""
    import orchestrator
    results = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["ORCHESTRATOR_HOME"] = os.path.join(tmp, "home")
            out = Path(tmp) / "out"
            out.mkdir()
            spec = Path(tmp) / "job.yaml"
            spec.write_text(json.dumps({
                "name": "bench-ckpt", "nodes": [{"host": "local"}], "nproc_per_node": 2,
                "command": [sys.executable, str(ROOT / "tests/workers/ckpt_train.py")],
                "workdir": tmp, "max_restarts": 1, "restart": {"warm": True},
                "restart_backoff": {"initial": 0.1},
                "env": {"OUT": str(out), "STEPS": "40", "CRASH_AT": "20", "STEP_SLEEP": "0.5",
                        "STATE_MB": str(mib), "STAMPS": "1"}}))
            job_id = orchestrator.submit(str(spec))
            status = orchestrator.wait(job_id, timeout=600)
            lines = list(orchestrator.logs(job_id))
            killed = [float(ln.rsplit(" ", 1)[1]) for ln in lines if "killing at" in ln]
            again = [float(ln.rsplit(" ", 1)[1]) for ln in lines if "trains again at" in ln]
            results.append({"state": status["state"],
                            "restored_step": status["attempts"][-1].get("restored_step"),
                            "seconds": max(again) - killed[0] if killed and again else None})
    seconds = [r["seconds"] for r in results if r["seconds"] is not None]
    return {"runs": results, "median_s": statistics.median(seconds) if seconds else None}


def render(rows: dict[int, dict[str, float | None]], device: str,
           job: dict[str, Any] | None) -> str:
    floor_name = "copy to pinned memory" if device == "cuda" else "memcpy"
    out = [f"# Checkpoint cost ({device})", "",
           f"Seconds the training waits, median; ratio to one {floor_name} of the state in "
           "the same run.", "",
           "| MiB/rank | " + floor_name + " | save (memory) | torch.save+fsync | dcp.save | "
           "dcp.async_save | load (memory) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for mib, r in rows.items():
        floor = r["floor"] or 1e-9
        cells = ["n/a" if r.get(k) is None else f"{r[k]:.3f} s ({r[k] / floor:.1f}x)"
                 for k in ("save", "torch.save+fsync", "dcp.save", "dcp.async_save", "load")]
        out.append(f"| {mib} | {floor:.3f} s | " + " | ".join(cells) + " |")
    if job is not None:
        out += ["", "A real job (2 ranks, local, warm restarts), a rank SIGKILLed right after "
                "its save: seconds from the kill to every rank training again, and the step "
                "resumed (the step it died in: nothing redone).", ""]
        for run in job["runs"]:
            seconds = run["seconds"] if run["seconds"] is None else round(run["seconds"], 2)
            out.append(f"- {run['state']}, resumed step {run['restored_step']}, {seconds} s")
        out.append(f"- median: {job['median_s']}")
    return "\n".join(out) + "\n"


def plot(rows: dict[int, dict[str, float | None]], device: str, path: Path) -> None:
    """Seconds the training waits per way of saving, one group of bars per state size (log
    scale), and the load beside them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = ["floor", "save", "dcp.async_save", "dcp.save", "torch.save+fsync", "load"]
    names = ["one copy", "checkpoint.save", "dcp.async_save", "dcp.save",
             "torch.save+fsync", "checkpoint.load"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(kinds)
    for i, (kind, name) in enumerate(zip(kinds, names, strict=True)):
        values = [rows[m].get(kind) or float("nan") for m in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))],
                  [f"{m} MiB/rank" for m in rows])
    ax.set_yscale("log")
    ax.set_ylabel("seconds the training waits")
    ax.set_title(f"Checkpoint cost ({device})", fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks"))
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--job", type=int, default=0, metavar="MIB",
                        help="also time a real job's restore with this state per rank")
    parser.add_argument("--replot", action="store_true",
                        help="only draw <out>/checkpoint.png from <out>/checkpoint.json")
    args = parser.parse_args()
    device = "cuda" if args.gpu else "cpu"
    name = "checkpoint-gpu" if args.gpu else "checkpoint"
    out = Path(args.out)
    if args.replot:
        saved = json.loads((out / f"{name}.json").read_text())
        plot({int(k): v for k, v in saved["rows"].items()}, device, out / f"{name}.png")
        return
    disk = tempfile.mkdtemp(prefix="bench-ckpt-disk-", dir=os.environ.get("TMPDIR", "/tmp"))
    try:
        rows = {mib: one_size(mib, args.reps, device, disk)
                for mib in (int(s) for s in args.sizes.split(","))}
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    job = job_restore(args.job, 3) if args.job else None
    text = render(rows, device, job)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, device, out / f"{name}.png")
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"device": device, "rows": rows, "job": job},
                                                 indent=1))


if __name__ == "__main__":
    main()
