"""A src-layout project, installed into a venv by the job's setup (pip install -e .) and
run as ``.venv/bin/python -m tinyproj.train``."""
import sys

import torch
import torch.distributed as dist

import tinyproj

from .util import double

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([double(rank)])
dist.all_reduce(total)
print(f"src-layout rank {rank}/{world} sum {total.item():g} from {tinyproj.__file__} "
      f"prefix {sys.prefix}", flush=True)
dist.destroy_process_group()
