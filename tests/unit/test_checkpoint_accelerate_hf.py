"""``checkpoint_accelerate`` and ``checkpoint_hf`` in one process, on the store's files (no
agent: ``$ORCHESTRATOR_CHECKPOINT_DIR``): what a save holds comes back into fresh objects;
the RNG states come back although a loaded copy's tensors are views into one buffer; a
mismatched accelerator or a foreign save is refused; the Trainer's resume directory holds its
own files, each only its own bytes, loadable as the Trainer loads them."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from orchestrator import checkpoint, checkpoint_accelerate
from orchestrator.checkpoint import CheckpointError


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    for name in ("ORCHESTRATOR_CHECKPOINT_MEMORY", "ORCHESTRATOR_CHECKPOINT_STEP", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_DIR", str(tmp_path / "ckpt"))


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_the_rng_states_come_back_from_a_loaded_copy():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    checkpoint.save(0, {"pad": torch.ones(3), "rng": checkpoint_accelerate.rng_state()})
    expected = draws()
    step, state = checkpoint.load()
    # Its own storage: set_rng_state reads a view's storage from its start.
    assert state["rng"]["cpu"].storage_offset() == 0
    checkpoint_accelerate.set_rng_state(state["rng"])
    assert (step, draws()) == (0, expected)


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def prepared(accelerator: Accelerator):
    accelerator.free_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=2,
                      shuffle=True)
    counter = Counter()
    accelerator._custom_objects.clear()
    accelerator.register_for_checkpointing(counter)
    return (*accelerator.prepare(model, optimizer, scheduler, data), counter)


def test_save_state_and_load_state_restore_what_accelerate_keeps():
    accelerator = Accelerator(cpu=True,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, scheduler, data, counter = prepared(accelerator)
    assert checkpoint_accelerate.load_state(accelerator) is None  # nothing saved yet
    for step, (x, y) in enumerate(data):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1
        checkpoint_accelerate.save_state(accelerator, step)
        if step == 4:
            break
    data.iteration = 3  # as after three epochs
    checkpoint_accelerate.save_state(accelerator, 5)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    expected = draws()

    model, optimizer, scheduler, data, counter = prepared(accelerator)
    assert checkpoint_accelerate.load_state(accelerator) == 5
    assert draws() == expected
    for name, value in weights.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moments)
    assert scheduler.get_last_lr() == pytest.approx([0.01 * 0.5 ** 2]) and counter.count == 5
    assert data.iteration == 3


def test_a_mismatched_accelerator_or_a_foreign_save_is_refused():
    accelerator = Accelerator(cpu=True)
    prepared(accelerator)
    checkpoint_accelerate.save_state(accelerator, 1)
    accelerator._custom_objects.clear()
    with pytest.raises(CheckpointError, match="step 1 holds 1 custom, this accelerator has 0"):
        checkpoint_accelerate.load_state(accelerator)
    checkpoint.save(2, {"model": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="step 2 was not saved by checkpoint_accelerate"):
        checkpoint_accelerate.load_state(accelerator)


def test_the_trainers_resume_directory_holds_its_files_each_with_its_own_bytes(tmp_path):
    from transformers import TrainingArguments
    from transformers.trainer_pt_utils import safe_globals

    from orchestrator.checkpoint_hf import _materialize

    model = torch.nn.Linear(256, 256)  # 257 KiB of weights, as much of momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpoint.save(3, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": None,
                        "trainer_state": {"global_step": 3, "log_history": [{"loss": 0.5}]},
                        "rng": checkpoint_accelerate.rng_state()})
    _, state = checkpoint.load()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    directory = _materialize(args, state)
    try:
        names = sorted(os.listdir(directory))
        assert names == ["optimizer.pt", "pytorch_model.bin", "rng_state.pth", "scheduler.pt",
                         "trainer_state.json"], names
        size = sum(p.numel() * 4 for p in model.parameters())
        for name in ("pytorch_model.bin", "optimizer.pt"):  # not the whole copy each
            assert size < os.path.getsize(os.path.join(directory, name)) < 1.2 * size, name
        loaded = torch.load(os.path.join(directory, "pytorch_model.bin"), weights_only=True)
        assert torch.equal(loaded["weight"], model.weight)
        with safe_globals():
            rng = torch.load(os.path.join(directory, "rng_state.pth"), weights_only=True)
        assert rng["numpy"][1].dtype == np.uint32 and rng["python"] == random.getstate()
    finally:
        shutil.rmtree(directory)
