"""A pretend training run (stdlib only): resumes from the step in CKPT_FILE, reports
heartbeat(step, loss=..., tokens_per_s=...) each step, and rank 0 saves the step every 5 steps.
With CRASH_AT, rank CRASH_RANK (default 1) exits with code 3 at that step of the first attempt;
SAY is printed first."""
import math
import os
import sys
import time

import orchestrator_worker

rank = int(os.environ["RANK"])
ckpt = os.environ.get("CKPT_FILE", "ckpt.txt")
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
crash_at = os.environ.get("CRASH_AT")
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if os.environ.get("SAY"):
    print(os.environ["SAY"], flush=True)
for step in range(start, int(os.environ.get("STEPS", "30"))):
    if (crash_at is not None and first_attempt and step == int(crash_at)
            and rank == int(os.environ.get("CRASH_RANK", "1"))):
        print(f"rank {rank}: CUDA error: an illegal memory access at step {step}",
              file=sys.stderr, flush=True)
        sys.exit(3)
    loss = 2.0 * math.exp(-step / 12) + 0.05 * math.sin(step + rank)
    orchestrator_worker.heartbeat(step=step, loss=loss, tokens_per_s=1000.0 + 10 * rank)
    print(f"rank {rank} step {step} loss {loss:.4f}", flush=True)
    if rank == 0 and step % 5 == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(ckpt + ".tmp", ckpt)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.2")))
print(f"rank {rank} done", flush=True)
time.sleep(1.0)  # the agent's next look sees the last step
