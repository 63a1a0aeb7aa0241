"""Run as ``python -m mypkg.train``: relative imports inside the package."""
import torch
import torch.distributed as dist

from .model import describe

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"module {describe(rank, world, total.item())} from {__name__} in {__package__}",
      flush=True)
dist.destroy_process_group()
