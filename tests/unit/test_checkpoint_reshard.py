"""A DCP checkpoint loaded into another world size (orchestrator/checkpoint_reshard.py): real
gloo ranks in spawned processes, saving with one number of ranks and loading with another,
from the copies persisted in one directory (what a shared ``checkpoint.dir`` gives every
node). Before, a load into another world size failed ("another rank saved it"), or found
nothing to resume where a new rank had no copy of its own and the job started from scratch."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from agents.shims import orchestrator_checkpoint_format as F
from orchestrator import checkpoint_dcp

STORE_ENV = (F.MEMORY_VAR, F.BUDGET_VAR, F.DIR_VAR, F.STEP_VAR, F.PERSIST_VAR, "RANK",
             "WORLD_SIZE")
FULL = torch.arange(48.0).reshape(12, 4)  # 12 rows: shards of 6, 4 and 3 rows


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"shared": torch.linspace(0.0, 1.0, 7) + step,
            "mine": torch.full((3,), rank + 0.5 + step), "note": f"rank {rank} of {world}",
            "sharded": distribute_tensor(FULL + step, mesh, [Shard(0)])}


def _empty(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"shared": torch.zeros(7), "mine": torch.zeros(3), "note": "",
            "sharded": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)])}


def _loaded(rank: int, world: int, step: int, saved_by: int) -> None:
    """Load into ``world`` ranks what ``saved_by`` ranks saved at ``step``, and check it."""
    reader = checkpoint_dcp.StorageReader()
    assert reader.step == step, reader.step
    target = _empty(world)
    dcp.load(target, storage_reader=reader)
    rows = 12 // world
    assert torch.equal(target["sharded"].to_local(), (FULL + step)[rows * rank:rows * (rank + 1)])
    assert torch.equal(target["shared"], torch.linspace(0.0, 1.0, 7) + step)
    old = rank if rank < saved_by else 0  # a per-rank value: the same rank's, else rank 0's
    assert torch.equal(target["mine"], torch.full((3,), old + 0.5 + step)), target["mine"]
    assert target["note"] == f"rank {old} of {saved_by}", target["note"]


def _grow(rank: int, world: int) -> None:
    """3 ranks load step 3 of 2 (rank 2 holds no copy of its own), then save step 5."""
    _loaded(rank, world, 3, 2)
    dcp.save(_state(rank, world, 5), storage_writer=checkpoint_dcp.StorageWriter(5))


def _save(rank: int, world: int) -> None:
    dcp.save(_state(rank, world, 3), storage_writer=checkpoint_dcp.StorageWriter(3))


def _shrink(rank: int, world: int) -> None:
    _loaded(rank, world, 5, 3)


def _rank_main(rank: int, world: int, root: str, init: str,
               body: Callable[[int, int], None]) -> None:
    for name in STORE_ENV:
        os.environ.pop(name, None)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), F.DIR_VAR: root})
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        body(rank, world)
    finally:
        dist.destroy_process_group()
    # Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
    # (pytorch/pytorch#190489). A failure above reaches the parent as its exception.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(tmp_path, name: str, world: int, body: Callable[[int, int], None]) -> None:
    context = mp.start_processes(
        _rank_main, args=(world, str(tmp_path / "ck"), f"file://{tmp_path}/init-{name}", body),
        nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"{name}: the ranks did not finish in 120 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_a_dcp_save_loads_into_more_ranks_and_then_into_fewer(tmp_path, monkeypatch):
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    _run(tmp_path, "save", 2, _save)
    _run(tmp_path, "grow", 3, _grow)
    _run(tmp_path, "shrink", 2, _shrink)


def _unreadable(rank: int, world: int) -> None:
    try:
        checkpoint_dcp.StorageReader().step  # noqa: B018 (the load happens there)
    except checkpoint_dcp.CheckpointError as exc:
        assert "persisted in checkpoint.dir where every rank reads it" in str(exc), exc
    else:
        raise AssertionError("a step missing a rank's copy was loaded")


def test_a_save_of_another_world_size_missing_a_ranks_copy_is_refused_by_name(tmp_path,
                                                                              monkeypatch):
    """Rank 2 of 3's persisted copy is gone (a node's local disk): 2 ranks cannot load
    step 3 and say why, rather than start fresh."""
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    _run(tmp_path, "save", 3, _save)
    os.unlink(os.path.join(F.persisted_dir(str(tmp_path / "ck"), 3), "rank-2.manifest"))
    _run(tmp_path, "load", 2, _unreadable)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_single_process_reads_a_save_of_two_ranks(tmp_path, monkeypatch):
    """No process group (a script run alone, e.g. to evaluate): the two ranks' shards and
    rank 0's own values."""
    for name in STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    _run(tmp_path, "save", 2, _save)
    monkeypatch.setenv(F.DIR_VAR, str(tmp_path / "ck"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    reader = checkpoint_dcp.StorageReader()
    assert reader.step == 3
    target = {"shared": torch.zeros(7), "mine": torch.zeros(3), "note": "",
              "sharded": torch.zeros(12, 4)}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["sharded"], FULL + 3)
    assert torch.equal(target["mine"], torch.full((3,), 3.5)) and target["note"] == "rank 0 of 2"
