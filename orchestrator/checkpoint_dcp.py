"""``torch.distributed.checkpoint`` (DCP) on the orchestrator's checkpoint store::

    import torch.distributed.checkpoint as dcp
    from orchestrator import checkpoint_dcp

    reader = checkpoint_dcp.StorageReader()
    if reader.step is not None:                 # the step load() chose; None: start fresh
        dcp.load(state_dict, storage_reader=reader)     # in place, as DCP loads
    ...
    dcp.save(state_dict, storage_writer=checkpoint_dcp.StorageWriter(step))
    # or dcp.async_save(state_dict, storage_writer=checkpoint_dcp.StorageWriter(step))

Why: a job that already keeps its state as DCP state dicts (FSDP2/DTensor shards, or
``torch.distributed.checkpoint.state_dict.get_state_dict``) gets the store's checkpoints
(a copy in the node's memory that outlives the worker, persisted and verified by the agent,
resumed at the step every rank holds) without changing how it builds and loads that state.

How: one ``orchestrator.checkpoint.save(step, tree)`` per rank, made by that rank's
``write_data``. The tree (data, no pickle) is::

    {"dcp": {"format": 1, "version": ..., "save_id": ..., "planner_data": ...},
     "items": [{"fqn": ..., "offsets": [...], "size": [...], "dtype": ..., "requires_grad": ...,
                "data": <the chunk's tensor>},       # a tensor, or this rank's shard of one
               {"fqn": ..., "value": <int, str, list, dict...>},   # a non-tensor, as data
               {"fqn": ..., "bytes": <uint8 tensor>}]}           # one that is not plain data

- **Each rank writes every item of its own local plan.** DCP's coordinator keeps one writer
  for each replicated item (a DDP model's tensors, a Replicate DTensor), but ``load()``
  restores a rank only its own copy, so every rank keeps its own: for DDP that is what a plain
  ``save`` stores too, and a value that differs per rank under one name (an RNG state, a
  data-loader position) comes back to the rank that saved it. A DTensor/FSDP2 rank stores only
  its local shard's bytes.
- **The Metadata, without pickle.** Each rank's copy describes its own chunks (fqn, global
  size, dtype, offsets and sizes) and the planner's key mappings, as data. The reader builds
  DCP's global ``Metadata`` from the copies of every rank (one ``all_gather_object`` when
  ``torch.distributed`` is initialized, beside the ones ``load()`` makes): the same chunks the
  coordinator's Metadata listed at the save. No rank's copy holds every rank's chunk list
  (for FSDP that list grows with ranks times tensors), and nothing depends on rank 0's copy.
- **Non-tensor values** (BYTE_IO items: DCP's planner pickles them with ``torch.save``) are
  kept as data where they are plain ints, floats, strings, booleans, None, lists, tuples and
  dicts of them and the planner is DCP's default one (whose bytes are ``torch.save`` of the
  value); the reader hands the planner ``torch.save`` of that value, as DCP's own storage would.
  Any other value is kept as the bytes DCP made; loading it unpickles it
  (``DefaultLoadPlanner.load_bytes`` does so with ``weights_only=False``), as it does from any
  DCP storage: it is the job's own data, written by its own ranks.
- **Load** calls ``orchestrator.checkpoint.load()`` once per reader (reuse one reader for
  several ``dcp.load`` calls), and serves each read from the restored tensors, narrowed to
  the read's offsets and lengths as ``FileSystemReader`` does.

- **Another world size** (the save's is in its head): the shards come from every old rank's
  persisted copy, read where this rank reads ``checkpoint.dir`` (orchestrator/
  checkpoint_reshard.py).

Limits: with the world size of the save, a rank reads only its own copy, so loading needs the
same sharding as the save (a read of a chunk another rank saved fails, naming it; DCP raises
such errors, as every other, as ``dcp.CheckpointException``, a BaseException). ``dcp.load`` must be
called on every rank of the job (``load()`` agrees on the step across the default process
group), and ``reader.step`` too where it is used. DCP's plan caching
(``DefaultSavePlanner(enable_plan_caching=True)``) is not supported. ``dcp.async_save``
works (DCP stages a CPU copy, then saves in a thread); with the agent's memory store a plain
``dcp.save`` already holds the training only for the copy into memory.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from orchestrator.checkpoint import CheckpointError, load, save
from orchestrator.checkpoint_reshard import Resharded, reshard, saved_world, world

__all__ = ["StorageReader", "StorageWriter"]

FORMAT = 1  # of the tree below "dcp" and "items"
DCP_VERSION = "1.0.0"  # the Metadata version DCP's own FileSystemWriter writes

_Key = tuple[str, tuple[int, ...] | None]  # (fqn, chunk offsets), offsets None for bytes
_SCALARS = (type(None), bool, int, float, str)


def _plain_key(key: object) -> bool:
    return type(key) in _SCALARS or (type(key) is tuple and all(_plain_key(k) for k in key))


def _plain(value: object) -> bool:
    """Whether ``value`` is data the store keeps exactly (types included): no subclasses,
    no tensors, nothing that would need pickle to come back as it went."""
    try:
        kind = type(value)
        if kind in _SCALARS:
            return True
        if kind is list or kind is tuple:
            return all(_plain(v) for v in value)  # type: ignore[attr-defined]
        if kind is dict:
            return all(_plain_key(k) and _plain(v)
                       for k, v in value.items())  # type: ignore[attr-defined]
    except RecursionError:
        pass
    return False


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a DCP checkpoint names an unknown dtype {name!r}")
    return dtype


def _size(values: object) -> torch.Size:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise CheckpointError(f"a DCP checkpoint holds a malformed size {values!r}")
    return torch.Size(values)


# --- save ---------------------------------------------------------------------------------

class StorageWriter(_storage.StorageWriter):
    """DCP's ``storage_writer`` for ``orchestrator.checkpoint.save(step, ...)``: every rank
    stores its own items (its shards, its copy of replicated ones) and a description of them
    as one save of ``step`` (an int, the same on every rank)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        if type(step) is not int or step < 0:
            raise CheckpointError(f"step must be a non-negative integer, not {step!r}")
        self.step = step
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = False
        self._local: SavePlan | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save; a ``checkpoint_id`` given to ``dcp.save`` is the step, as digits."""
        if checkpoint_id is not None:
            text = os.fspath(checkpoint_id)
            if not text.isdigit():
                raise CheckpointError("checkpoint_id is the step to save (an integer), "
                                      f"not {text!r}")
            self.step = int(text)
        self.save_id = str(uuid.uuid4())
        self._local = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if isinstance(rank, int) else 0

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step), save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable:
            raise CheckpointError("DCP's plan caching (enable_plan_caching=True) is not "
                                  "supported by checkpoint_dcp.StorageWriter")
        self._local = plan  # before the coordinator dedups it: this rank writes all of it
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        local = self._local.items if self._local is not None else []
        items = {i.index: i for i in local}
        for item in plan.items:  # a custom planner's global plan may add or change items
            items[item.index] = item
        planner_data = self._local.planner_data if self._local is not None else None
        if planner_data is not None and not _plain(planner_data):
            raise CheckpointError(f"the save planner's planner_data (a "
                                  f"{type(planner_data).__name__}) is not plain data: "
                                  "checkpoint_dcp stores no pickle")
        default = (getattr(type(planner), "resolve_data", None) is DefaultSavePlanner.resolve_data
                   and getattr(type(planner), "transform_object", None)
                   is DefaultSavePlanner.transform_object)
        entries: list[dict[str, Any]] = []
        position: dict[Any, int] = {}
        for index, item in items.items():
            position[index] = len(entries)
            entries.append(_entry(item, planner, default))
        tree = {"dcp": {"format": FORMAT, "version": DCP_VERSION, "save_id": self.save_id,
                        "planner_data": planner_data, "world_size": world()[1]},
                "items": entries}
        save(self.step, tree)
        results = [WriteResult(index=item.index, storage_data=position[item.index],
                                        size_in_bytes=_nbytes(entries[position[item.index]]))
                   for item in plan.items]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left to write: every rank stored its items and their description."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen by passing it, never for a path


def _entry(item: WriteItem, planner: SavePlanner, default: bool) -> dict[str, Any]:
    """One stored item: a tensor chunk, a plain value, or the bytes DCP made of a value."""
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        if default:
            value = planner.lookup_object(item.index)  # type: ignore[attr-defined]
            if _plain(value):
                return {"fqn": fqn, "value": value}
        data = planner.resolve_data(item)
        if not isinstance(data, io.BytesIO):
            raise CheckpointError(f"the planner gave a {type(data).__name__} for {fqn!r}, "
                                  "not bytes")
        raw = bytearray(data.getbuffer())
        blob = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8))
        return {"fqn": fqn, "bytes": blob}
    meta = item.tensor_data
    if meta is None:
        raise CheckpointError(f"DCP's write item for {fqn!r} has no tensor description")
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"the planner gave a {type(tensor).__name__} for {fqn!r}, "
                              "not a tensor")
    tensor = tensor.detach()
    if tensor.shape != meta.chunk.sizes:
        raise CheckpointError(f"the planner gave {fqn!r} as {list(tensor.shape)}, its "
                              f"chunk is {list(meta.chunk.sizes)}")
    return {"fqn": fqn, "offsets": list(meta.chunk.offsets), "size": list(meta.size),
            "dtype": str(meta.properties.dtype).replace("torch.", ""),
            "requires_grad": bool(meta.properties.requires_grad), "data": tensor}


def _nbytes(entry: dict[str, Any]) -> int:
    data = entry.get("data", entry.get("bytes"))
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else 0


# --- load ---------------------------------------------------------------------------------

@dataclass
class _Stored:
    """One item of this rank's restored copy."""

    tensor: torch.Tensor | None = None
    value: Any = None
    is_value: bool = False


