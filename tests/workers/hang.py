"""All ranks but ODD_RANK wait in an all_reduce; ODD_RANK never gets there."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)


def stuck_in_data_loading():
    time.sleep(600)


def train():
    if rank == int(os.environ.get("ODD_RANK", "3")):
        stuck_in_data_loading()
    total = torch.ones(1)
    dist.all_reduce(total)


train()
