"""A worker whose descendant tries every way out: it double-forks, leaves the session
(setsid), clears its environment (env -i: no job id, no agent token) and ignores SIGTERM and
SIGHUP. It records its pid in $ESCAPE_DIR/<attempt>-<rank>.pid. The worker ignores SIGTERM
too, and with EXIT_AFTER=N exits N once every rank's escapee of the attempt is recorded (a
failure; not before, or the job's failure would stop ranks whose escapee is yet to start,
and a test could not count them)."""
import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = os.path.join(os.environ["ESCAPE_DIR"],
                      f"{os.environ['ORCHESTRATOR_ATTEMPT']}-{os.environ['RANK']}.pid")
inner = f'trap "" TERM HUP; echo $$ > {record}.tmp; mv {record}.tmp {record}; exec sleep 1001'
# The intermediate shell exits at once: the escapee's parent is gone (a double fork).
subprocess.run(["/bin/sh", "-c", 'setsid env -i /bin/sh -c "$0" </dev/null >/dev/null 2>&1 &',
                inner], check=True)
while not os.path.exists(record):
    time.sleep(0.05)
print(f"rank {os.environ['RANK']} escaped", flush=True)
if os.environ.get("EXIT_AFTER"):
    prefix = f"{os.environ['ORCHESTRATOR_ATTEMPT']}-"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(
            name.startswith(prefix) and name.endswith(".pid")
            for name in os.listdir(os.environ["ESCAPE_DIR"])) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    sys.exit(int(os.environ["EXIT_AFTER"]))
while True:
    time.sleep(0.5)
