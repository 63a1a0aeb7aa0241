"""Lightning on the checkpoint store (orchestrator/checkpoint_lightning.py), in one process on
the CPU: a fit that dies right after the save of step K resumes, in a new Trainer and without
any ckpt_path, at step K + 1 with the data, the epoch and the batch where they were, and ends
with the weights of a fit that never died; from files (no agent: the plain-torchrun
fallback) and from a memory copy (as under an agent). Saves every n optimizer steps (not on
batches that only accumulate); hyper-parameters that are not data are left out with one
warning naming them; any other value that is not data fails the save naming its key; a copy
the callback did not write, and a sharded strategy, are refused."""

from __future__ import annotations

import os
import shutil
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from agents.shims import orchestrator_checkpoint_format as F
from orchestrator import checkpoint
from orchestrator.checkpoint_lightning import OrchestratorCheckpoint, _check_strategy

PER_EPOCH, EPOCHS = 4, 3
STORE_ENV = (F.MEMORY_VAR, F.BUDGET_VAR, F.DIR_VAR, F.STEP_VAR, F.PERSIST_VAR, "RANK",
             "WORLD_SIZE")


@pytest.fixture
def store(tmp_path, monkeypatch):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path / "ck"))
    monkeypatch.setenv(F.KEEP_VAR, "100")  # every step kept: the tests list them
    monkeypatch.setenv("RANK", "0")
    return tmp_path / "ck"


class Batches:
    """Resumable: how many batches it served is its state (global index i: seed i)."""

    def __init__(self) -> None:
        self.served = 0

    def __len__(self) -> int:
        return PER_EPOCH

    def __iter__(self):
        for _ in range(self.served % PER_EPOCH, PER_EPOCH):
            index = self.served
            g = torch.Generator().manual_seed(index)
            self.served += 1
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            yield torch.tensor(index), x, y

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


class Died(Exception):
    pass


class Tiny(L.LightningModule):
    def __init__(self, die_at: int = -1, **hparams) -> None:
        super().__init__()
        if hparams:
            self.save_hyperparameters(hparams)
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 4)
        self.die_at = die_at
        self.seen: list[tuple[int, int, int, int]] = []  # step, epoch, batch, data index

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.append((self.trainer.global_step + 1, self.current_epoch, batch_idx,
                          int(index)))
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == self.die_at:
            raise Died()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(model: Tiny, *callbacks, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(**{"accelerator": "cpu", "devices": 1, "max_epochs": EPOCHS,
                           "logger": False, "enable_checkpointing": False,
                           "enable_progress_bar": False, "enable_model_summary": False,
                           "callbacks": list(callbacks), **trainer_args})
    try:
        trainer.fit(model, Batches())
    except Died:
        pass
    return trainer


def expected(steps: range) -> list[tuple[int, int, int, int]]:
    return [(s, (s - 1) // PER_EPOCH, (s - 1) % PER_EPOCH, s - 1) for s in steps]


@pytest.mark.parametrize("where", ["files", "memory"])
@pytest.mark.parametrize("died_at", [6, 8])  # mid-epoch; the last batch of an epoch
def test_a_fit_resumes_at_the_step_it_saved_with_the_data_where_they_were(
        store, tmp_path, monkeypatch, where, died_at):
    if where == "memory":  # as under an agent: a copy in memory, the step it agreed on
        (tmp_path / "mem").mkdir(mode=0o700)  # the agent makes its memory, never a worker
        monkeypatch.setenv(F.MEMORY_VAR, str(tmp_path / "mem"))
    total = PER_EPOCH * EPOCHS
    never_died = Tiny()
    fit(never_died)
    assert never_died.seen == expected(range(1, total + 1))

    first = Tiny(die_at=died_at)
    fit(first, OrchestratorCheckpoint())
    assert first.seen == expected(range(1, died_at + 1))
    if where == "memory":
        assert not store.exists()
        monkeypatch.setenv(F.STEP_VAR, str(died_at))
    else:
        assert sorted(os.listdir(store)) == [f"step-{s:012d}" for s in range(1, died_at + 1)]

    callback = OrchestratorCheckpoint()
    second = Tiny()
    trainer = fit(second, callback)
    assert callback.restored_step == died_at
    assert second.seen == expected(range(died_at + 1, total + 1))
    assert trainer.global_step == total and trainer.current_epoch == EPOCHS
    for name, value in never_died.state_dict().items():
        assert torch.equal(second.state_dict()[name], value), name


def test_saves_every_n_optimizer_steps_and_none_on_a_batch_that_only_accumulates(store):
    # 12 batches, a step every 2: steps 1..6, saved at 3 and 6.
    fit(Tiny(), OrchestratorCheckpoint(every_n_train_steps=3), accumulate_grad_batches=2)
    assert sorted(os.listdir(store)) == ["step-000000000003", "step-000000000006"]
    step, state = checkpoint.load()
    assert step == 6 and state["checkpoint"]["global_step"] == 6
    # Step 3 is as its stepping batch (the 6th) left it: the 7th, which only accumulated
    # gradients, did not overwrite it.
    shutil.rmtree(store / "step-000000000006")
    step, state = checkpoint.load()
    fit_loop = state["checkpoint"]["loops"]["fit_loop"]
    assert step == 3 and fit_loop["state_dict"]["combined_loader"] == [{"served": 6}]
    assert fit_loop["epoch_loop.batch_progress"]["total"]["processed"] == 6
    with pytest.raises(ValueError, match="every_n_train_steps"):
        OrchestratorCheckpoint(every_n_train_steps=0)


def test_hyper_parameters_that_are_not_data_are_left_out_with_one_warning(store):
    model = Tiny(lr=np.float64(0.5), layers=np.int64(3), act=torch.nn.ReLU(), name="tiny")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, OrchestratorCheckpoint(), max_epochs=1)
    about = [str(w.message) for w in caught if "orchestrator checkpoint" in str(w.message)]
    assert about == ["orchestrator checkpoint: hyper_parameters['act'] is of type ReLU, not data: "
                     "left out of the checkpoints (a resume does not read it)"], about
    _, state = checkpoint.load()
    hparams = state["checkpoint"]["hyper_parameters"]
    assert hparams == {"lr": 0.5, "layers": 3, "name": "tiny"}
    assert type(hparams["lr"]) is float and type(hparams["layers"]) is int


def test_any_other_value_that_is_not_data_fails_the_save_naming_its_key(store):
    class Extra(Tiny):
        def on_save_checkpoint(self, checkpoint) -> None:
            checkpoint["extra"] = {"counts": np.arange(3), "when": object()}

    with pytest.raises(checkpoint.CheckpointError,
                       match=r"checkpoint's \['extra'\]\['when'\] is of type object; the store"):
        fit(Extra(), OrchestratorCheckpoint())


def test_a_copy_the_callback_did_not_save_and_a_sharded_strategy_are_refused(store):
    checkpoint.save(4, {"model": Tiny().state_dict()})
    with pytest.raises(checkpoint.CheckpointError,
                       match="step 4 of the checkpoint store was not saved by "
                             "OrchestratorCheckpoint"):
        fit(Tiny(), OrchestratorCheckpoint())
    with pytest.raises(checkpoint.CheckpointError, match="FSDPStrategy shards it"):
        _check_strategy(FSDPStrategy())
