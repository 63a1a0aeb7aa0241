"""Hugging Face Accelerate on CPU, as a user writes it for torchrun: Accelerator(), prepare,
backward, step. Prints what Accelerate made of the world and a digest of the weights."""
import hashlib
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
state = accelerator.state
backend = getattr(state, "backend", None) or torch.distributed.get_backend()
print(f"ACCELERATE rank={accelerator.process_index} world={accelerator.num_processes} "
      f"local={accelerator.local_process_index} type={state.distributed_type.value} "
      f"backend={backend} weights={digest} pid={os.getpid()}", flush=True)
accelerator.end_training()  # as Accelerate's docs end a script
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; README, "Failures, restarts and health").
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
