"""Hugging Face Accelerate on CPU that checkpoints every step through
``orchestrator.checkpoint_accelerate`` and resumes from ``load_state``. Deterministic: a seeded
shuffling sampler (accelerate's SeedableRandomSampler) with its own generator, dropout (torch's
RNG), AdamW and a StepLR, and an object registered for checkpointing; every one of them must
come back for the final state to equal that of a run that never failed.

Env: STEPS (default 12; 6 per epoch on 4 ranks); CRASH_AT / CRASH_RANK: in the first attempt,
that rank SIGKILLs itself right after saving that step; OUT: a directory where each rank
writes ``resumed-<attempt>-<rank>`` (the step it resumed, -1 for none) and ``final-<rank>.pt``.
"""
import os
import signal
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from orchestrator import checkpoint_accelerate


class Seen:
    """Samples this rank trained on: state kept through ``register_for_checkpointing``."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


accelerator = Accelerator(
    cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
rank, attempt = accelerator.process_index, os.environ["ORCHESTRATOR_ATTEMPT"]
out = os.environ["OUT"]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
g = torch.Generator().manual_seed(1)
# Its own generator: an iterator's start draws from it, not from torch's RNG (see
# checkpoint_accelerate: a resumed epoch's iterator starts after the RNG was restored).
data = DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)),
                  batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(2))
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
seen = Seen()
accelerator.register_for_checkpointing(seen)

done = checkpoint_accelerate.load_state(accelerator)
step = 0 if done is None else done + 1
with open(os.path.join(out, f"resumed-{attempt}-{rank}"), "w") as f:
    f.write(str(step - 1))
print(f"rank {rank} attempt {attempt} starts at step {step}", flush=True)

steps, per_epoch = int(os.environ.get("STEPS", "12")), len(data)
crash_at, crash_rank = int(os.environ.get("CRASH_AT", "-1")), int(os.environ.get("CRASH_RANK", "1"))
while step < steps:
    epoch, skip = divmod(step, per_epoch)
    data.set_epoch(epoch)
    for x, y in accelerator.skip_first_batches(data, skip) if skip else data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        seen.count += len(x)
        checkpoint_accelerate.save_state(accelerator, step)
        print(f"rank {rank} step {step} saved", flush=True)
        if attempt == "1" and step == crash_at and rank == crash_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
        if step >= steps:
            break

torch.save({"model": accelerator.unwrap_model(model).state_dict(), "seen": seen.count,
            "lr": scheduler.get_last_lr(), "rng": torch.rand(4)},
           os.path.join(out, f"final-{rank}.pt"))
accelerator.end_training()
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; as tests/workers/accelerate_train.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
