"""A small DDP-style training (gloo) that checkpoints every step through
``orchestrator_checkpoint`` (the shim the agent puts on PYTHONPATH) and resumes from
``load()``. Deterministic: step s's data comes from seed s, so the final weights equal those of
a run that never failed when no step is lost or done twice with other weights.

Env: STEPS (default 12); CRASH_AT / CRASH_RANK: in the first attempt, that rank SIGKILLs
itself right after saving that step; STATE_MB: extra state per rank (a tensor of that size);
OUT: a directory where each rank writes ``final-<rank>.pt`` and ``resumed-<attempt>-<rank>``;
STEP_SLEEP: seconds each step sleeps (default 0.05), STEP_SLEEP_LATER: in later attempts (a
resumed run has only to finish: the tests that wait out a scheduler's notice need long first
attempts); STAMPS: print the wall clock at the kill and at the first step after a resume
(benchmarks);
POISON_AT: in the first attempt (every attempt, with POISON_ALWAYS=1), the weights turn NaN
at that step and are saved so (a copy that verifies but is bad), then every rank raises the
error a NaN model raises, as it does right after loading that copy again.
BACKGROUND=1: each save goes on beside the training (``save(..., wait=False)``), waited for
before the next optimizer step changes the weights; a CRASH_AT kill then comes while that
step's copy may still be under way.
"""
import os
import signal
import time

import orchestrator_checkpoint as ckpt
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = os.environ["ORCHESTRATOR_ATTEMPT"]
out = os.environ["OUT"]
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
extra = torch.zeros(int(float(os.environ.get("STATE_MB", "0")) * (1 << 20)) // 4)

def healthy(model):
    """Raises the same error, at the same line, whenever the weights are NaN."""
    if any(torch.isnan(p).any() for p in model.parameters()):
        raise FloatingPointError("the model's weights are NaN")


background = os.environ.get("BACKGROUND") == "1"
step_sleep = float(os.environ.get("STEP_SLEEP", "0.05"))
if attempt != "1":
    step_sleep = float(os.environ.get("STEP_SLEEP_LATER", step_sleep))
start = 0
restored = ckpt.load()
if restored is not None:
    step, state = restored
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    assert state["step"] == step and state["rank"] == rank, (state["step"], state["rank"])
    healthy(model)
    start = step + 1
with open(os.path.join(out, f"resumed-{attempt}-{rank}"), "w") as f:
    f.write(str(start - 1))
print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)

for step in range(start, int(os.environ.get("STEPS", "12"))):
    g = torch.Generator().manual_seed(step * world + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    if background:
        ckpt.wait()  # the last save's copy done before the weights change
    opt.step()
    poisoned = (attempt == "1" or os.environ.get("POISON_ALWAYS") == "1") and \
        step == int(os.environ.get("POISON_AT", "-1"))
    if poisoned:
        with torch.no_grad():
            model.weight.fill_(float("nan"))
    if restored is not None and step == start and os.environ.get("STAMPS"):
        print(f"rank {rank} trains again at {time.time()}", flush=True)
    blocked = ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                               "step": step, "rank": rank, "extra": extra},
                        wait=not background)
    print(f"rank {rank} step {step} saved in {blocked * 1000:.1f} ms", flush=True)
    if poisoned:
        healthy(model)
    if attempt == "1" and step == int(os.environ.get("CRASH_AT", "-1")) and \
            rank == int(os.environ.get("CRASH_RANK", "1")):
        if os.environ.get("STAMPS"):
            print(f"rank {rank} killing at {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(step_sleep)
torch.save(model.state_dict(), os.path.join(out, f"final-{rank}.pt"))
dist.barrier()
