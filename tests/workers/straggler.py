"""A synchronous training loop under gloo: each step "computes" (sleeps) STEP_COMPUTE seconds,
SLOW_FACTOR times longer on rank SLOW_RANK (none when unset), then all-reduces a small tensor
and reports its step. STEPS steps, then ``straggler <rank> done``."""
import os
import time

import orchestrator_worker
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
slow = os.environ.get("SLOW_RANK")
compute = float(os.environ.get("STEP_COMPUTE", "0.05"))
if slow is not None and rank == int(slow):
    compute *= float(os.environ.get("SLOW_FACTOR", "8"))
grad = torch.ones(1024)
for step in range(int(os.environ.get("STEPS", "40"))):
    time.sleep(compute)  # the forward and backward pass: the GPU busy, the CPU waiting
    dist.all_reduce(grad)
    grad.fill_(1.0)
    orchestrator_worker.heartbeat(step=step)
# The agent reads the sampler's file once a second: let it see the last one.
time.sleep(1.5)
dist.barrier()
print(f"straggler {rank} done", flush=True)
dist.destroy_process_group()
