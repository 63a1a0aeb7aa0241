"""A sharded training (gloo; its state a DTensor sharded over every rank, as FSDP2 keeps its
parameters) that saves every step with torch.distributed.checkpoint through
``orchestrator.checkpoint_dcp`` and resumes with ``dcp.load`` in whatever world size its
attempt has. Deterministic: after step s every element is s + 1, whatever the sharding.

Env: STEPS (default 40), STEP_SLEEP (0.1), STEP_SLEEP_LATER (in later attempts; default the
same), OUT: rank 0 writes ``final.txt``, the distinct values of the whole tensor at the end.
Each rank prints "rank R resumed step S in world W".
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from orchestrator import checkpoint_dcp

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
state = {"w": distribute_tensor(torch.zeros(24, 4), mesh, [Shard(0)])}
step_sleep = float(os.environ.get("STEP_SLEEP", "0.1"))
if os.environ["ORCHESTRATOR_ATTEMPT"] != "1":
    step_sleep = float(os.environ.get("STEP_SLEEP_LATER", step_sleep))
reader = checkpoint_dcp.StorageReader()
start = 0
if reader.step is not None:
    dcp.load(state, storage_reader=reader)
    start = reader.step + 1
    print(f"rank {rank} resumed step {reader.step} in world {world}", flush=True)
for step in range(start, int(os.environ.get("STEPS", "40"))):
    state["w"].to_local().add_(1.0)
    dcp.save(state, storage_writer=checkpoint_dcp.StorageWriter(step))
    print(f"rank {rank} step {step} saved", flush=True)
    time.sleep(step_sleep)
full = state["w"].full_tensor()
if rank == 0:
    with open(os.path.join(os.environ["OUT"], "final.txt"), "w") as f:
        f.write(" ".join(str(v) for v in sorted(set(full.flatten().tolist()))))
dist.barrier()
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; as tests/workers/accelerate_train.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
