"""Checks torch.distributed collectives across nodes (gloo); prints COLLECTIVES OK <rank>."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])

t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t

gathered = [torch.zeros(1) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([float(rank)]))
assert [g.item() for g in gathered] == [float(r) for r in range(world)], gathered

b = torch.tensor([42.0 if rank == world - 1 else 0.0])
dist.broadcast(b, src=world - 1)
assert b.item() == 42.0, b

# A ring of point-to-point messages: every rank sends to the next, receives from the previous.
nxt, prev = (rank + 1) % world, (rank - 1) % world
send = torch.tensor([float(rank * 10)])
recv = torch.zeros(1)
reqs = [dist.isend(send, nxt), dist.irecv(recv, prev)]
for r in reqs:
    r.wait()
assert recv.item() == prev * 10, recv

dist.barrier()
print(f"COLLECTIVES OK {rank} via {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
dist.destroy_process_group()
