#!/usr/bin/env python3
"""Makes the README's dashboard screenshots from real jobs on this machine (local nodes).

    python examples/dashboard/screenshots.py [--out examples/dashboard]

1. ``job.png``: a 2x2 job reporting loss and tokens/s, whose rank 1 crashes at step 23 of
   attempt 1; attempt 2 resumes from the checkpoint at step 20.
2. ``hang.png``: a job where rank 3 never reaches the all_reduce the others wait in; with
   ``health.hang_timeout`` the stacks are taken before the workers stop, and diagnosed.

Needs chromium (headless) and torch. Jobs go to a fresh ORCHESTRATOR_HOME under /tmp.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "workers"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="orc-shots-"))
    os.environ["ORCHESTRATOR_HOME"] = str(home)
    import yaml

    import orchestrator

    def run(name: str, command: list[str], **extra: object) -> str:
        work = Path(tempfile.mkdtemp(prefix=f"orc-{name}-"))
        spec = {"name": name, "nodes": [{"host": "local"}, {"host": "local"}],
                "nproc_per_node": 2, "command": command, "workdir": str(work), **extra}
        (work / "job.yaml").write_text(yaml.safe_dump(spec))
        job_id = orchestrator.submit(work / "job.yaml")
        result = orchestrator.wait(job_id, timeout=300)
        print(f"{job_id}: {result['state']}", file=sys.stderr)
        return job_id

    trained = run("pretrain", [sys.executable, str(WORKERS / "trainer.py")], max_restarts=2,
                  health={"heartbeat_interval": 0.5},
                  env={"STEPS": "60", "CRASH_AT": "23", "STEP_SLEEP": "0.3"})
    hung = run("finetune", [sys.executable, str(WORKERS / "hang.py")],
               health={"hang_timeout": 8}, stop_grace_period=2)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A token of this run alone (in chromium's URL for a few seconds; the server goes after).
    token = secrets.token_urlsafe(32)
    server = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", str(port)],
                              env={**os.environ, "ORCHESTRATOR_UI_TOKEN": token},
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)
        for job_id, name, height in ((trained, "job.png", 1500), (hung, "hang.png", 1100)):
            subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", f"--window-size=1280,{height}",
                            "--virtual-time-budget=5000", f"--screenshot={args.out / name}",
                            f"http://127.0.0.1:{port}/jobs/{job_id}?token={token}"],
                           check=True, capture_output=True, timeout=60)
            print(args.out / name, file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
