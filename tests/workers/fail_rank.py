"""Rank FAIL_RANK prints to stderr and exits FAIL_CODE after a short delay; others wait."""
import os
import sys
import time

rank = int(os.environ["RANK"])
if rank == int(os.environ.get("FAIL_RANK", "1")):
    time.sleep(float(os.environ.get("FAIL_AFTER", "0.5")))
    print(f"rank {rank} is about to fail", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("FAIL_CODE", "7")))
print(f"rank {rank} waiting in a 'collective'", flush=True)
time.sleep(600)
