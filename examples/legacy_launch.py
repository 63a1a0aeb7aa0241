"""A script written for the old ``python -m torch.distributed.launch``: it takes
``--local_rank`` as an argument instead of reading LOCAL_RANK, and is run unchanged with
``command: [python3, examples/legacy_launch.py, "--local_rank=${local_rank}"]``
(see jobspecs/legacy-launch.yaml)."""

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)  # the old launcher's contract
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()

dist.init_process_group(args.backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
assert args.local_rank == int(os.environ["LOCAL_RANK"]), "the argument and the env disagree"
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"legacy rank {rank}/{world} local_rank {args.local_rank} sum {int(total.item())}",
      flush=True)
dist.destroy_process_group()
