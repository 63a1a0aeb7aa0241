"""A training script with its code beside it, as real projects have: a module (helper.py)
and a package (mypkg/) next to the script, imported as under ``torchrun train.py``."""
import torch
import torch.distributed as dist
from helper import SCALE  # a module beside the script
from mypkg.model import describe  # a package beside the script

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank) * SCALE])
dist.all_reduce(total)
print(f"two-file {describe(rank, world, total.item())}", flush=True)
dist.destroy_process_group()
