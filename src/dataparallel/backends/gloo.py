"""Gloo through `torch.distributed`: collectives over host buffers, with env/tcp/file rendezvous.

NumPy buffers are wrapped zero-copy with `torch.from_numpy`, so Gloo reads and writes the caller's
memory. Gloo lacks a few things MPI has; this module (and `gloo_exchange.py`, for reduce-scatter and
all-to-all) fills them in exactly:

- dtypes: those Gloo lacks are carried exactly (`gloo_wire.py`). Complex products gather every
  rank's buffer and multiply locally in rank order. Broadcast and gathers move raw bytes.
- `reduce`: Gloo uses the non-root buffers as scratch, so non-root ranks reduce a copy.
- `allgatherv`: Gloo gathers equal sizes only. Equal counts gather straight into `recv`; uneven
  ones are padded to the largest count (traffic `size * max(counts)` bytes instead of
  `sum(counts)`, and one copy in and out).
- `abort`: Gloo has none. The failing rank prints why and leaves with `os._exit`; the other ranks
  see the connection close and raise `RankFailedError`.
- teardown: the group is destroyed by `close()` (`dp.finalize()`) or, failing that, at interpreter
  exit, so no Gloo thread outlives the interpreter. torch's `destroy_process_group` (and Gloo's
  `shutdown`/`abort`) leaves the group's connections open while anything holds the group or one
  of its work objects; so `close()` also lets go of both (its handles in flight included: their
  `wait()` then fails), and the connections close as the last reference goes. A peer still in a
  collective with this process then fails at once (`RankFailedError`) instead of waiting out
  the timeout: an elastic run's survivors rely on it (docs/elastic.md).

Joining the group (rendezvous, the network interface, a user's existing default group): see
`gloo_setup.py`; a non-blocking call in flight: `gloo_handle.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import sys
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn, TypeVar

import numpy as np

from dataparallel.backends.base import (
    Backend,
    Buffer,
    DoneHandle,
    Handle,
    HostBuffer,
    Received,
    ReduceOp,
)
from dataparallel.backends.file_store import remove_if_every_store_left
from dataparallel.backends.gloo_errors import translate_error
from dataparallel.backends.gloo_exchange import GlooExchange
from dataparallel.backends.gloo_handle import GlooHandle
from dataparallel.backends.gloo_setup import join_group
from dataparallel.backends.gloo_wire import flat, wire_for, writable
from dataparallel.config import Settings
from dataparallel.types import WireDtype

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Work

__all__ = ["GlooBackend"]

_R = TypeVar("_R")


class GlooBackend(GlooExchange, Backend):
    """Collectives on a Gloo process group of `torch.distributed`.

    When this module initializes torch's default group, the user may use `torch.distributed` on
    it too; when the user had initialized it already, the library makes a private Gloo group over
    the same processes instead, and leaves the user's group alone.
    """

    name = "gloo"
    # Every integer dtype is listed, though Gloo lacks int16/uint16/uint32/uint64: they are
    # reduced here exactly (see the module's notes), which beats widening them to float32.
    native_dtypes = Backend.native_dtypes

    def __init__(
        self,
        dist: ModuleType,
        group: ProcessGroup | None,
        *,
        owns_default_group: bool,
        local: tuple[int, int] | None,
        store_file: Path | None = None,
    ) -> None:
        import torch

        self._torch, self._dist, self.group = torch, dist, group
        self._owns_default_group = owns_default_group
        self._store_file = store_file
        self._closed = False
        self._in_flight: weakref.WeakSet[GlooHandle] = weakref.WeakSet()
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if local is None:
            hosts = self.allgather_object(socket.gethostname())
            local = (hosts[: self.rank].count(hosts[self.rank]), hosts.count(hosts[self.rank]))
        self.local_rank, self.local_size = local
        self._ops: dict[ReduceOp, object] = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
        }
        atexit.register(self.close)

    @classmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> GlooBackend:
        """Join the Gloo group through `init_method` (`gloo_setup.join_group`), for initialize.

        When `torch.distributed` is already initialized, its processes are used as they are (a
        private Gloo group over them), and `init_method` is not consulted.

        Raises:
            BackendUnavailableError: PyTorch, or its Gloo, is missing.
            ValueError: a malformed `init_method`, or a rank or size missing or out of range.
            CollectiveTimeoutError: not every rank arrived within `timeout` (torch's default: 30
                minutes; `DATAPARALLEL_TIMEOUT` / `dp.initialize(timeout=...)`).
        """
        settings = settings if settings is not None else Settings.from_env()
        joined = join_group(init_method, rank, world_size, settings)
        return cls(
            joined.dist,
            joined.group,
            owns_default_group=joined.owns_default_group,
            local=joined.local,
            store_file=joined.store_file,
        )

    # -- reductions --------------------------------------------------------------------------

    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        buf = writable(flat(buf, "allreduce"), "allreduce")
        if buf.dtype.kind == "c" and op is ReduceOp.PROD:
            buf[...] = self._gathered_product(buf)
            return
        wire, finish = wire_for(buf, op)
        self._call("allreduce", self._dist.all_reduce, wire, op=self._ops[op])
        if finish is not None:
            finish()

    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        buf = writable(flat(buf, "iallreduce"), "iallreduce")
        if buf.dtype.kind == "c" and op is ReduceOp.PROD:
            self.allreduce(buf, op)
            return DoneHandle()
        wire, finish = wire_for(buf, op)
        tensor = self._torch.from_numpy(wire)
        work = self._start("iallreduce", self._dist.all_reduce, tensor, op=self._ops[op])
        return GlooHandle(self, work, (wire, tensor), finish)

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        """Gloo reduces float16 and bfloat16 natively, about as fast as float32."""
        if dtype == "float16":
            return self.iallreduce(buf, op)
        bits = writable(flat(buf, "iallreduce"), "iallreduce")
        tensor = self._torch.from_numpy(bits.view(np.int16)).view(self._torch.bfloat16)
        work = self._start("iallreduce", self._dist.all_reduce, tensor, op=self._ops[op])
        return GlooHandle(self, work, (bits, tensor), None)

    def reduce(self, buf: Buffer, op: ReduceOp, root: int) -> None:
        buf = flat(buf, "reduce")
        if self.rank != root:
            buf = buf.copy()  # Gloo uses non-root buffers as scratch
        writable(buf, "reduce")
        if buf.dtype.kind == "c" and op is ReduceOp.PROD:
            product = self._gathered_product(buf)
            if self.rank == root:
                buf[...] = product
            return
        wire, finish = wire_for(buf, op)
        self._call("reduce", self._dist.reduce, wire, dst=self._global(root), op=self._ops[op])
        if finish is not None:
            finish()

    def _gathered_product(self, buf: np.ndarray) -> np.ndarray:
        """Multiply every rank's `buf` in rank order (Gloo has no complex product)."""
        every = np.empty(self.size * buf.size, buf.dtype)
        self.allgatherv(buf, every, [buf.size] * self.size)
        product: np.ndarray = np.prod(every.reshape(self.size, -1), axis=0)
        return product

    # -- data movement -----------------------------------------------------------------------

    def broadcast(self, buf: Buffer, root: int) -> None:
        raw = writable(flat(buf, "broadcast"), "broadcast").view(np.uint8)
        self._call("broadcast", self._dist.broadcast, raw, src=self._global(root))

    def ibroadcast(self, buf: Buffer, root: int) -> Handle:
        raw = writable(flat(buf, "ibroadcast"), "ibroadcast").view(np.uint8)
        tensor = self._torch.from_numpy(raw)
        work = self._start("ibroadcast", self._dist.broadcast, tensor, src=self._global(root))
        return GlooHandle(self, work, (raw, tensor), None)

    def iallgather(self, send: Buffer, recv: Buffer) -> Handle:
        """Equal counts: Gloo's flat allgather, straight into `recv`, on Gloo's threads."""
        send, recv = flat(send, "iallgather"), writable(flat(recv, "iallgather"), "iallgather")
        raw_send, raw_recv = send.view(np.uint8), recv.view(np.uint8)
        if raw_recv.size < raw_send.size * self.size:
            raise ValueError(
                f"GlooBackend.iallgather on rank {self.rank}: recv holds {recv.size} items, "
                f"fewer than {self.size} x the {send.size} items sent."
            )
        if raw_send.size == 0:
            return DoneHandle()
        torch = self._torch
        source = torch.from_numpy(raw_send if raw_send.flags.writeable else raw_send.copy())
        target = torch.from_numpy(raw_recv[: raw_send.size * self.size])
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        work = self._call_tensors("iallgather", gather, target, source, async_op=True)
        return GlooHandle(self, work, (source, target), None)

    def ireduce_scatter(
        self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp
    ) -> Handle:
        """On Gloo's threads (`GlooExchange._scatter_plan`); dtypes Gloo cannot reduce are
        reduced at once."""
        plan = self._scatter_plan(send, recv, counts, op)
        if plan is None:
            return DoneHandle()
        work = self._call_tensors(
            "ireduce_scatter", self._dist.all_to_all_single, *plan.args, async_op=True
        )
        return GlooHandle(self, work, plan.args, plan.finish)

    def allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        send, recv = flat(send, "allgatherv"), writable(flat(recv, "allgatherv"), "allgatherv")
        item = send.dtype.itemsize
        sizes = [count * item for count in counts]
        raw_send, raw_recv = send.view(np.uint8), recv.view(np.uint8)
        if raw_send.size != sizes[self.rank] or raw_recv.size < sum(sizes):
            raise ValueError(
                f"GlooBackend.allgatherv on rank {self.rank}: counts={counts} do not fit the "
                f"buffers (send holds {send.size} items, recv {recv.size})."
            )
        widest = max(sizes, default=0)
        if widest == 0:
            return
        torch = self._torch
        if all(size == widest for size in sizes):  # straight into recv, no copy
            rows = raw_recv[: widest * self.size].reshape(self.size, widest)
            source = raw_send if raw_send.flags.writeable else raw_send.copy()
            outputs = [torch.from_numpy(row) for row in rows]
            self._call_tensors(
                "allgatherv", self._dist.all_gather, outputs, torch.from_numpy(source)
            )
            return
        padded = np.empty(widest, np.uint8)
        padded[: raw_send.size] = raw_send
        gathered = np.empty((self.size, widest), np.uint8)
        outputs = [torch.from_numpy(row) for row in gathered]
        self._call_tensors("allgatherv", self._dist.all_gather, outputs, torch.from_numpy(padded))
        offset = 0
        for r, size in enumerate(sizes):
            raw_recv[offset : offset + size] = gathered[r, :size]
            offset += size

    def broadcast_object(self, obj: object, root: int) -> Received:
        box = [obj]
        self._call_tensors(
            "broadcast_object", self._dist.broadcast_object_list, box, src=self._global(root)
        )
        return box[0]

    def allgather_object(self, obj: object) -> list[Received]:
        out: list[object] = [None] * self.size
        self._call_tensors("allgather_object", self._dist.all_gather_object, out, obj)
        return out

    def barrier(self) -> None:
        self._call_tensors("barrier", self._dist.barrier)

    # -- lifetime ----------------------------------------------------------------------------

    def abort(self, code: int = 1) -> NoReturn:
        """End this process at once; Gloo has no abort, so the peers see it leave and fail."""
        print(
            f"dataparallel: rank {self.rank} of {self.size} is ending the job (exit code {code}); "
            "the other ranks fail with RankFailedError when they next communicate with it.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(code)

    def split(self, ranks: Sequence[int]) -> GlooBackend | None:
        """Return an engine on a Gloo group of `ranks` (collective over the whole world)."""
        group = self._dist.new_group(ranks=[self._global(r) for r in ranks], backend="gloo")
        if self.rank not in ranks:
            return None
        return GlooBackend(self._dist, group, owns_default_group=False, local=None)

    def _global(self, rank: int) -> int:
        """torch.distributed names roots by their rank in the default group."""
        return rank if self.group is None else int(self._dist.get_global_rank(self.group, rank))

    def duplicate(self) -> GlooBackend:
        """Return an engine on a private Gloo group over every process (collective); an engine
        of some processes returns itself (every process, member or not, makes a Gloo group)."""
        if self.size != self._dist.get_world_size():
            return self
        group = self._dist.new_group(backend="gloo")
        return GlooBackend(
            self._dist, group, owns_default_group=False, local=(self.local_rank, self.local_size)
        )

    def close(self) -> None:
        """Destroy the Gloo group and let go of it and of the handles in flight, so that its
        connections close (safe to call twice; also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for handle in list(self._in_flight):
            handle.forget()
        group, self.group = self.group, None  # calls fail from now on: `_call_tensors`
        dist = self._dist
        if not dist.is_initialized():
            return
        if self._owns_default_group:
            dist.destroy_process_group()
            # Free the group's store now, while the interpreter is whole: a file:// store removes
            # its file in its destructor, which interpreter teardown does not always run, and
            # which two ranks finishing at once can both skip (`file_store.py`).
            gc.collect()
            if self._store_file is not None:
                remove_if_every_store_left(self._store_file, self.size)
            return
        with contextlib.suppress(ValueError, RuntimeError):  # gone with the user's default group
            dist.destroy_process_group(group)
        del group  # the last reference, unless the user holds one: the connections close

    # -- helpers -----------------------------------------------------------------------------

    def _call(
        self, what: str, fn: Callable[..., object], array: np.ndarray, **kwargs: object
    ) -> None:
        self._call_tensors(what, fn, self._torch.from_numpy(array), **kwargs)

    def _call_tensors(
        self, what: str, fn: Callable[..., _R], *args: object, **kwargs: object
    ) -> _R:
        if self._closed:  # its group is gone: None would name torch's default group
            raise RuntimeError(
                f"Gloo {what} on a closed engine (dp.finalize() ran): dp.initialize() again."
            )
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            raise translate_error(exc, what, self.rank) from exc

    def _start(
        self, what: str, fn: Callable[..., Work], tensor: torch.Tensor, **kwargs: object
    ) -> Work:
        return self._call_tensors(what, fn, tensor, async_op=True, **kwargs)
