"""Saving and loading through torch DCP's planners and file system storage, over this world.

torch's `torch.distributed.checkpoint.save` runs its steps over a torch process group; a world
here may have none (MPI). So this module runs the same steps itself, with the world's engine for
the few exchanges, and DCP's own `DefaultSavePlanner`, `FileSystemWriter` and `FileSystemReader`
for everything written or read, which makes the files DCP's, byte for byte:

1. every rank plans its writes, rank 0 removes the folder's old `.metadata`, the plans are
   exchanged, and every rank merges them (deterministic) into the global plan and `Metadata`
   (replicated values written by one rank only) and takes its part;
2. every rank writes its own file, `__<rank>_0.distcp`, and flushes it to disk (`fsync`);
3. rank 0 gathers what each rank wrote and only then writes `.metadata` (to a temporary name,
   flushed, then renamed: atomic). A folder without `.metadata` is therefore a save that did not
   finish, never a complete checkpoint, and `read_metadata` says so, naming what it holds.

`Shards` enter DCP's plans as chunks of their tensor; loading reads each of today's boxes from
the saved boxes that overlap it, whatever the world size that wrote them.

`async_save` runs step 1, copies what may change at any moment into host memory on the caller's
thread, and returns a `SaveFuture`; a thread of its own copies the parameters and optimizer
state (they change only in an optimizer's step, whose pre-hook waits for the copy), then runs
steps 2 and 3, exchanging on a private engine (a duplicate of the communication thread's,
`World.private`), so that neither the program's collectives nor a training step's buckets meet
it. The future is among the world's requests in flight: `dp.wait_all()`, `dp.finalize()` and
the next save or load wait for it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from dataparallel import caches, world
from dataparallel.backends.base import Backend
from dataparallel.checkpoint._shards import Shards
from dataparallel.checkpoint._states import Loading, saveable, stepped_storages

__all__ = ["SaveFuture", "async_save", "load", "read_metadata", "save"]

METADATA = ".metadata"
PathLike = str | os.PathLike[str]
T = TypeVar("T")  # what every rank sends in an exchange: the same kind on each


# -- Shards in DCP's plans ----------------------------------------------------------------------


def _write_items(fqn: str, shards: Shards) -> list[WriteItem]:
    out = []
    for offsets, tensor in shards.pieces:
        if tensor.numel() == 0:
            continue
        out.append(
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=torch.Size(shards.shape),
                ),
            )
        )
    return out


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with `Shards` written as chunks of their tensor, and (for
    `async_save`) every piece read from the copy made at the call."""

    copies: dict[MetadataIndex, torch.Tensor | io.BytesIO] | None = None

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, Shards):
                items += _write_items(fqn, value)
            else:
                items += create_default_local_save_plan({fqn: value}, self.is_coordinator).items
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Shards):
            return value.piece(index.offset or ())
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self.copies is not None:
            data = self.copies[write_item.index]
            if isinstance(data, io.BytesIO):
                data.seek(0)
            return data
        return super().resolve_data(write_item)

    def copy_all(self, plan: SavePlan, stepped: set[int]) -> None:
        """Copy every piece this rank writes into host memory (`async_save`), but those in
        `stepped` memory (what changes only in an optimizer's step: `stepped_storages`), which
        are noted with their version counters for `stage()`, on the save's thread."""
        self.copies = {}
        self.kept: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.later: list[tuple[WriteItem, torch.Tensor, int]] = []
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                live = self.lookup_object(item.index)
                if (
                    isinstance(live, torch.Tensor)
                    and live.device.type == "cpu"
                    and live.numel()
                    and live.untyped_storage().data_ptr() in stepped
                ):
                    self.later.append((item, live, live._version))
                    continue
            self.copies[item.index] = self._copy(item, super().resolve_data(item))

    def _copy(self, item: WriteItem, data: torch.Tensor | io.BytesIO) -> torch.Tensor | io.BytesIO:
        """`data` copied into the buffer the last `async_save` copied the same piece into,
        where it fits (`_kept`), else into new host memory."""
        if not isinstance(data, torch.Tensor):
            return data
        key = (item.index.fqn, tuple(item.index.offset or ()))
        buffer = _kept.get(key)
        if buffer is not None and buffer.shape == data.shape and buffer.dtype == data.dtype:
            buffer.copy_(data.detach())
        else:
            buffer = data.detach().to("cpu", copy=True)
        self.kept[key] = buffer
        return buffer

    def stage(self) -> None:
        """Copy the pieces `copy_all` left (on the save's thread, before it writes), noting
        those changed in place since the call: torch counts each in-place change of a tensor
        in its version, read here after each copy."""
        global _kept
        assert self.copies is not None
        self.moved: list[str] = []
        try:
            for item, live, version in self.later:
                self.copies[item.index] = self._copy(item, live)
                if live._version != version:
                    self.moved.append(item.index.fqn)
        except Exception as exc:  # raised by `write`, in step with the other ranks
            self.failed: Exception | None = exc
        _kept = self.kept

    def changed(self) -> list[str]:
        """The pieces that `stage()` found changed since `async_save` was called."""
        return sorted(set(getattr(self, "moved", [])))


