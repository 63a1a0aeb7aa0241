"""Files the agent puts on every Python worker's PYTHONPATH: ``sitecustomize`` (stack hook,
straggler sampler, flight recorder dumps), ``orchestrator_worker`` (``heartbeat()``) and
``orchestrator_checkpoint`` (``save()``, ``load()``). They are data to the agent, which
writes their text (shipped with it, see agents.source) into its private directory; it imports
only the checkpoint format's stdlib half (agents/checkpoints.py)."""

from __future__ import annotations

import os

from agents import source

FILES = ("sitecustomize", "orchestrator_worker", "orchestrator_checkpoint",
         "orchestrator_checkpoint_format", "orchestrator_checkpoint_slots",
         "orchestrator_checkpoint_inflight")


def install(agent_dir: str) -> str:
    """Write the shims into ``<agent_dir>/pythonpath``; return that directory."""
    path = os.path.join(agent_dir, "pythonpath")
    os.makedirs(path, mode=0o700, exist_ok=True)
    for name in FILES:
        with open(os.path.join(path, f"{name}.py"), "w", encoding="utf-8") as f:
            f.write(source(f"agents.shims.{name}"))
    return path