class StorageReader(_storage.StorageReader):
    """DCP's ``storage_reader`` for ``orchestrator.checkpoint.load()``: the step it chooses
    (``step``), each rank reading its own copy. Reuse one reader for several ``dcp.load``
    calls to restore the copy once."""

    def __init__(self) -> None:
        super().__init__()
        self.load_id = str(uuid.uuid4())
        self._loaded = False
        self._step: int | None = None
        self._items: dict[_Key, _Stored] = {}
        self._fragment: dict[str, Any] | None = None
        self._metadata: Metadata | None = None
        self._failed: str | None = None
        self._error: CheckpointError | None = None
        self._resharded: Resharded | None = None  # a save of another world size
        self.is_coordinator = False

    @property
    def step(self) -> int | None:
        """The step restored, or None when there is nothing to resume. The first use calls
        ``load()``: when torch.distributed is initialized, every rank must make it."""
        self._restore()
        return self._step

    def _restore(self) -> None:
        if self._error is not None:
            raise self._error
        if self._loaded:
            return
        found = load()
        self._loaded = True
        try:
            if found is not None and saved_world(found[1]) in (None, world()[1]):
                self._step = found[0]
                self._items, self._fragment = _describe(found[1], found[0])
                return
            self._resharded = reshard(found, _describe)  # another world size's save
            if self._resharded is not None:
                self._step = self._resharded.step
                self._fragment = self._resharded.ordered_fragments()[0]
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            self._items.clear()
            self._error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"step {found[0] if found else None}'s copy is not a checkpoint_dcp save "
                f"({type(exc).__name__}: {exc})")
            raise self._error from None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new ``dcp.load``; the restored copy is kept (the step is ``load()``'s choice)."""
        if checkpoint_id is not None:
            raise CheckpointError("checkpoint_dcp.StorageReader loads the step that "
                                  "orchestrator.checkpoint.load() chooses: pass no "
                                  "checkpoint_id")
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's global Metadata: this rank's chunks and those of every other rank (one
        all_gather_object, when torch.distributed is initialized)."""
        if self._metadata is None and self._failed is None:
            mine: dict[str, Any] | str
            try:
                self._restore()
                mine = self._fragment if self._fragment is not None else \
                    "no checkpoint to resume (orchestrator.checkpoint.load() found none)"
            except Exception as exc:  # told to every rank, so that all of them fail
                mine = f"{type(exc).__name__}: {exc}"
            everyone: list[Any] = [mine]
            rank = 0
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, mine)
                rank = dist.get_rank()
            failed = [f"rank {r}: {f}" for r, f in enumerate(everyone)
                      if not isinstance(f, dict)]
            if isinstance(mine, str):
                self._failed = mine
            elif failed:
                self._failed = "another rank cannot load: " + failed[0]
            elif self._resharded is not None:  # every old rank's, read from its copy
                self._metadata = _metadata(self._resharded.ordered_fragments())
            else:  # this rank's description first: it wins where ranks differ
                self._metadata = _metadata([mine] + everyone[:rank] + everyone[rank + 1:])
        if self._failed is not None:
            raise CheckpointError(self._failed)
        assert self._metadata is not None
        self._metadata.storage_meta = StorageMeta(
            checkpoint_id=str(self._step), save_id=(self._fragment or {}).get("save_id"),
            load_id=self.load_id)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            index = req.storage_index
            if req.type == LoadItemType.BYTE_IO:
                stored = self._find(req, (index.fqn, None))
                if stored.is_value:
                    buf = io.BytesIO()
                    torch.save(stored.value, buf)
                else:
                    assert stored.tensor is not None
                    buf = io.BytesIO(_bytes_of(stored.tensor))
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            offsets = tuple(index.offset) if index.offset is not None else None
            stored = self._find(req, (index.fqn, offsets))
            if stored.tensor is None:
                raise CheckpointError(f"{index.fqn!r} is not a tensor in step {self._step}'s "
                                      "copy")
            source = _narrow(stored.tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise CheckpointError(f"{index.fqn!r}: the copy's chunk is {list(source.size())}, "
                                      f"the state's is {list(target.size())}")
            target.copy_(source)
            planner.commit_tensor(req, target)
        if self._resharded is not None:
            self._resharded.done()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _find(self, req: ReadItem, key: _Key) -> _Stored:
        resharded = self._resharded
        stored = resharded.find(key) if resharded is not None else self._items.get(key)
        if stored is None:
            where = "" if key[1] is None else f" at offsets {list(key[1])}"
            if resharded is not None:
                raise CheckpointError(f"no rank's copy of step {self._step} holds "
                                      f"{req.storage_index.fqn!r}{where}")
            rank = os.environ.get("RANK", "0")
            raise CheckpointError(
                f"rank {rank}'s copy of step {self._step} does not hold "
                f"{req.storage_index.fqn!r}{where}: another rank saved it (checkpoint_dcp "
                "loads each rank from its own copy, so the world size and the sharding must "
                "be those of the save)")
        return stored

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _describe(tree: Any, step: int | None) -> tuple[dict[_Key, _Stored],
                                                   dict[str, Any]]:
    """A copy's items by (fqn, offsets), and its description of them (what DCP's Metadata
    is built from)."""
    head = tree.get("dcp") if isinstance(tree, dict) else None
    entries = tree.get("items") if isinstance(tree, dict) else None
    if not isinstance(head, dict) or head.get("format") != FORMAT or \
            not isinstance(entries, list):
        raise CheckpointError(f"step {step}'s copy was not written by checkpoint_dcp."
                              "StorageWriter (read it with orchestrator.checkpoint.load())")
    items: dict[_Key, _Stored] = {}
    tensors: dict[str, dict[str, Any]] = {}
    byte_fqns: list[str] = []
    for entry in entries:
        fqn = entry["fqn"]
        if "data" in entry:
            data = entry["data"]
            offsets = tuple(_size(entry["offsets"]))
            items[(fqn, offsets)] = _Stored(tensor=data)
            desc = tensors.setdefault(fqn, {"dtype": entry["dtype"], "size": entry["size"],
                                            "requires_grad": entry["requires_grad"],
                                            "chunks": []})
            desc["chunks"].append([list(offsets), list(data.shape)])
        elif "value" in entry:
            items[(fqn, None)] = _Stored(value=entry["value"], is_value=True)
            byte_fqns.append(fqn)
        else:
            items[(fqn, None)] = _Stored(tensor=entry["bytes"])
            byte_fqns.append(fqn)
    return items, {"tensors": tensors, "bytes": byte_fqns,
                   "planner_data": head.get("planner_data"), "version": head.get("version"),
                   "save_id": head.get("save_id")}


def _metadata(fragments: list[dict[str, Any]]) -> Metadata:
    """DCP's global Metadata from every rank's description of its copy, this rank's first:
    a name some ranks hold with another size or dtype (a per-rank value) keeps this rank's."""
    tensors: dict[str, dict[str, Any]] = {}
    byte_fqns: set[str] = set()
    mappings: dict[Any, Any] = {}
    for fragment in fragments:
        for fqn, desc in fragment["tensors"].items():
            if fqn in byte_fqns:
                continue
            have = tensors.get(fqn)
            if have is None:
                tensors[fqn] = {**desc, "chunks": [list(c) for c in desc["chunks"]]}
            elif have["size"] == desc["size"] and have["dtype"] == desc["dtype"]:
                have["chunks"].extend(c for c in desc["chunks"] if c not in have["chunks"])
        byte_fqns.update(f for f in fragment["bytes"] if f not in tensors)
        data = fragment["planner_data"]
        if isinstance(data, dict):
            for key, value in data.items():
                mappings.setdefault(key, value)
    own = fragments[0]["planner_data"]
    md: dict[str, STORAGE_TYPES] = {f: BytesStorageMetadata() for f in byte_fqns}
    for fqn, desc in tensors.items():
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_dtype(desc["dtype"]),
                                        requires_grad=bool(desc["requires_grad"])),
            size=_size(desc["size"]),
            chunks=[ChunkStorageMetadata(offsets=_size(o), sizes=_size(s))
                    for o, s in desc["chunks"]])
    return Metadata(state_dict_metadata=md,
                    planner_data=mappings if isinstance(own, dict) else own,
                    version=fragments[0]["version"])


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a stored chunk that one read wants (as FileSystemReader narrows)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _bytes_of(tensor: torch.Tensor) -> bytes:
    out = bytearray(tensor.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(tensor.reshape(-1))
    return bytes(out)
