"""The goodput benchmark's training (gloo, env://): one all-reduce and STEP_TIME seconds of
pretend compute per step, a checkpoint every CKPT_EVERY steps (rank 0, after a barrier), and
a resume from the last one. Prints ``STEP <restarts> <rank> <step> <unix time>`` after each
step (``<restarts>``: TORCHELASTIC_RESTART_COUNT, which torchrun and the orchestrator both
set) and calls the orchestrator's heartbeat(step) where it runs under it. Runs under torchrun
and the orchestrator alike (benchmarks/bench_goodput.py kills its ranks)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

try:
    from orchestrator_worker import heartbeat
except ImportError:  # under torchrun
    def heartbeat(step=None, **metrics):
        pass


def main() -> None:
    steps, step_time = int(os.environ["STEPS"]), float(os.environ["STEP_TIME"])
    every, ckpt = int(os.environ["CKPT_EVERY"]), sys.argv[1]
    dist.init_process_group("gloo", init_method="env://")
    rank, restarts = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    t = torch.ones(1)
    for step in range(start, steps):
        time.sleep(step_time)
        dist.all_reduce(t)
        os.write(1, f"STEP {restarts} {rank} {step} {time.time():.4f}\n".encode())
        heartbeat(step=step)
        if (step + 1) % every == 0:
            dist.barrier()
            if rank == 0:
                with open(ckpt + ".tmp", "w") as f:
                    f.write(str(step + 1))
                os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
