"""PyTorch Lightning on the orchestrator's checkpoint store::

    from orchestrator.checkpoint_lightning import OrchestratorCheckpoint

    trainer = L.Trainer(strategy="ddp", ..., callbacks=[OrchestratorCheckpoint()])
    trainer.fit(model, train_loader)        # no ckpt_path: it resumes by itself

Why: Lightning's checkpoints go through files (``ModelCheckpoint``, ``ckpt_path``), written by
rank 0 alone, so jobs take one every so often and lose what came after. This callback saves
Lightning's whole checkpoint (weights, optimizers, lr schedulers, loops, callbacks' states,
precision plugin, datamodule) into ``orchestrator.checkpoint`` every ``every_n_train_steps``
optimizer steps, on every rank, at the cost of a memory copy; and at the start of ``fit`` it
restores the step every rank holds (docs/guides/checkpoints.md). Under plain ``torchrun`` the
same code reads and writes files in ``$ORCHESTRATOR_CHECKPOINT_DIR``, as the store does.

How, and which parts of Lightning (2.6) it relies on:

- **Saving, on every rank.** ``Strategy.save_checkpoint`` hands a checkpoint to its
  ``CheckpointIO`` on global rank 0 only (strategies/strategy.py:490), while the store keeps a
  copy per rank and resumes the newest step every rank holds. So the callback builds the dict
  itself in ``on_train_batch_end`` (where ``ModelCheckpoint(every_n_train_steps=...)`` saves,
  and which the loops' restart logic expects: loops/training_epoch_loop.py:168-210) with the
  function ``Trainer.save_checkpoint`` calls on every rank (``dump_checkpoint``,
  trainer/connectors/checkpoint_connector.py:415; trainer/trainer.py:1463), and saves it
  with ``orchestrator.checkpoint.save(trainer.global_step, ...)``.
- **Restoring, without a file.** ``fit(ckpt_path=...)`` cannot say "nothing to resume": what
  ``CheckpointIO.load_checkpoint`` returns must be a whole checkpoint (its version is read,
  utilities/migration/utils.py:164; its ``state_dict`` loaded, strategies/strategy.py:372),
  so the choice would be made before ``fit`` starts the process group (trainer.py:1033),
  where ranks cannot agree on it. Instead, in ``on_fit_start`` (process group up, model and
  optimizers set up) every rank calls ``orchestrator.checkpoint.load()`` together and hands
  the checkpoint to the trainer's checkpoint connector as Lightning does itself for
  strategies that restore after setup (trainer.py:1064-1072): weights, datamodule and
  callbacks there, then Lightning's own ``restore_training_state`` (precision, loops with the
  batch position, optimizers, lr schedulers) and ``resume_end``. Only the first ``fit`` of a
  process restores.
- **Mid-epoch** the fit loop resumes at the batch after the saved one, but the data do only
  where the train dataloader is stateful (``state_dict``/``load_state_dict``, such as
  torchdata's ``StatefulDataLoader``): Lightning keeps its state in the fit loop's
  (loops/fit_loop.py:522) and otherwise warns and starts the epoch's data again from its
  first batch (loops/training_epoch_loop.py:217-229).

What the store holds is data (no pickle). Numpy scalars become numbers and numeric numpy
arrays tensors; any other value that is not a tensor, dict, list, tuple, number, string,
boolean or None fails the save with a CheckpointError naming its key, except in the
hyper-parameters (``hyper_parameters``, ``hparams_name``, ``hparams_type`` and the
datamodule's): those come from the module's ``__init__`` again and are not read by a resume,
so such an entry is left out with one warning naming it.

Strategies: one device, or ``ddp`` (every rank holds the whole state). Sharded ones (FSDP,
DeepSpeed, model parallel) and ZeroRedundancyOptimizer are refused by name
(``orchestrator.checkpoint_dcp`` serves sharded state). Imports Lightning; nothing else in
the package does.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities.migration import migrate_checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from orchestrator import checkpoint
from orchestrator.checkpoint import CheckpointError

FORMAT = "lightning/1"  # the tree's own version, beside the store's format
_HPARAMS = frozenset(getattr(owner, f"CHECKPOINT_HYPER_PARAMS_{part}")
                     for owner in (pl.LightningModule, pl.LightningDataModule)
                     for part in ("KEY", "NAME", "TYPE"))
_LEFT_OUT = object()
_WHAT = "a tensor, dict, list, tuple, number, string, boolean or None"


class OrchestratorCheckpoint(Callback):
    """Saves Lightning's whole checkpoint into ``orchestrator.checkpoint`` every
    ``every_n_train_steps`` optimizer steps on every rank (the store's step is
    ``trainer.global_step``), and restores the step every rank holds at the start of the
    process's first ``fit``. ``restored_step``: the step restored, or None."""

    def __init__(self, every_n_train_steps: int = 1) -> None:
        if type(every_n_train_steps) is not int or every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be an integer of at least 1, not "
                             f"{every_n_train_steps!r}")
        self.every_n_train_steps = every_n_train_steps
        self.restored_step: int | None = None
        self._loaded = False
        self._last_saved: int | None = None
        self._warned: set[str] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_strategy(trainer.strategy)
        if self._loaded:
            return
        self._loaded = True
        restored = checkpoint.load()  # on every rank together: it agrees on the step
        if restored is None:
            return
        step, state = restored
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = _from_store(step, state)
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        # Lightning goes on with restore_training_state() and resume_end() (trainer.py:1070).
        self.restored_step = self._last_saved = step
        rank_zero_info(f"Restoring states from the orchestrator's checkpoint of step {step}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # A batch that only accumulated gradients did not step: nothing new to save.
        if step == 0 or step == self._last_saved or step % self.every_n_train_steps:
            return
        dump = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint.save(step, self._to_store(dump))
        self._last_saved = step

    def _to_store(self, dump: dict[str, Any]) -> dict[str, Any]:
        """The store's tree of Lightning's checkpoint ``dump``."""
        out: dict[str, Any] = {}
        for key, value in dump.items():
            if key in _HPARAMS:
                kept = self._hparams(key, value)
                if kept is not _LEFT_OUT:
                    out[key] = kept
            else:
                out[key] = _as_data(value, f"[{key!r}]")
        weights = dump.get("state_dict")
        metadata = getattr(weights, "_metadata", None)  # versions load_state_dict migrates by
        return {"format": FORMAT, "checkpoint": out,
                "state_dict_metadata": _as_data(metadata, "state_dict._metadata")
                if metadata is not None else None}

    def _hparams(self, key: str, value: Any) -> Any:
        """``value`` as data, its entries that are not data left out (``_LEFT_OUT``: all)."""
        if isinstance(value, Mapping):
            kept = {}
            for name, item in value.items():
                try:
                    kept[_as_data(name, f"[{key!r}]")] = _as_data(item, f"[{key!r}][{name!r}]")
                except CheckpointError:
                    self._leave_out(f"{key}[{name!r}]", item)
            return kept
        try:
            return _as_data(value, f"[{key!r}]")
        except CheckpointError:
            self._leave_out(key, value)
            return _LEFT_OUT

    def _leave_out(self, where: str, value: Any) -> None:
        if where not in self._warned:
            self._warned.add(where)
            rank_zero_warn(f"orchestrator checkpoint: {where} is of type {type(value).__name__}, "
                           "not data: left out of the checkpoints (a resume does not read it)")


def _check_strategy(strategy: Strategy) -> None:
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or \
            strategy.restore_checkpoint_after_setup:
        raise CheckpointError(
            f"OrchestratorCheckpoint saves every rank's whole state (one device, or 'ddp'); "
            f"{type(strategy).__name__} shards it: use orchestrator.checkpoint_dcp")
    for optimizer in strategy.optimizers:
        if hasattr(getattr(optimizer, "_optimizer", optimizer), "consolidate_state_dict"):
            raise CheckpointError(
                f"OrchestratorCheckpoint saves every rank's whole state; "
                f"{type(optimizer).__name__} shards the optimizer's")


def _as_data(value: Any, where: str) -> Any:
    """``value`` as the store holds it (dicts of any mapping, numpy as numbers and tensors);
    CheckpointError naming ``where`` when some part of it is not data."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, Mapping):
        return {_as_data(k, f"{where} (a key)"): _as_data(v, f"{where}[{k!r}]")
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_as_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    numpy = sys.modules.get("numpy")  # no numpy value exists where numpy was never imported
    if numpy is not None:
        if isinstance(value, numpy.generic) and value.dtype.kind in "biufc":
            return value.item()
        if isinstance(value, numpy.ndarray) and value.dtype.kind in "biufc":
            return torch.from_numpy(numpy.ascontiguousarray(value))
    raise CheckpointError(
        f"the Lightning checkpoint's {where} is of type {type(value).__name__}; the store holds "
        f"{_WHAT} (make it data in on_save_checkpoint, or leave it out)")


def _from_store(step: int, state: Any) -> dict[str, Any]:
    """Lightning's checkpoint from the store's tree (tensors on the CPU, as Lightning loads
    files with ``map_location="cpu"``)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"step {step} of the checkpoint store was not saved by "
                              f"OrchestratorCheckpoint (its format: {found!r})")
    loaded: dict[str, Any] = state["checkpoint"]
    weights: Any = collections.OrderedDict(loaded.get("state_dict", {}))
    metadata = state.get("state_dict_metadata")
    if metadata is not None:
        weights._metadata = collections.OrderedDict(metadata)
    loaded["state_dict"] = weights
    migrated, _ = migrate_checkpoint(loaded)
    return migrated


__all__ = ["FORMAT", "OrchestratorCheckpoint"]
