"""The checkpoint goodput benchmark's training (benchmarks/bench_checkpoint.py --goodput): gloo,
STEP_TIME seconds of pretend compute (a sleep: as on a GPU, the CPU is free meanwhile) and
one all-reduce per step, STATE_MB of state per rank
saved with ``orchestrator.checkpoint`` every CKPT_EVERY steps (and at the step a planned move
asks for) and resumed with its ``load()``; with CKPT_BACKGROUND=1 each save goes on beside
the training (``save(..., wait=False)``), waited for before the state next changes.
Under the orchestrator the saves go to the agent's memory; under plain torchrun to files in
``$ORCHESTRATOR_CHECKPOINT_DIR``, synced (the same script, unchanged). Prints
``STEP <restarts> <rank> <step> <unix time>`` after each step, and ``PHASE <restarts> <rank>
<main|joined|allocated|loaded> <unix time>`` as it starts."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from orchestrator import checkpoint


def _phase(name: str) -> None:
    """Where a (re)started rank's time goes, for the drain benchmark's timeline."""
    rank, restarts = os.environ.get("RANK", "?"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.write(1, f"PHASE {restarts} {rank} {name} {time.time():.4f}\n".encode())


def main() -> None:
    _phase("main")
    steps, step_time = int(os.environ["STEPS"]), float(os.environ["STEP_TIME"])
    every = int(os.environ.get("CKPT_EVERY", "1"))
    background = os.environ.get("CKPT_BACKGROUND") == "1"
    dist.init_process_group("gloo", init_method="env://")
    _phase("joined")
    rank, restarts = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    state = {"weights": torch.zeros(int(float(os.environ["STATE_MB"]) * (1 << 20)) // 4)}
    _phase("allocated")
    start = 0
    restored = checkpoint.load()
    _phase("loaded")
    if restored is not None:
        start = restored[0] + 1
        state["weights"].copy_(restored[1]["weights"])
    t = torch.ones(1)
    for step in range(start, steps):
        time.sleep(step_time)
        dist.all_reduce(t)
        if background:
            checkpoint.wait()  # the last save's copy whole before the state changes
        state["weights"][step % state["weights"].numel()] = step
        # Every ``every`` steps, and the step a planned move asks for.
        held = checkpoint.save(step, state, every=every, wait=not background)
        if held:
            os.write(1, f"SAVED {restarts} {rank} {step} {held:.3f}\n".encode())
        os.write(1, f"STEP {restarts} {rank} {step} {time.time():.4f}\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
