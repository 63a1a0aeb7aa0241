"""Keeps its core busy for SPIN_SECONDS (default 60), calling heartbeat(step) about twice a
second: a worker of a node whose every core is taken (stdlib only)."""
import os
import time

import orchestrator_worker

end = time.monotonic() + float(os.environ.get("SPIN_SECONDS", "60"))
step = 0
next_beat = 0.0
while time.monotonic() < end:
    for _ in range(20000):
        pass
    if time.monotonic() >= next_beat:
        orchestrator_worker.heartbeat(step=step)
        step += 1
        next_beat = time.monotonic() + 0.5
