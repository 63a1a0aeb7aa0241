"""All ranks but ODD_RANK wait in an all_reduce; ODD_RANK never gets there."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()


# "ready" right before each rank blocks: printed earlier, a stack taken at once could find
# a rank not there yet (seen once in a full run: rank 3's stack had no stuck_in_data_loading).
def stuck_in_data_loading():
    print(f"rank {rank} ready", flush=True)
    time.sleep(600)


def train():
    if rank == int(os.environ.get("ODD_RANK", "3")):
        stuck_in_data_loading()
    total = torch.ones(1)
    print(f"rank {rank} ready", flush=True)
    dist.all_reduce(total)


train()
