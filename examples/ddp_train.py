"""A small but real DDP training, runnable unchanged under torchrun or the orchestrator.

- gloo on CPU, nccl when CUDA is available (``--backend`` overrides);
- synthetic regression data, DistributedSampler with ``set_epoch``;
- a checkpoint after every epoch, and resume from it on restart
  (``TORCHELASTIC_RESTART_COUNT`` > 0 or an existing checkpoint);
- ``--crash-rank R --crash-epoch E`` makes rank R exit with ``--crash-code`` in epoch E, once
  per ``--crash-marker`` file (the fault-tolerance tests use it).

Rank 0 prints the loss each epoch and saves the final model as ``final.pt`` beside the
checkpoint; every rank prints a digest of its final weights, so a test can check that all
ranks end with the same model, bit for bit. A crashed-and-resumed run ends with the same
model up to float rounding: DDP regroups gradients after the first step of every process,
which changes gloo's summation order for four or more ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--checkpoint-dir", default=None,
                   help="default: ./checkpoints/$TORCHELASTIC_RUN_ID")
    p.add_argument("--epoch-sleep", type=float, default=0.0, help="seconds to sleep per epoch")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--crash-epoch", type=int, default=1)
    p.add_argument("--crash-code", type=int, default=13)
    p.add_argument("--crash-marker", default=None,
                   help="crash only if this file does not exist yet (then create it)")
    return p.parse_args()


def make_data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    true_w = torch.randn(16, 1, generator=g)
    y = x @ true_w + 0.01 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's elements in row-major order, the same as numpy's
    ``tobytes()``, but without numpy: torch does not depend on it. ``dense`` is a contiguous CPU
    tensor, so ``data_ptr()`` (which counts a view's storage offset) starts exactly
    ``numel * element_size`` bytes of its elements; the local name keeps that memory alive."""
    dense = t.detach().cpu().contiguous()
    size = dense.numel() * dense.element_size()
    return ctypes.string_at(dense.data_ptr(), size) if size else b""


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(tensor_bytes(p))
    return h.hexdigest()[:16]


def maybe_crash(args: argparse.Namespace, rank: int, epoch: int) -> None:
    if args.crash_rank != rank or args.crash_epoch != epoch:
        return
    if args.crash_marker:
        if os.path.exists(args.crash_marker):
            return
        with open(args.crash_marker, "w") as f:
            f.write(str(os.getpid()))
    print(f"rank {rank}: injected crash in epoch {epoch}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not sys.exit: the interpreter's shutdown with the gloo process group alive aborts now
    # and then (see the end of this file), and the crash is to be this exit code.
    os._exit(args.crash_code)


@record
def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt_dir = args.checkpoint_dir or os.path.join("checkpoints", run_id)
    ckpt_path = os.path.join(ckpt_dir, "checkpoint.pt")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    start_epoch = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at epoch {start_epoch} "
                  f"(restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)

    data = make_data(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        total, batches = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
            batches += 1
        maybe_crash(args, rank, epoch)
        dist.all_reduce(total)
        mean = total.item() / (batches * world)
        if rank == 0:
            print(f"epoch {epoch} loss {mean:.6f} world_size {world}", flush=True)
            os.makedirs(ckpt_dir, exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)  # a crash mid-save never leaves a torn checkpoint
        dist.barrier()
        if args.epoch_sleep:
            time.sleep(args.epoch_sleep)
    print(f"rank {rank} final weights {weights_digest(model)}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(ckpt_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13: DDP keeps the gloo process group alive past destroy_process_group, and its
    # worker threads may still be releasing the last collective's tensors when the interpreter
    # shuts down, which aborts the process (SIGABRT, 'terminate called without an active
    # exception'; pytorch/pytorch#190489, torchrun shows it too, ~1 run in 40 under load).
    # Exiting without the interpreter's shutdown, once everything is written, avoids it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
