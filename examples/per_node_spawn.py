"""One process per node that starts the node's workers itself: the launch style of many
repositories written before torchrun (``torch.multiprocessing.spawn`` and an explicit
``tcp://`` rendezvous, everything passed on the command line). Runs unchanged with
``launch: per-node`` (jobspecs/per-node.yaml)::

    python per_node_spawn.py --master_addr HOST --master_port PORT --world_size 4 \
        --start_rank 0 --num_gpus 2

Each worker trains the same tiny model with DistributedDataParallel (gloo on CPU, NCCL on
GPUs) and prints a digest of its final weights: equal on every rank when the gradients were
all-reduced across nodes.
"""

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def worker(local_rank: int, args: argparse.Namespace) -> None:
    rank = args.start_rank + local_rank
    gpu = torch.cuda.is_available() and args.num_gpus <= torch.cuda.device_count()
    dist.init_process_group("nccl" if gpu else "gloo",
                            init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            world_size=args.world_size, rank=rank)
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device),
                                    device_ids=[local_rank] if gpu else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(args.steps):
        x = torch.randn(16, 8, generator=generator).to(device)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    # One write per line: the node's workers share its stdout.
    sys.stdout.write(f"per-node rank {rank}/{args.world_size} local {local_rank} "
                     f"final weights {digest}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
    # (pytorch/pytorch#190489; README, "Failures, restarts and health").
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--world_size", type=int, required=True)
    parser.add_argument("--start_rank", type=int, required=True)
    parser.add_argument("--num_gpus", type=int, required=True)  # this node's workers
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    mp.spawn(worker, nprocs=args.num_gpus, args=(args,))


if __name__ == "__main__":
    main()
