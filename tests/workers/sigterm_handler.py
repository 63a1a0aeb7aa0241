"""A worker that handles SIGTERM itself (as a script that saves on preemption does): on
SIGTERM it writes ``$OUT/handled-<rank>`` and exits 0. Until then it prints ``ready`` and
waits."""
import os
import signal
import sys
import time

rank = os.environ["RANK"]


def handled(signum, frame):
    with open(os.path.join(os.environ["OUT"], f"handled-{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(0)


signal.signal(signal.SIGTERM, handled)
print(f"rank {rank} ready", flush=True)
while True:
    time.sleep(0.1)
