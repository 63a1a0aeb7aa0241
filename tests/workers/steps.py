"""Prints numbered step lines at a steady pace (stdlib only, never imports torch).

STEPS (default 40) lines ``step <rank> <i>`` on stdout, STEP_SLEEP seconds apart (default
0.1), then ``steps <rank> done``. With GO_FILE, it first prints ``rank <r> waiting`` and
waits for that file to exist; then, with FLOOD_LINES, it prints that many lines
``flood <rank> <i>`` as fast as it can before its steps.
"""

import os
import sys
import time

rank = os.environ["RANK"]
go = os.environ.get("GO_FILE")
if go:
    print(f"rank {rank} waiting", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
flood = int(os.environ.get("FLOOD_LINES", "0"))
for start in range(0, flood, 4096):
    sys.stdout.write("".join(f"flood {rank} {i}\n" for i in range(start, min(flood, start + 4096))))
sys.stdout.flush()
pause = float(os.environ.get("STEP_SLEEP", "0.1"))
for i in range(int(os.environ.get("STEPS", "40"))):
    print(f"step {rank} {i}", flush=True)
    time.sleep(pause)
print(f"steps {rank} done", flush=True)
