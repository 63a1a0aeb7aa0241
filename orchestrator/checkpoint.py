"""For training scripts: checkpoints kept in the memory of the node's agent, persisted in
the background, verified on load (docs/guides/checkpoints.md)::

    from orchestrator import checkpoint
    restored = checkpoint.load()            # (step, state) to resume, or None: start fresh
    if restored:
        step, state = restored
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
    ...
    checkpoint.save(step, {"model": model.state_dict(), "optim": opt.state_dict()},
                    every=100)          # every 100 steps, and where the controller asks

A save beside the training: ``checkpoint.save(step, state, wait=False)`` returns once the copy
is set up; call ``checkpoint.wait()`` before anything writes to the state (the optimizer's
step). The copy runs meanwhile on a thread (from a GPU, on a stream of its own).

On nodes where this package is not installed, the agent puts the same module on every
worker's PYTHONPATH as ``orchestrator_checkpoint``. Under plain ``torchrun`` the same calls
read and write files in ``$ORCHESTRATOR_CHECKPOINT_DIR``.
"""

from __future__ import annotations

from typing import Any

from agents.shims.orchestrator_checkpoint import CheckpointError, due, load, save, wait

__all__ = ["CheckpointError", "due", "load", "load_saved_by", "save", "wait"]


def load_saved_by(key: str, version: Any, writer: str) -> tuple[int, dict[str, Any]] | None:
    """``load()`` for a framework's saves, whose state holds ``{key: {"format": version}}``:
    None (start fresh), or ``(step, state)``; CheckpointError naming ``writer`` when the
    step every rank holds was saved by something else (checkpoint_accelerate, checkpoint_hf)."""
    restored = load()
    if restored is None:
        return None
    step, state = restored
    head = state.get(key) if isinstance(state, dict) else None
    if not isinstance(head, dict) or head.get("format") != version:
        raise CheckpointError(f"step {step} was not saved by {writer}")
    return step, state
