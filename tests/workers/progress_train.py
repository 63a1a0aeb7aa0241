"""Steps 0..STEPS-1, STEP_SLEEP apart, each given to heartbeat(step=...), and with
GIVE_TOTAL=1 also total_steps=STEPS (the shim: no orchestrator import). With FAIL_ONCE=PATH,
rank 1 exits 3 at step FAIL_AT (default 20) when PATH does not exist yet, making it first:
one failure, then the restarted job runs through."""
import os
import sys
import time

import orchestrator_worker

steps = int(os.environ.get("STEPS", "100"))
total = steps if os.environ.get("GIVE_TOTAL") == "1" else None
fail_once = os.environ.get("FAIL_ONCE")
fail_at = int(os.environ.get("FAIL_AT", "20"))
for i in range(steps):
    orchestrator_worker.heartbeat(step=i, total_steps=total)
    if fail_once and i == fail_at and os.environ["RANK"] == "1" and not os.path.exists(fail_once):
        open(fail_once, "w").close()
        sys.exit(3)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
time.sleep(1.0)  # the agent's next look sees the last step
