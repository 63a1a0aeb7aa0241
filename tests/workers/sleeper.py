"""Prints a line, then sleeps; optionally ignores SIGTERM and starts a daemonised grandchild."""
import os
import signal
import subprocess
import sys
import time

if os.environ.get("IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("SPAWN_GRANDCHILD"):
    # A child in its own session: outside the worker's process group.
    subprocess.Popen(["setsid", "sleep", "1000"], start_new_session=True)
print(f"rank {os.environ['RANK']} sleeping", flush=True)
for i in range(100000):
    time.sleep(0.5)
    if os.environ.get("CHATTY"):
        print(f"rank {os.environ['RANK']} tick {i}", flush=True)
sys.exit(0)
