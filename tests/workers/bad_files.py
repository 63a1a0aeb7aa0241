"""Each rank puts something the agent cannot use where its heartbeat file is (what, by RANK:
see KINDS), then calls heartbeat(step=7, loss=0.25) as usual; rank 5 also puts a FIFO where
torch's error file goes. The agent must take none of it as its own problem."""
import json
import os
import time

import orchestrator_worker

path = os.environ["ORCHESTRATOR_HEARTBEAT_FILE"]
rank = int(os.environ["RANK"])


def write(data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


KINDS = [
    lambda: write(b"[" * 10_000),  # deeper than the parser goes
    lambda: write(b'\xff\xfe{"step": 1}'),  # not UTF-8
    lambda: orchestrator_worker.heartbeat(step=3, **{f"m{i}": i for i in range(300)}),
    lambda: write(json.dumps({"step": 1, "metrics": [1, 2]}).encode()),
    lambda: write(b'{"step": "x", "metrics": {"big": 1' + b"0" * 400 + b"}}"),
    lambda: (os.unlink(path) if os.path.exists(path) else None, os.mkfifo(path)),
    lambda: write(b'{"step": 1, "pad": "' + b"x" * 1_000_000 + b'"}'),
    lambda: write(b'{"step": 1, "metrics": {"loss": NaN, "lr": Infinity}}'),
]
KINDS[rank]()
time.sleep(2.0)  # the agent looks every heartbeat_interval
if rank == 5:
    os.unlink(path)
    os.mkfifo(os.environ["TORCHELASTIC_ERROR_FILE"])
orchestrator_worker.heartbeat(step=7, loss=0.25)
time.sleep(2.0)
print("done", rank, flush=True)