# `async_save`'s host copies, kept for the next one: copying into memory already touched costs
# a copy, into new memory a copy and a page fault per page. They hold this rank's part of the
# state; `dp.finalize()` lets them go.
_kept: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


@caches.register
def _forget_kept() -> None:
    global _kept
    _kept = {}


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with `Shards` read box by box from the saved boxes they meet."""

    def set_up_planner(
        self,
        state_dict: dict[str, object],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # torch's set-up walks the state and keeps only the types it knows: `Shards` stand
        # aside meanwhile (a tensor in their place), and come back under their flattened keys.
        aside: dict[tuple[object, ...], Shards] = {}
        _swap(state_dict, (), aside, into=True)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            _swap(state_dict, (), aside, into=False)
        for key, path in self.mappings.items():
            if tuple(path) in aside:
                self.state_dict[key] = aside[tuple(path)]

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        rest = {k: v for k, v in self.state_dict.items() if not isinstance(v, Shards)}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, value in self.state_dict.items():
            if not isinstance(value, Shards):
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"dp.checkpoint.load: the checkpoint has no tensor {fqn!r}.")
            if tuple(md.size) != value.shape:
                raise ValueError(
                    f"dp.checkpoint.load: {fqn!r} was saved with shape {list(md.size)}, this "
                    f"one has {list(value.shape)}."
                )
            chunks = [
                ChunkStorageMetadata(torch.Size(offsets), tensor.shape)
                for offsets, tensor in value.pieces
            ]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Shards):
            return value.piece(index.offset or ())
        return super().lookup_tensor(index)


def _swap(
    tree: dict[str, object],
    path: tuple[object, ...],
    aside: dict[tuple[object, ...], Shards],
    into: bool,
) -> None:
    """Put the `Shards` of `tree` aside (`into`), a tensor in their place, or back."""
    for key, value in tree.items():
        here = (*path, key)
        if into and isinstance(value, Shards):
            aside[here] = value
            tree[key] = torch.empty(0)
        elif not into and here in aside:
            tree[key] = aside[here]
        elif isinstance(value, dict):
            _swap(value, here, aside, into)


# -- the exchanges ------------------------------------------------------------------------------


def _engine() -> Backend:
    return world.current().backend


def _everyone(backend: Backend, value: object) -> list[Any]:
    return backend.allgather_object(value) if backend.size > 1 else [value]


def _from_rank0(backend: Backend, value: T) -> T:
    return backend.broadcast_object(value, 0) if backend.size > 1 else value


@dataclasses.dataclass(frozen=True)
class _Failed:
    """What a rank sends in an exchange in place of its part when it failed."""

    message: str


def _raise_any(backend: Backend, error: BaseException | None, what: str) -> None:
    """Raise on every rank when `error` happened on any (collective)."""
    errors = _everyone(backend, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if error is not None:
        raise error
    if failed:
        r, e = failed[0]
        raise RuntimeError(f"dp.checkpoint: rank {r} failed to {what}: {e}")


# -- saving -------------------------------------------------------------------------------------


class _Save:
    """One save's steps (see the module's notes)."""

    def __init__(self, state: Mapping[str, object], path: PathLike, backend: Backend) -> None:
        self.path = Path(path)
        self.backend = backend
        self.writer = FileSystemWriter(self.path, sync_files=True, overwrite=True)
        self.planner = _SavePlanner()
        self.metadata: Metadata | None = None

    def plan(self, state: Mapping[str, object]) -> SavePlan:
        """Step 1 (collective, on the caller's thread): one exchange, of the local plans.

        Every rank merges the plans itself (DCP's global planning is deterministic: the same
        plans give every rank the same result), so no answer from rank 0 is awaited; rank 0
        removes the folder's old `.metadata` before it joins the exchange, so before any rank
        can have begun to write."""
        b, coordinator = self.backend, self.backend.rank == 0
        error: BaseException | None = None
        local: SavePlan | None = None
        try:
            state_dict = saveable(state)
            self.planner.set_up_planner(state_dict, self.writer.storage_meta(), coordinator)
            self.writer.set_up_storage_writer(coordinator, rank=b.rank, use_collectives=True)
            with warnings.catch_warnings():  # "overwriting an existing checkpoint": step 1 does
                warnings.simplefilter("ignore")
                local = self.writer.prepare_local_plan(self.planner.create_local_plan())
            stale = self.path / METADATA
            if coordinator and stale.exists():  # the folder's old checkpoint goes first
                stale.unlink()
        except Exception as exc:
            error = exc
        failure = None if error is None else _Failed(f"{type(error).__name__}: {error}")
        plans = _everyone(b, local if failure is None else failure)
        if error is not None:
            raise error
        for r, plan in enumerate(plans):
            if isinstance(plan, _Failed):
                raise RuntimeError(
                    f"dp.checkpoint: rank {r} failed to plan its part of the checkpoint: "
                    f"{plan.message}"
                )
        try:
            merged, self.metadata = self.planner.create_global_plan(plans)
            merged = self.writer.prepare_global_plan(merged)
        except Exception as exc:
            raise ValueError(
                f"dp.checkpoint.save: the checkpoint cannot be planned: {type(exc).__name__}: {exc}"
            ) from exc
        return self.planner.finish_plan(merged[b.rank])

    def write(self, plan: SavePlan, backend: Backend) -> None:
        """Steps 2 and 3 (collective over `backend`)."""
        error: BaseException | None = None
        results: Any = None
        try:
            failed = getattr(self.planner, "failed", None)
            if failed is not None:  # the copy on the save's thread
                raise failed
            future = self.writer.write_data(plan, self.planner)
            future.wait()
            results = future.value()
            changed = self.planner.changed() if self.planner.copies is not None else []
            if changed:
                error = RuntimeError(
                    f"dp.checkpoint.async_save: {', '.join(changed[:4])} changed in place after "
                    "async_save returned and before its copy was made, outside an optimizer's "
                    "step() (which waits for the copy): the checkpoint would mix two states and "
                    "is not written. Call future.staged() before changing the state outside "
                    "step()."
                )
        except Exception as exc:
            error = exc
        # one exchange: what each rank wrote, or why it could not
        failure = None if error is None else _Failed(f"{type(error).__name__}: {error}")
        everyone = _everyone(backend, results if failure is None else failure)
        if error is not None:
            raise error
        for r, result in enumerate(everyone):
            if isinstance(result, _Failed):
                raise RuntimeError(
                    f"dp.checkpoint: rank {r} failed to write its shards into {self.path}: "
                    f"{result.message}"
                )
        done: str | None = None
        if backend.rank == 0:
            try:
                assert self.metadata is not None
                self.writer.finish(self.metadata, everyone)
            except Exception as exc:
                done = f"{type(exc).__name__}: {exc}"
        done = _from_rank0(backend, done)
        if done is not None:
            raise RuntimeError(f"dp.checkpoint.save: rank 0 could not write {METADATA}: {done}")


def _settle_previous() -> None:
    """Wait for this world's save in flight, if any (one at a time, in order on every rank)."""
    for request in list(world.current().pending):
        if isinstance(request, SaveFuture):
            request.wait()


def save(state: Mapping[str, object], path: PathLike) -> None:
    """See `dataparallel.checkpoint.save`."""
    _settle_previous()
    b = _engine()
    one = _Save(state, path, b)
    one.write(one.plan(state), b)


class SaveFuture:
    """An `async_save` in progress: `result()` (or `wait()`) returns once every rank's shards
    and the metadata are on disk, and raises what the save raised; `staged()` returns once
    this rank's part of the state is copied."""

    def __init__(
        self, stage: Callable[[], None], run: Callable[[], None], pending: list[world.Waitable]
    ) -> None:
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._pending = pending
        pending.append(self)
        _staging.add(self)

        def body() -> None:
            try:
                try:
                    stage()
                finally:
                    self._staged.set()
                    _staging.discard(self)
                run()
            except BaseException as exc:
                self._error = exc
            self._done.set()

        self._thread = threading.Thread(target=body, name="dp-checkpoint", daemon=True)
        self._thread.start()

    def staged(self, timeout: float | None = None) -> None:
        """Wait until this rank's part of the state is copied into host memory: from then on
        it may change in any way (an optimizer's `step()` waits for this by itself)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"dp.checkpoint.async_save: not copied within {timeout} s")

    def done(self) -> bool:
        """Whether the save has ended (written, or failed)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the save to end; raise what it raised (`TimeoutError` past `timeout`)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"dp.checkpoint.async_save: not written within {timeout} s")
        self._thread.join()
        if self in self._pending:
            self._pending.remove(self)
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """`result()`, under the name `dp.Request` and `dp.wait_all` use."""
        self.result()


