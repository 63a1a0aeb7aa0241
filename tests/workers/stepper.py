"""Calls heartbeat(step, loss) STEPS times, STEP_SLEEP apart, printing nothing (the shim the
agent puts on PYTHONPATH: no orchestrator import), then waits for the agent's next look."""
import os
import time

import orchestrator_worker

steps = int(os.environ.get("STEPS", "20"))
for i in range(steps):
    orchestrator_worker.heartbeat(step=i, loss=1.0 / (i + 1))
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
time.sleep(1.5)
