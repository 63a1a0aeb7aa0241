"""torch.distributed.checkpoint (DCP) on the checkpoint store (orchestrator/checkpoint_dcp.py):
a model and its optimizer saved with ``dcp.save`` (and ``dcp.async_save``) and loaded back in
place, in files (no agent) and in the agent's memory; and two gloo ranks, each with a value of
its own, a shared one and its shard of a DTensor, that get back what they saved, a rank's
copy holding only its own shard, and a load into another sharding refused by name."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from agents.shims import orchestrator_checkpoint as ckpt
from agents.shims import orchestrator_checkpoint_format as F
from orchestrator import checkpoint_dcp

# dcp.save and dcp.load without a process group say they assume a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STORE_ENV = (F.MEMORY_VAR, F.BUDGET_VAR, F.DIR_VAR, F.STEP_VAR, F.PERSIST_VAR, "RANK",
             "WORLD_SIZE")


@pytest.fixture
def files(tmp_path, monkeypatch):
    """No agent: rank 0's copies go to tmp_path/ck."""
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path / "ck"))
    monkeypatch.setenv("RANK", "0")
    return tmp_path / "ck"


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd,
            "extra": {"epoch": 3, "name": "run", "betas": (0.9, 0.99), "none": None,
                      "tags": {"a", "b"}}}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _scramble(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for per_param in opt.state.values():
        for v in per_param.values():
            v.zero_()
    opt.param_groups[0]["lr"] = 0.5


def test_a_model_and_its_optimizer_come_back_in_place_from_files(files):
    model, opt = _trained()
    state = _state(model, opt)
    want = _clone(state)
    dcp.save(state, storage_writer=checkpoint_dcp.StorageWriter(5))
    assert (files / "step-000000000005" / "rank-0.manifest").exists()
    # Stored as data: the non-tensor values too, but for the one only pickle describes.
    _, tree = ckpt.load()
    pickled = [e["fqn"] for e in tree["items"] if "bytes" in e]
    assert pickled == ["extra.tags"]
    assert any(e.get("value") == (0.9, 0.99) for e in tree["items"])

    _scramble(model, opt)
    target = _state(model, opt)
    target["extra"] = {"epoch": 0, "name": "", "betas": (0.0, 0.0), "none": 1,
                       "tags": set()}
    reader = checkpoint_dcp.StorageReader()
    assert reader.step == 5
    dcp.load(target, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    _same(_state(model, opt), want)
    _same(target["extra"], want["extra"])


def test_async_save_and_a_second_save_the_reader_resumes_the_newest(files):
    model, opt = _trained()
    dcp.save(_state(model, opt), storage_writer=checkpoint_dcp.StorageWriter(1))
    with torch.no_grad():
        model[0].weight.fill_(7.0)
    want = _clone(_state(model, opt))
    future = dcp.async_save(_state(model, opt), storage_writer=checkpoint_dcp.StorageWriter(2))
    future.result(timeout=60)  # type: ignore[union-attr]

    _scramble(model, opt)
    target = _state(model, opt)
    reader = checkpoint_dcp.StorageReader()
    dcp.load({"model": target["model"]}, storage_reader=reader)  # one reader, two loads
    dcp.load({"optim": target["optim"]}, storage_reader=reader)
    assert reader.step == 2
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    _same(_state(model, opt)["model"], want["model"])
    _same(_state(model, opt)["optim"], want["optim"])


def test_nothing_to_resume_and_a_copy_of_plain_save_are_said_so(files):
    reader = checkpoint_dcp.StorageReader()
    assert reader.step is None
    with pytest.raises(dcp.CheckpointException, match="no checkpoint to resume"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(2)}, storage_reader=reader)
    ckpt.save(4, {"w": torch.ones(2)})  # orchestrator.checkpoint.save, not DCP
    with pytest.raises(ckpt.CheckpointError, match="not written by checkpoint_dcp"):
        _ = checkpoint_dcp.StorageReader().step


def test_the_agents_memory_holds_the_save_and_the_load_reads_it(monkeypatch):
    memory = tempfile.mkdtemp(dir="/dev/shm", prefix="dcp-unit-")
    try:
        for name in STORE_ENV:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(F.MEMORY_VAR, memory)
        monkeypatch.setenv(F.BUDGET_VAR, str(1 << 30))
        monkeypatch.setenv("RANK", "0")
        model, opt = _trained()
        want = _clone(_state(model, opt))
        dcp.save(_state(model, opt), storage_writer=checkpoint_dcp.StorageWriter(11))
        assert os.path.exists(os.path.join(memory, "rank-0", "step-11.meta"))

        monkeypatch.setenv(F.STEP_VAR, "11")  # what the controller found every rank holding
        _scramble(model, opt)
        target = _state(model, opt)
        reader = checkpoint_dcp.StorageReader()
        dcp.load(target, storage_reader=reader)
        assert reader.step == 11
        set_state_dict(model, opt, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        _same(_state(model, opt), want)
    finally:
        ckpt.release()
        shutil.rmtree(memory, ignore_errors=True)


# --- two ranks ------------------------------------------------------------------------------

def _rank_main(rank: int, root: str, init: str) -> None:
    """One of two gloo ranks (a spawned process: its environment is its own)."""
    for name in STORE_ENV:
        os.environ.pop(name, None)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", F.DIR_VAR: root})
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(24.0).reshape(6, 4)
        state = {"shared": torch.linspace(0.0, 1.0, 7), "mine": torch.full((3,), rank + 0.5),
                 "note": f"rank {rank}", "sharded": distribute_tensor(full, mesh, [Shard(0)])}
        dcp.save(state, storage_writer=checkpoint_dcp.StorageWriter(3))

        target: dict[str, Any] = {
            "shared": torch.zeros(7), "mine": torch.zeros(3), "note": "",
            "sharded": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])}
        reader = checkpoint_dcp.StorageReader()
        assert reader.step == 3
        dcp.load(target, storage_reader=reader)
        assert torch.equal(target["shared"], torch.linspace(0.0, 1.0, 7))
        assert torch.equal(target["mine"], torch.full((3,), rank + 0.5))  # its own, not rank 0's
        assert target["note"] == f"rank {rank}"
        assert torch.equal(target["sharded"].to_local(), full[3 * rank:3 * rank + 3])

        # This rank's copy holds its own shard's bytes, not the whole tensor.
        _, tree = ckpt.load()
        shard = [e for e in tree["items"] if e["fqn"] == "sharded"]
        assert [(e["offsets"], list(e["data"].shape)) for e in shard] == [([3 * rank, 0], [3, 4])]

        # Another sharding needs the other rank's shard: refused, by name.
        whole = {"sharded": distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])}
        try:
            dcp.load(whole, storage_reader=reader)
        except dcp.CheckpointException as exc:  # a BaseException, with every rank's error
            assert "another rank saved it" in str(exc), exc
        else:
            raise AssertionError("a load into another sharding went through")
    finally:
        dist.destroy_process_group()
    # Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
    # (pytorch/pytorch#190489; README, "Failures, restarts and health"). A failure above
    # raised before this, and reaches the parent as the exception it was.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_gloo_ranks_each_get_back_their_own_state_and_shard(tmp_path, monkeypatch):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    root = str(tmp_path / "ck")
    context = mp.start_processes(_rank_main, args=(root, f"file://{tmp_path}/init"), nprocs=2,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish in 120 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert sorted(os.listdir(os.path.join(root, "step-000000000003"))) == [
        f"rank-{r}.{part}" for r in (0, 1) for part in ("data", "manifest", "meta")]
