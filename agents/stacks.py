"""Where is each rank? Python stacks of live workers (py-spy where it can attach, else the
faulthandler hook of the sitecustomize shim), and the flight recorder dumps each rank's
sampler writes when asked (see orchestrator/hang.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from agents.processes import processes_with_token


def py_spy() -> str | None:
    """py-spy beside this python, else on PATH; ``ORCHESTRATOR_PY_SPY=none`` never uses it
    (a site where ptrace is not wanted), another value names it."""
    chosen = os.environ.get("ORCHESTRATOR_PY_SPY")
    if chosen:
        return None if chosen == "none" else chosen
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def one_stack(pid: int, rank: int, directory: str, attempt: int) -> dict[str, Any]:
    """One process's stack, and how it was taken."""
    tool = py_spy()
    error = "py-spy not found"
    if tool:
        try:
            done = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=15, stdin=subprocess.DEVNULL)
            if done.returncode == 0 and done.stdout.strip():
                return {"method": "py-spy", "text": done.stdout[-65536:]}
            error = (done.stderr or done.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
    stack_dir = os.path.join(directory, f"attempt-{attempt}")
    if os.path.exists(os.path.join(stack_dir, f"hook-{pid}")):  # or SIGUSR2 would kill it
        path = os.path.join(stack_dir, f"stack-{rank}.txt")
        try:
            before = os.path.getsize(path)
            os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and os.path.getsize(path) <= before:
                time.sleep(0.05)
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(before)
                text = f.read(65536)
            if text.strip():
                return {"method": "faulthandler", "text": text,
                        "note": f"py-spy could not attach: {error}"}
        except OSError as exc:
            error += f"; faulthandler: {exc}"
    return {"method": "none", "text": "", "error": error}


def rank_pids(workers: list[Any], token: str) -> list[tuple[int, int]]:
    """(rank, pid) of every live worker; torchrun's workers by their RANK."""
    out = []
    for w in workers:
        if w.proc.poll() is not None:
            continue
        if w.rank is not None:
            out.append((int(w.rank), w.proc.pid))
            continue
        for pid in processes_with_token(token):  # c10d: torchrun's children
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            except (OSError, ValueError):
                continue
            if parent == w.proc.pid and b"RANK" in env:
                out.append((int(env[b"RANK"]), pid))
    return out


def trace_files(traces_dir: str, stack_dir: str, ranks: list[int], since: float,
                deadline: float) -> dict[str, str]:
    """The flight recorder dumps the ranks wrote since ``since`` (waiting until ``deadline``,
    monotonic, for the last of them), copied aside: a dump still being completed must not
    change under the controller's read."""
    prefix = os.path.join(traces_dir, "nccl_trace_rank_")
    done = os.path.join(stack_dir, "flight-recorder-done-")
    found, complete = dict[str, str](), set[int]()
    while True:
        for r in ranks:
            try:
                if os.stat(f"{prefix}{r}").st_mtime >= since - 1:
                    found[str(r)] = f"{prefix}{r}"
                if os.stat(f"{done}{r}").st_mtime >= since - 1:
                    complete.add(r)
            except OSError:
                pass
        if len(complete) == len(ranks) or time.monotonic() > deadline:
            kept = os.path.join(traces_dir, "on-hang")
            os.makedirs(kept, mode=0o700, exist_ok=True)
            for key, path in found.items():
                found[key] = os.path.join(kept, os.path.basename(path))
                shutil.copyfile(path, found[key])
            return found
        time.sleep(0.1)
