"""A project that lives only on the laptop: `sync` ships it to the nodes, `setup` prepares
them, and every rank reads the project's own config file from its copy."""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
config = json.load(open("config.json"))  # in the synced copy on SSH nodes
rank = dist.get_rank()
value = torch.tensor([float(config["scale"] * (rank + 1))])
dist.all_reduce(value)
print(f"rank {rank} in {os.getcwd()}: scaled sum {value.item():g}", flush=True)
dist.destroy_process_group()
