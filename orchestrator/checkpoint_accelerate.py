"""Hugging Face Accelerate on the orchestrator's checkpoint store: what
``accelerator.save_state()`` and ``accelerator.load_state()`` keep, saved every step at the
cost of a memory copy (docs/guides/checkpoints.md)::

    from orchestrator import checkpoint_accelerate

    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    step = checkpoint_accelerate.load_state(accelerator)    # the step restored, or None
    start = 0 if step is None else step + 1
    ...                                 # skip the batches of steps done (skip_first_batches)
        checkpoint_accelerate.save_state(accelerator, step)  # on every rank, every step

Why functions beside the accelerator, not its hooks: ``Accelerator.save_state`` always writes
its files into a directory (``save_accelerator_state``, accelerate/accelerator.py:3743, after
the hooks of ``register_save_state_pre_hook`` ran at :3740), and ``load_state`` reads one that
must exist (:3829); a hook can only add to that directory or take models out of it. So these
functions gather the same objects the accelerator keeps and give them to
``orchestrator.checkpoint.save`` as one tree of data; every rank keeps its own copy, and
``load_state`` restores the step every rank holds (it agrees through ``torch.distributed``:
call it on every rank).

What a save holds (as ``Accelerator.save_state``, accelerator.py:3697-3758, and
``save_accelerator_state``, accelerate/checkpointing.py:63-180), all as data, no pickle:

- each prepared model's state dict (``get_state_dict(model, unwrap=False)``, as :3713);
- each prepared optimizer's and scheduler's ``state_dict()``, and the ``GradScaler``'s;
- each prepared data loader's position where accelerate keeps one: its ``iteration`` (the
  epoch, data_loader.py:567), the ``SeedableRandomSampler``'s epoch and seed (:88-89), and a
  stateful loader's ``state_dict()``. Accelerate keeps no position inside an epoch for other
  loaders: skip the batches of the steps done with ``accelerator.skip_first_batches``. A
  ``DataLoader`` without a ``generator`` draws from torch's RNG each time an iterator starts
  (torch/utils/data/dataloader.py:690): a resumed epoch's starts after the RNG was restored,
  the uninterrupted run's before the save, so a mid-epoch resume replays dropout and the like
  exactly only with ``DataLoader(..., generator=torch.Generator().manual_seed(s))`` (as with
  ``accelerator.load_state``);
- every object given to ``register_for_checkpointing`` (its ``state_dict()``, data only);
- the RNG states of this rank (Python's, NumPy's, torch's CPU and CUDA/XPU ones) and the
  accelerator's gradient-accumulation ``step``, as checkpointing.py:155-178 keeps them.

Not supported: FSDP, DeepSpeed, Megatron-LM and XLA (their state is sharded or lives in the
engine: use ``orchestrator.checkpoint_dcp`` for FSDP2). Hooks registered with
``register_save_state_pre_hook``/``register_load_state_pre_hook`` are not called (they write
and read a directory; a line on stderr says so, once): register the state they keep with
``register_for_checkpointing`` instead.
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from orchestrator import checkpoint
from orchestrator.checkpoint import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

FORMAT = 1
_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
_warned: set[str] = set()


def save_state(accelerator: Accelerator, step: int) -> float:
    """Checkpoint what ``accelerator.save_state()`` would, as of ``step`` (the same on every
    rank; call it on every rank). Returns the seconds the training was held."""
    _check(accelerator)
    state = {
        "accelerate": {"format": FORMAT, "accumulation_step": accelerator.step},
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
        "optimizers": [o.state_dict() for o in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "dataloaders": [_dataloader_state(d) for d in accelerator._dataloaders],
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "rng": rng_state(),
    }
    return checkpoint.save(step, state)


def load_state(accelerator: Accelerator) -> int | None:
    """Restore, into the objects ``accelerator.prepare`` returned and those registered for
    checkpointing, the step every rank holds; that step, or None (nothing saved: start
    fresh). Call it on every rank, after ``prepare`` and ``register_for_checkpointing``."""
    _check(accelerator)
    restored = checkpoint.load_saved_by("accelerate", FORMAT, "checkpoint_accelerate.save_state")
    if restored is None:
        return None
    step, state = restored
    pairs = [(name, _match(step, name, state[name], mine)) for name, mine in (
        ("models", accelerator._models), ("optimizers", accelerator._optimizers),
        ("schedulers", accelerator._schedulers), ("dataloaders", accelerator._dataloaders),
        ("custom", accelerator._custom_objects))]
    for name, matched in pairs:
        for obj, saved in matched:
            if name == "dataloaders":
                _load_dataloader(obj, saved)
            else:
                obj.load_state_dict(saved)
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    accelerator.step = state["accelerate"]["accumulation_step"]
    return step


def _check(accelerator: Accelerator) -> None:
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise CheckpointError(f"checkpoint_accelerate does not support {kind} (its state is "
                              "sharded or kept by its engine)")
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        _say_once("the accelerator's save_state/load_state pre-hooks are not called (they "
                  "write and read a directory): what they keep is not in these checkpoints; "
                  "register it with accelerator.register_for_checkpointing(obj)")


def _match(step: int, name: str, saved: Any, mine: list[Any]) -> list[tuple[Any, Any]]:
    if not isinstance(saved, list) or len(saved) != len(mine):
        held = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(f"step {step} holds {held} {name}, this accelerator has "
                              f"{len(mine)}: prepare (and register) the same objects before "
                              "load_state")
    return list(zip(mine, saved, strict=True))


def _dataloader_state(loader: Any) -> dict[str, Any]:
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    out: dict[str, Any] = {"iteration": getattr(loader, "iteration", None)}
    sampler = get_sampler(loader) if hasattr(loader, "batch_sampler") else None
    if isinstance(sampler, SeedableRandomSampler):
        out["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
    if getattr(loader, "use_stateful_dataloader", False):
        out["state"] = loader.state_dict()
    return out


def _load_dataloader(loader: Any, saved: dict[str, Any]) -> None:
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    if saved.get("iteration") is not None and hasattr(loader, "iteration"):
        loader.iteration = saved["iteration"]
    sampler = get_sampler(loader) if hasattr(loader, "batch_sampler") else None
    if isinstance(sampler, SeedableRandomSampler) and "sampler" in saved:
        sampler.epoch = saved["sampler"]["epoch"]
        sampler.initial_seed = saved["sampler"]["initial_seed"]
    if "state" in saved and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(saved["state"])


# --- RNG states as data (also used by checkpoint_hf) --------------------------------------

def rng_state() -> dict[str, Any]:
    """This process's RNG states as data the store holds: Python's state is a tuple of ints,
    NumPy's array becomes an int64 tensor, torch's are tensors already."""
    version, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(version), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(gauss)),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        out["xpu"] = torch.xpu.get_rng_state_all()
    return out


def numpy_state(saved: Any) -> tuple[str, np.ndarray, int, int, float]:
    """NumPy's legacy state tuple back from what ``rng_state`` keeps."""
    version, keys, pos, has_gauss, gauss = saved
    return str(version), np.asarray(keys.numpy(), dtype=np.uint32), int(pos), int(has_gauss), \
        float(gauss)


def set_rng_state(saved: dict[str, Any]) -> None:
    """Put back what ``rng_state`` returned (device states only where the device is here).
    ``checkpoint.load()`` gives a small tensor storage of its own, as ``torch.set_rng_state``
    needs (it reads a view's storage from its start)."""
    random.setstate(saved["python"])
    np.random.set_state(numpy_state(saved["numpy"]))
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(saved["cuda"]))
    if "xpu" in saved and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_rng_state_all(list(saved["xpu"]))


def _say_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        sys.stderr.write(f"[orchestrator] checkpoint: {text}\n")
        sys.stderr.flush()


__all__ = ["CheckpointError", "load_state", "numpy_state", "rng_state", "save_state",
           "set_rng_state"]
