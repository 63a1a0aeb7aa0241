"""For training scripts: tell the orchestrator you are making progress, and how far.

    orchestrator.heartbeat()                          # alive (keeps hang_timeout away)
    orchestrator.heartbeat(step=120, loss=0.83, tokens_per_s=51200.0)
    orchestrator.heartbeat(step=120, total_steps=10_000)   # and progress: percent, ETA

Each rank's last step and numeric metrics show in ``status`` (``ranks[].step``,
``ranks[].metrics``, ``ranks[].steps_per_s``), and the job's step, percentage and ETA in
``progress`` (orchestrator/progress.py). Cheap: one small file written (and renamed)
per call, read by the node's agent once per heartbeat interval and sent batched.

On nodes where this package is not installed, the agent puts the same function on every
worker's PYTHONPATH as ``orchestrator_worker`` (stdlib only)::

    import orchestrator_worker
    orchestrator_worker.heartbeat(step=i, loss=loss.item())

The file protocol, for any language: write ``{"step": N, "total_steps": T, "metrics":
{"name": number}}`` as JSON to the file named by ``$ORCHESTRATOR_HEARTBEAT_FILE`` (replace it
atomically; ``total_steps`` optional), or just touch it.
"""

from __future__ import annotations

from agents.shims.orchestrator_worker import heartbeat

__all__ = ["heartbeat"]