# The saves whose pieces are being copied on their threads, and the hook that makes every torch
# optimizer's step wait for them (registered at the first `async_save`).
_staging: set[SaveFuture] = set()
_hook: RemovableHandle | None = None


def _before_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    for future in list(_staging):
        future.staged()


def async_save(state: Mapping[str, object], path: PathLike) -> SaveFuture:
    """See `dataparallel.checkpoint.async_save`."""
    global _hook
    _settle_previous()
    active = world.current()
    b = active.backend
    one = _Save(state, path, b)
    plan = one.plan(state)
    one.planner.copy_all(plan, stepped_storages(state))
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)
    # The thread's engine: a duplicate of the communication thread's (collective when first made).
    engine = active.private(active.private(b)) if b.size > 1 else b
    return SaveFuture(one.planner.stage, lambda: one.write(plan, engine), active.pending)


# -- loading ------------------------------------------------------------------------------------


def _check_files(path: Path, metadata: Metadata) -> None:
    """Raise `FileNotFoundError` naming each file the metadata names that is absent or short."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    bad = []
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.exists():
            bad.append(f"{name} (missing)")
        elif file.stat().st_size < end:
            bad.append(f"{name} ({file.stat().st_size} bytes, {end} expected)")
    if bad:
        raise FileNotFoundError(
            f"dp.checkpoint: {path} is incomplete: its {METADATA} names shard files that are not "
            f"whole: {', '.join(bad)}. They were removed or cut after the save; restore them, or "
            "load another checkpoint."
        )


def read_metadata(path: PathLike) -> Metadata:
    """The checkpoint's metadata, after checking that it is complete (see the module's notes).

    Raises:
        FileNotFoundError: `path` holds no complete checkpoint; the message says what is there.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"dp.checkpoint: no checkpoint at {folder}: no such folder.")
    if not (folder / METADATA).exists():
        shards = sorted(p.name for p in folder.glob("*.distcp"))
        held = (
            f"it holds {len(shards)} shard file(s) ({', '.join(shards[:4])}"
            f"{', ...' if len(shards) > 4 else ''}) of a save that did not finish (a rank died "
            "or was stopped before every rank's shards were on disk). Save again, or load an "
            "earlier checkpoint."
            if shards
            else "it holds no shard files either: it is not a checkpoint."
        )
        raise FileNotFoundError(
            f"dp.checkpoint: {folder} holds no complete checkpoint: its {METADATA}, which a save "
            f"writes last, once every rank's shards are on disk, is missing; {held}"
        )
    metadata = FileSystemReader(folder).read_metadata()
    _check_files(folder, metadata)
    return metadata


def load(state: Mapping[str, object], path: PathLike) -> Mapping[str, object]:
    """See `dataparallel.checkpoint.load`."""
    _settle_previous()
    b = _engine()
    folder = Path(path)
    found: Any = None
    if b.rank == 0:
        try:
            found = read_metadata(folder)
        except Exception as exc:
            found = exc
    found = _from_rank0(b, found)
    if isinstance(found, BaseException):
        raise found
    metadata: Metadata = found
    error: BaseException | None = None
    loading: Loading | None = None
    try:
        loading = Loading(state, metadata)
        reader = FileSystemReader(folder)
        planner = _LoadPlanner()
        planner.set_up_planner(loading.template, metadata, b.rank == 0)
        reader.set_up_storage_reader(metadata, b.rank == 0, rank=b.rank, use_collectives=True)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        # DCP's default global load plan is each rank's own: nothing to exchange.
        plan = planner.finish_plan(plan)
        reader.read_data(plan, planner).wait()
    except Exception as exc:
        error = exc
    _raise_any(b, error, f"load from {folder}")
    assert loading is not None
    return loading.install()
