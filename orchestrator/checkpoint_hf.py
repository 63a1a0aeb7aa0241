"""The Hugging Face ``Trainer`` on the orchestrator's checkpoint store: a save every step at
the cost of a memory copy, resumed at the step every rank holds (docs/guides/checkpoints.md)::

    from orchestrator.checkpoint_hf import OrchestratorCheckpointCallback

    checkpoints = OrchestratorCheckpointCallback(every_n_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[checkpoints])
    trainer.train(resume_from_checkpoint=checkpoints.resume(trainer))   # a path, or None

**Saving** is the callback: at ``on_step_end`` of every ``every_n_steps``-th optimizer step
(after the optimizer and scheduler stepped and ``global_step`` counted it: trainer.py:1943-1957)
every rank gives ``orchestrator.checkpoint.save(global_step, ...)`` what ``_save_checkpoint``
writes (trainer.py:3363-3430): the model's state dict, the optimizer's, the scheduler's, the
``GradScaler``'s, the ``TrainerState`` (global_step, epoch, log history...: data, as
``save_to_json`` writes it) and this rank's RNG states (as ``_save_rng_state``, :3470), all as
data, no pickle.

**Resuming** goes through a directory, because the Trainer resumes only from one:
``train(resume_from_checkpoint=path)`` reads ``trainer_state.json`` to count the epochs and
batches done (``_init_training_state``, :1694-1711), skips those batches
(``_run_epoch``, :1850-1857), and loads the model, optimizer, scheduler, scaler and RNG
files from it (``_load_from_checkpoint`` :3610, ``_load_optimizer_and_scheduler`` :3894,
``_load_scaler`` :4001, ``_load_rng_state`` :3849). A callback alone cannot resume right: by
``on_train_begin`` the Trainer has already planned its epochs and data skip from a fresh
state. So ``resume(trainer)`` loads the step every rank holds (``checkpoint.load()``, which
agrees through ``torch.distributed``: call it on every rank) and writes it, in the
Trainer's own layout, into a directory in memory: ``$ORCHESTRATOR_CHECKPOINT_MEMORY`` (the
agent's, on /dev/shm, removed with it), else a new directory on /dev/shm. The Trainer reads
every file with ``torch.load(weights_only=True)``; the callback removes the directory at
the first step (everything has been read by then) or at the end of training.

Needs ``resume(trainer)`` to be called before ``train`` (it also binds the callback to the
trainer, for the scaler, and adds it to the trainer if ``callbacks=`` did not). Not
supported: DeepSpeed and FSDP (their state is sharded or kept by the engine). A log or
evaluation entry made at the very step of a save comes after ``on_step_end``: it is in the
next save's log history, not in that one's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.training_args import ParallelMode
from transformers.utils import WEIGHTS_NAME

from agents.shims import orchestrator_checkpoint_format as F
from orchestrator import checkpoint
from orchestrator.checkpoint import CheckpointError
from orchestrator.checkpoint_accelerate import numpy_state, rng_state

FORMAT = 1


class OrchestratorCheckpointCallback(TrainerCallback):
    """Saves the Trainer's state on every rank every ``every_n_steps`` optimizer steps;
    ``resume(trainer)`` gives ``train(resume_from_checkpoint=...)`` the step to resume."""

    def __init__(self, every_n_steps: int = 1) -> None:
        if type(every_n_steps) is not int or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer of at least 1, not "
                             f"{every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.trainer: Trainer | None = None
        self.resume_dir: str | None = None

    def resume(self, trainer: Trainer) -> str | None:
        """The directory to pass to ``trainer.train(resume_from_checkpoint=...)`` (the step
        every rank holds, written in the Trainer's layout), or None: start fresh."""
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise CheckpointError("checkpoint_hf does not support DeepSpeed or FSDP (their "
                                  "state is sharded or kept by their engine)")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        restored = checkpoint.load_saved_by("hf", FORMAT, "OrchestratorCheckpointCallback")
        if restored is None:
            return None
        step, state = restored
        self._remove()
        self.resume_dir = _materialize(trainer.args, state)
        return self.resume_dir

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if self.trainer is None:
            raise CheckpointError("call trainer.train(resume_from_checkpoint="
                                  "callback.resume(trainer)): the callback resumes through it")

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._remove()  # the Trainer has read every file of it by its first step

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps:
            return
        assert self.trainer is not None  # on_train_begin said so
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        checkpoint.save(state.global_step, {
            "hf": {"format": FORMAT},
            "model": kwargs["model"].state_dict(),
            "optimizer": kwargs["optimizer"].state_dict(),
            "scheduler": kwargs["lr_scheduler"].state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            "trainer_state": dataclasses.asdict(state),
            "rng": rng_state(),
        })

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
            self.resume_dir = None


def _materialize(args: TrainingArguments, state: dict[str, Any]) -> str:
    """The restored state as the files ``Trainer._save_checkpoint`` writes, in memory."""
    memory = os.environ.get(F.MEMORY_VAR)
    if memory:
        directory = os.path.join(memory, f"hf-resume-rank-{args.process_index}")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, mode=0o700)
    else:
        directory = tempfile.mkdtemp(prefix="orchestrator-hf-resume-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    for key, name in (("model", WEIGHTS_NAME), ("optimizer", OPTIMIZER_NAME),
                      ("scheduler", SCHEDULER_NAME), ("scaler", SCALER_NAME)):
        if state[key] is not None:
            torch.save(_own(state[key]), os.path.join(directory, name))
    rng = state["rng"]
    native: dict[str, Any] = {"python": rng["python"], "numpy": numpy_state(rng["numpy"]),
                              "cpu": rng["cpu"].clone()}
    if "cuda" in rng and torch.cuda.is_available():
        # As _save_rng_state: every device's state when distributed, else the current one's.
        native["cuda"] = [t.clone() for t in rng["cuda"]] \
            if args.parallel_mode == ParallelMode.DISTRIBUTED \
            else rng["cuda"][torch.cuda.current_device()].clone()
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    torch.save(native, os.path.join(directory, name))
    with open(os.path.join(directory, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(state["trainer_state"], indent=2, sort_keys=True) + "\n")
    return directory


def _own(tree: Any) -> Any:
    """``tree`` with each tensor copied out of the loaded copy's one buffer: ``torch.save``
    of a view writes the whole storage under it, every file the whole checkpoint."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _own(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_own(v) for v in tree)
    return tree


__all__ = ["CheckpointError", "OrchestratorCheckpointCallback"]
