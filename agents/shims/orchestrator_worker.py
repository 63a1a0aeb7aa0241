"""``heartbeat(step=None, total_steps=None, **metrics)``: a worker tells the orchestrator it
is alive, how far it got and, with ``total_steps``, how far it is going (status shows the
percentage and an ETA). The one implementation: ``orchestrator.heartbeat`` is this function,
and the agent puts this file on every worker's PYTHONPATH as ``orchestrator_worker`` for nodes
where the orchestrator is not installed (stdlib only, any Python 3).

It writes ``{"step": N, "total_steps": T, "metrics": {"name": number}}`` to
``$ORCHESTRATOR_HEARTBEAT_FILE`` (replaced atomically), or only touches it when called with
nothing; the node's agent reads the file once per heartbeat interval. A no-op when not run by
the orchestrator.
"""

import json
import os
import threading


def heartbeat(step=None, total_steps=None, **metrics):
    """Mark this worker alive, optionally with its step, the steps the run will take in all,
    and numeric metrics."""
    path = os.environ.get("ORCHESTRATOR_HEARTBEAT_FILE")
    if not path:
        return
    record = {"step": None if step is None else int(step),
              "metrics": {str(k): float(v) for k, v in metrics.items()}}
    if total_steps is not None:
        record["total_steps"] = int(total_steps)
    try:  # the orchestrator's bookkeeping never stops a training
        if step is None and total_steps is None and not metrics:
            open(path, "a").close()
            os.utime(path)
            return
        # Aside under a name of this thread's own (another thread may write the file too:
        # a save's step report), then renamed: the agent reads the record whole.
        tmp = "%s.%d-%d.tmp" % (path, os.getpid(), threading.get_ident())
        with open(tmp, "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass
