"""Gloo through `torch.distributed`: collectives over host buffers, with env/tcp/file rendezvous.

NumPy buffers are wrapped zero-copy with `torch.from_numpy`, so Gloo reads and writes the caller's
memory. What Gloo lacks against MPI is filled in here, exactly:

- dtypes: int16 and uint16 are reduced as int32 copies (wrapping like native integers), uint32
  and uint64 as int32 / int64 views (two's complement sums and products are bit-identical; for
  min/max the sign bit is flipped in place first, which maps unsigned order onto signed order).
  Complex products gather every rank's buffer and multiply in rank order. Broadcast, gathers and
  all-to-all move raw bytes, so every dtype goes as it is.
- `reduce`: Gloo uses the non-root buffers as scratch, so non-root ranks reduce a copy.
- `allgatherv`: Gloo gathers equal sizes only; uneven counts are padded to the largest.
- `reduce_scatter`: an all-to-all of every rank's segment to its rank, then the reduction of the
  rows received, here: faster than Gloo's own (benchmarks/NOTES.md). A dtype or op Gloo cannot
  reduce takes a whole allreduce instead, of which this rank keeps its segment.
- `abort`: Gloo has none. The failing rank prints why and leaves with `os._exit`; the other ranks
  see the connection close and raise `RankFailedError` (`translate_error`).
- teardown: torch leaves a group's connections open while anything holds the group, so `close()`
  destroys the group and lets go of it: a peer still in a collective with this process fails at
  once instead of waiting out the timeout.

Joining the group (rendezvous, network interface, a user's own default group): `group.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import itertools
import os
import re
import socket
import sys
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, NoReturn, TypeVar

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
from dataparallel.backends.connections import found_lost, shut_down
from dataparallel.backends.gloo.group import gloo_group, join_group
from dataparallel.backends.gloo.hierarchy import IN_FLIGHT, MIN_BYTES, Hierarchy
from dataparallel.backends.rendezvous import remove_if_every_store_left
from dataparallel.config import LINK_TIMEOUT_VARIABLE, Settings
from dataparallel.errors import CollectiveTimeoutError, LinkLostError, RankFailedError
from dataparallel.types import WireDtype

if TYPE_CHECKING:
    import torch
    from torch.distributed import AllreduceOptions, ProcessGroup, Work

__all__ = ["GlooBackend", "GlooHandle", "ScatterSteps", "translate_error"]

_R = TypeVar("_R")


# -- Gloo's failures as dataparallel's errors ----------------------------------------------

_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
)


# What a connection that the kernel gave up on says (TCP keep-alive, `backends.connections`):
# its peer's kernel stopped answering. Gloo names the peer, `[ADDRESS]:PORT`. One that the link
# watch shut down says it was closed (`connections.found_lost` knows its peer).
_OUT_OF_REACH = ("Connection timed out", "No route to host")
_PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+|\b(\d{1,3}(?:\.\d{1,3}){3}):\d+")


def translate_error(exc: BaseException, what: str, rank: int) -> BaseException:
    """Return the dataparallel error for a Gloo failure (timeouts, vanished peers, peers out of
    reach), or `exc`."""
    message = str(exc)
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    peer = _PEER.search(message)
    address = None if peer is None else peer[1] or peer[2]
    out_of_reach = any(sign in message for sign in _OUT_OF_REACH) or (
        any(sign in message for sign in _PEER_GONE) and found_lost(address or "")
    )
    if address is not None and out_of_reach:
        return LinkLostError(
            f"Gloo {what} on rank {rank} lost its link to {address}: that host has not "
            f"answered for the link timeout ({first}; {LINK_TIMEOUT_VARIABLE}, `dataparallel "
            "run --link-timeout`). The host is down, or the link between the two hosts is (the "
            "launcher may still reach both: a split).",
            address,
        )
    if "timed out" in message.lower() or "timeout" in message.lower():
        return CollectiveTimeoutError(
            f"Gloo {what} on rank {rank} timed out ({first}). A rank may be stuck or calling "
            "other collectives; raise dp.initialize(timeout=...) / DATAPARALLEL_TIMEOUT if it is "
            "just slow."
        )
    if any(sign in message for sign in _PEER_GONE):
        return RankFailedError(
            f"Gloo {what} on rank {rank} failed: another rank failed or exited ({first}). "
            "Look for the first traceback of the job: it names the rank that failed."
        )
    return exc


# -- what Gloo is handed for a host buffer ---------------------------------------------------

# Unsigned integers travel as the signed type of the same width (wrapping sums and products are
# bit-identical); for min/max their sign bit is flipped first, which keeps their order.
_SIGNED_VIEW: dict[str, np.dtype[np.signedinteger]] = {
    "uint32": np.dtype(np.int32),
    "uint64": np.dtype(np.int64),
}
_SIGN_BIT: dict[str, np.unsignedinteger] = {
    "uint32": np.uint32(1 << 31),
    "uint64": np.uint64(1 << 63),
}
_WIDENED: dict[str, np.dtype[np.int32]] = {
    "int16": np.dtype(np.int32),
    "uint16": np.dtype(np.int32),
}
# The dtypes Gloo reduces as they are with any op, by NumPy's type character.
_NATIVE_CHARS = frozenset(
    np.dtype(t).char for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
)


def wire_for(buf: np.ndarray, op: ReduceOp) -> tuple[np.ndarray, Callable[[], None] | None]:
    """Return what Gloo reduces for `buf`, and what to do once it has (None: nothing)."""
    if buf.dtype.char in _NATIVE_CHARS:  # most calls: nothing to change (`dtype.name` is slow)
        return buf, None
    name = buf.dtype.name
    if name in _SIGNED_VIEW:
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            sign = _SIGN_BIT[name]
            np.bitwise_xor(buf, sign, out=buf)
            return buf.view(_SIGNED_VIEW[name]), lambda: np.bitwise_xor(buf, sign, out=buf)
        return buf.view(_SIGNED_VIEW[name]), None
    if name in _WIDENED:
        wide = buf.astype(_WIDENED[name])
        return wide, lambda: np.copyto(buf, wide, casting="unsafe")
    if buf.dtype.kind == "c" and op is not ReduceOp.SUM:
        raise TypeError(f"op={op.value!r} is not defined here for complex values ({name}).")
    return buf, None


def flat(buf: Buffer, where: str) -> np.ndarray:
    """Return `buf` as a 1-D NumPy array; raise on a strided one."""
    array = np.asarray(buf)
    if not array.flags.c_contiguous:
        raise ValueError(f"GlooBackend.{where}: the buffer must be contiguous (got strides).")
    return array.reshape(-1)


def writable(array: np.ndarray, where: str) -> np.ndarray:
    """Return `array`, which a result is written into; raise on a read-only one."""
    if not array.flags.writeable:
        raise ValueError(
            f"GlooBackend.{where}: the buffer is read-only, but the result is written into it; "
            "pass a writable array (e.g. a copy)."
        )
    return array


# -- reduce-scatter in two steps ------------------------------------------------------------

# What Gloo reduce-scatters natively (bool arrives as uint8, bfloat16 widened to float32).
_SCATTERED = frozenset({"int8", "uint8", "int32", "int64", "float16", "float32", "float64"})

_REDUCE = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


class ScatterSteps(NamedTuple):
    """A Gloo reduce-scatter in two steps: the all-to-all to start
    (`torch.distributed.all_to_all_single`'s arguments: the rows received, the bytes sent, their
    split sizes), and what reduces the rows once it is done."""

    args: tuple[torch.Tensor, torch.Tensor, list[int], list[int]]
    finish: Callable[[], None]


def _edges(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


# -- a call in flight ------------------------------------------------------------------------


class GlooHandle:
    """A Gloo work object in flight, with the buffers it needs kept alive until it completes."""

    __slots__ = ("__weakref__", "_done", "_finish", "_keep", "_rank", "_work")

    def __init__(
        self, owner: GlooBackend, work: Work, keep: object, finish: Callable[[], None] | None
    ) -> None:
        self._rank, self._keep, self._finish = owner.rank, keep, finish
        self._work: Work | None = work
        self._done = False
        owner._in_flight.add(self)  # `close()` lets go of its work object

    def wait(self) -> None:
        if self._done:
            return
        if self._work is None:
            raise RankFailedError(
                f"a non-blocking Gloo collective on rank {self._rank} was still in flight "
                "when its world was finalized (dp.finalize(), or an elastic run re-forming it)."
            )
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise translate_error(exc, "non-blocking collective", self._rank) from exc
        self._done = True
        if self._finish is not None:
            self._finish()
        self._work = self._keep = self._finish = None

    def forget(self) -> None:
        """Let go of the work object (its engine is closing: it holds the group's connections).
        One that completed is finished first, so that a later `wait()` returns as it would have."""
        if self._done or self._work is None:
            return
        if self._work.is_completed():
            with contextlib.suppress(Exception):  # a failure: the later wait() says so
                self.wait()
        if not self._done:  # the buffers stay: Gloo may still be writing to them
            self._work = self._finish = None

    def test(self) -> bool:
        if self._done:
            return True
        if self._work is None:
            self.wait()  # raises: the world was finalized first
            return True
        if not self._work.is_completed():
            return False
        self.wait()  # completes the unpacking, or raises the error it completed with
        return True


class GlooBackend(Backend):
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
        timeout: datetime.timedelta | None = None,
        interface: str | None = None,
        sockets: frozenset[str] = frozenset(),
    ) -> None:
        import torch

        self._torch, self._dist, self.group = torch, dist, group
        self._sockets = sockets  # the group's connections, where known (`sever`)
        self._owns_default_group = owns_default_group
        self._timeout = timeout  # for the groups made from this one (`split`, `duplicate`)
        self._interface = interface  # ... and the interface they bind to, as this one did
        self._store_file = store_file
        self._closed = False
        self._in_flight: weakref.WeakSet[GlooHandle] = weakref.WeakSet()
        # Allreduces of big buffers inside hosts, across, inside again (`hierarchy.py`): set by
        # `create` for the world's engine where the world spans hosts of several ranks.
        self.hierarchy: Hierarchy | None = None
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # Every rank's hostname, where the launcher gave no local ranks (the hierarchy's hosts)
        self._hostnames: list[str] | None = None
        if local is None:
            hosts = self._hostnames = [str(h) for h in self.allgather_object(socket.gethostname())]
            local = (hosts[: self.rank].count(hosts[self.rank]), hosts.count(hosts[self.rank]))
        self.local_rank, self.local_size = local
        self._ops: dict[ReduceOp, object] = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.PROD: dist.ReduceOp.PRODUCT,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
        }
        self._options: dict[object, AllreduceOptions] = {}  # `_reduce_in_flight`'s
        atexit.register(self.close)

    @property
    def calls_in_flight(self) -> int:
        """Where the hierarchy's lanes carry the calls across hosts (`Hierarchy.start`), a
        step's buckets all go to them as they come, so that the link never waits for the caller
        to land one. On one host its lanes overlap one call's end with the next's start, as
        Gloo's ring does: one call left in flight."""
        spans = self.hierarchy is not None and self.hierarchy.spans_hosts
        return IN_FLIGHT if spans else 1

    @property
    def owns_default_group(self) -> bool:
        """Whether this engine is torch's default process group, made by `create`."""
        return self._owns_default_group

    @classmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> GlooBackend:
        """Join the Gloo group through `init_method` (`group.join_group`), for initialize.

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
        engine = cls(
            joined.dist,
            joined.group,
            owns_default_group=joined.owns_default_group,
            local=joined.local,
            store_file=joined.store_file,
            timeout=joined.timeout,
            interface=joined.interface,
            sockets=joined.sockets,
        )
        engine.hierarchy = engine._hierarchy(settings)
        if joined.sockets and engine.hierarchy is not None:  # its groups are cut with it
            engine._sockets |= engine.hierarchy.sockets
        return engine

    def _hierarchy(self, settings: Settings) -> Hierarchy | None:
        """The hierarchy of this world (collective; `Hierarchy.build` decides): where it spans
        hosts, or on one host, whose steps go through shared memory. Hosts are the hostnames
        where this engine gathered them, else the launcher's nodes (ranks numbered node by
        node, as every launcher does)."""
        if settings.hierarchical is False or self.size == 1:
            return None
        if self.size != self._dist.get_world_size():
            return None  # its groups would need every process of torch's world
        hosts = self._hostnames
        if hosts is None and self.local_size == self.size:  # one host, known without a call
            hosts = ["0"] * self.size
        if hosts is None:
            hosts = [str(h) for h in self.allgather_object(self.rank - self.local_rank)]
        return Hierarchy.build(self._dist, self._new_group, hosts, self.rank, settings)

    # -- reductions --------------------------------------------------------------------------

    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """`iallreduce`'s call, waited for."""
        buf = writable(flat(buf, "allreduce"), "allreduce")
        if buf.dtype.kind == "c" and op is ReduceOp.PROD:
            buf[...] = self._gathered_product(buf)
            return
        wire, finish = wire_for(buf, op)
        work = self._reduce_in_flight("allreduce", self._torch.from_numpy(wire), op, wire.nbytes)
        try:
            work.wait()
        except RuntimeError as exc:
            raise translate_error(exc, "allreduce", self.rank) from exc
        if finish is not None:
            finish()

    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        buf = writable(flat(buf, "iallreduce"), "iallreduce")
        if buf.dtype.kind == "c" and op is ReduceOp.PROD:
            self.allreduce(buf, op)
            return DoneHandle()
        wire, finish = wire_for(buf, op)
        tensor = self._torch.from_numpy(wire)
        work = self._reduce_in_flight("iallreduce", tensor, op, wire.nbytes)
        return GlooHandle(self, work, (wire, tensor), finish)

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        """Gloo reduces float16 and bfloat16 natively, about as fast as float32."""
        if dtype == "float16":
            return self.iallreduce(buf, op)
        bits = writable(flat(buf, "iallreduce"), "iallreduce")
        tensor = self._torch.from_numpy(bits.view(np.int16)).view(self._torch.bfloat16)
        work = self._reduce_in_flight("iallreduce", tensor, op, bits.nbytes)
        return GlooHandle(self, work, (bits, tensor), None)

    def _reduce_in_flight(self, what: str, tensor: torch.Tensor, op: ReduceOp, nbytes: int) -> Work:
        """Start an allreduce of `tensor` (`nbytes` long): the hierarchy's three steps where it
        takes buffers of that size, else one ring, the group's own call where the group is named
        (torch's default group is found by `dist.all_reduce`): what torch's function checks
        first (a group this rank is not in, a coalescing block, torch function modes) concerns
        no call this engine makes, and a bucket's launch would pay for it at every step.
        Complex values go as pairs of reals, as torch sends them. One frame from the caller to
        Gloo: every bucket of every step comes this way."""
        group = self.group  # before the check: `release` on another thread sets None after it
        self._refuse_if_closed(what)
        reduce_op = self._ops[op]
        try:
            if self.hierarchy is not None and nbytes >= MIN_BYTES:
                # `Carried` has the two methods of a torch work object that handles call
                return self.hierarchy.start(tensor, reduce_op)  # type: ignore[return-value]
            if group is None:
                return self._dist.all_reduce(tensor, op=reduce_op, async_op=True)
            if tensor.is_complex():
                tensor = self._torch.view_as_real(tensor)
            options = self._options.get(reduce_op)
            if options is None:  # the group copies them into each call: made once
                options = self._options[reduce_op] = self._dist.AllreduceOptions()
                options.reduceOp = reduce_op
                options.asyncOp = True
            return group.allreduce([tensor], options)
        except RuntimeError as exc:
            raise translate_error(exc, what, self.rank) from exc

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
        """On Gloo's threads (`_scatter_steps`); dtypes Gloo cannot reduce are reduced at once."""
        steps = self._scatter_steps(send, recv, counts, op)
        if steps is None:
            return DoneHandle()
        work = self._call_tensors(
            "ireduce_scatter", self._dist.all_to_all_single, *steps.args, async_op=True
        )
        return GlooHandle(self, work, steps.args, steps.finish)

    def reduce_scatter(self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp) -> None:
        steps = self._scatter_steps(send, recv, counts, op)
        if steps is not None:
            self._call_tensors("reduce_scatter", self._dist.all_to_all_single, *steps.args)
            steps.finish()

    def _scatter_steps(
        self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp
    ) -> ScatterSteps | None:
        """How Gloo reduce-scatters `send`: an all-to-all of every rank's segment to its rank,
        then the sum (or other `op`) of the rows received, here (faster than Gloo's own
        reduce_scatter). None when nothing is left for Gloo to do (nothing to send, or reduced
        here already)."""
        send, recv = (
            flat(send, "reduce_scatter"),
            writable(flat(recv, "reduce_scatter"), "reduce_scatter"),
        )
        rank, size, edges = self.rank, len(counts), _edges(counts)
        if send.size != edges[-1] or recv.size < counts[rank]:
            raise ValueError(
                f"GlooBackend.reduce_scatter on rank {rank}: counts={counts} do not fit the "
                f"buffers (send holds {send.size} items, recv {recv.size})."
            )
        if edges[-1] == 0:
            return None
        mine = recv[: counts[rank]]
        direct = send.dtype.name in _SCATTERED or (send.dtype.kind == "c" and op is ReduceOp.SUM)
        if not direct:
            whole = send.copy()
            self.allreduce(whole, op)
            mine[...] = whole[edges[rank] : edges[rank + 1]]
            return None
        torch, item = self._torch, send.dtype.itemsize
        raw_send = send.view(np.uint8)
        rows = np.empty((size, counts[rank]), send.dtype)
        args = (
            torch.from_numpy(rows.reshape(-1).view(np.uint8)),
            torch.from_numpy(raw_send if raw_send.flags.writeable else raw_send.copy()),
            [counts[rank] * item] * size,
            [count * item for count in counts],
        )

        def finish() -> None:
            _REDUCE[op].reduce(rows, axis=0, out=mine)

        return ScatterSteps(args, finish)

    def alltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> None:
        send, recv = flat(send, "alltoallv"), writable(flat(recv, "alltoallv"), "alltoallv")
        if send.size < sum(send_counts) or recv.size < sum(recv_counts):
            raise ValueError(
                f"GlooBackend.alltoallv on rank {self.rank}: send_counts={send_counts} and "
                f"recv_counts={recv_counts} do not fit the buffers (send holds {send.size} "
                f"items, recv {recv.size})."
            )
        item = send.dtype.itemsize
        raw_send = send[: sum(send_counts)].view(np.uint8)
        raw_send = raw_send if raw_send.flags.writeable else raw_send.copy()
        raw_recv = recv[: sum(recv_counts)].view(np.uint8)
        torch = self._torch
        self._call_tensors(
            "alltoall",
            self._dist.all_to_all_single,
            torch.from_numpy(raw_recv),
            torch.from_numpy(raw_send),
            [count * item for count in recv_counts],
            [count * item for count in send_counts],
        )

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

    def sendrecv(
        self,
        send: HostBuffer | None,
        dest: int,
        recv: HostBuffer | None,
        source: int,
        sendtag: int = 0,
        recvtag: int = 0,
    ) -> None:
        """The receive posted first, then the send, both on Gloo's threads, then both waited
        for: a ring of blocking sends could wait on each other."""
        torch, works = self._torch, []
        if recv is not None:
            target = torch.from_numpy(writable(flat(recv, "recv"), "recv").view(np.uint8))
            works.append(
                (
                    "recv",
                    target,
                    self._call_tensors(
                        "recv", self._dist.irecv, target, src=self._global(source), tag=recvtag
                    ),
                )
            )
        if send is not None:
            raw = flat(send, "send").view(np.uint8)
            tensor = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
            works.append(
                (
                    "send",
                    tensor,
                    self._call_tensors(
                        "send", self._dist.isend, tensor, dst=self._global(dest), tag=sendtag
                    ),
                )
            )
        for what, _tensor, work in works:
            try:
                work.wait()
            except RuntimeError as exc:
                raise translate_error(exc, what, self.rank) from exc

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

    def _new_group(self, ranks: Sequence[int] | None = None) -> tuple[ProcessGroup, set[str]]:
        """A Gloo group of torch's `ranks` (None: all), made as this engine's group was
        (`group.gloo_group`: its interface, its timeout, the round's connect limit), and
        its connections (collective over torch's default group)."""
        dist = self._dist
        group, made = gloo_group(
            lambda wait: dist.new_group(ranks=ranks, backend="gloo", timeout=wait),
            self._interface,
            self._timeout,
            "a group of every rank" if ranks is None else f"the group of ranks {list(ranks)}",
        )
        assert group is not None  # torch's default group is made otherwise
        return group, made

    def split(self, ranks: Sequence[int]) -> GlooBackend | None:
        """Return an engine on a Gloo group of `ranks` (collective over the whole world)."""
        group, made = self._new_group([self._global(r) for r in ranks])
        if self.rank not in ranks:
            return None
        return GlooBackend(
            self._dist,
            group,
            owns_default_group=False,
            local=None,
            timeout=self._timeout,
            interface=self._interface,
            sockets=frozenset(made),
        )

    def _global(self, rank: int) -> int:
        """torch.distributed names roots by their rank in the default group."""
        return rank if self.group is None else int(self._dist.get_global_rank(self.group, rank))

    def duplicate(self) -> GlooBackend:
        """Return an engine on a private Gloo group over every process (collective); an engine
        of some processes returns itself (every process, member or not, makes a Gloo group)."""
        if self.size != self._dist.get_world_size():
            return self
        group, made = self._new_group()
        twin = GlooBackend(
            self._dist,
            group,
            owns_default_group=False,
            local=(self.local_rank, self.local_size),
            timeout=self._timeout,
            interface=self._interface,
        )
        if self.hierarchy is not None:  # the communication thread's engine: its own groups
            twin.hierarchy = self.hierarchy.duplicate()
            made |= twin.hierarchy.sockets
        twin._sockets = frozenset(made)  # its group's and its hierarchy's
        return twin

    def sever(self) -> None:
        """Shut down the connections the group made (`Backend.sever`): its calls in flight,
        here and at the peers, fail at once ("Connection closed"). Known for groups made over
        an existing default group (`split`, `duplicate`, an elastic round's world), whose
        world can lose a member and go on; a default group this engine made has none listed.
        The hierarchy's waits on its host's words through shared memory end too."""
        shut_down(self._sockets)
        if self.hierarchy is not None:
            self.hierarchy.sever()

    def close(self) -> None:
        """Destroy the Gloo group and let go of it and of the handles in flight, so that its
        connections close (safe to call twice; run by `dp.finalize()` and at interpreter exit).

        torch leaves a group's connections open while anything holds the group or one of its
        work objects, hence the letting go of the handles too (`GlooHandle.forget`). Once the
        connections close, a peer still in a collective with this process fails at once
        (`RankFailedError`) instead of waiting out the timeout: an elastic run's survivors rely
        on it (docs/elastic.md). Letting go of the group joins its worker threads, so it waits
        for the calls they are in, which may wait on a peer that waits on this process: a broken
        world's engines are first cut (`sever`: the connections the group made are shut down,
        and those calls fail), then released side by side (`release()` hands the last step to
        the caller).
        """
        self.release()()

    def release(self) -> Callable[[], None]:
        """`close`, but for letting go of the group: the returned function drops the last
        reference, whose teardown joins Gloo's worker threads, and so waits for the calls they
        are in (`Backend.release`)."""
        if self._closed:
            return _let_go
        self._closed = True
        atexit.unregister(self.close)
        if self.hierarchy is not None:
            self.hierarchy.close()
        for handle in list(self._in_flight):
            handle.forget()
        group, self.group = self.group, None  # calls fail from now on: `_call_tensors`
        dist = self._dist
        if not dist.is_initialized():
            return _let_go
        if self._owns_default_group:
            dist.destroy_process_group()
            # Free the group's store now, while the interpreter is whole: a file:// store removes
            # its file in its destructor, which interpreter teardown does not always run, and
            # which two ranks finishing at once can both skip (`remove_if_every_store_left`).
            gc.collect()
            if self._store_file is not None:
                remove_if_every_store_left(self._store_file, self.size)
            return _let_go
        with contextlib.suppress(ValueError, RuntimeError):  # gone with the user's default group
            dist.destroy_process_group(group)
        # The last reference, unless the user holds one: once dropped, the connections close.
        held = [group]
        del group
        return held.clear

    # -- helpers -----------------------------------------------------------------------------

    def _call(
        self, what: str, fn: Callable[..., object], array: np.ndarray, **kwargs: object
    ) -> None:
        self._call_tensors(what, fn, self._torch.from_numpy(array), **kwargs)

    def _call_tensors(
        self, what: str, fn: Callable[..., _R], *args: object, **kwargs: object
    ) -> _R:
        group = self.group  # before the check: `release` on another thread sets None after it
        self._refuse_if_closed(what)
        try:
            return fn(*args, group=group, **kwargs)
        except RuntimeError as exc:
            raise translate_error(exc, what, self.rank) from exc

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:  # its group is gone: None would name torch's default group
            raise RuntimeError(
                f"Gloo {what} on a closed engine (dp.finalize() ran): dp.initialize() again."
            )

    def _start(
        self, what: str, fn: Callable[..., Work], tensor: torch.Tensor, **kwargs: object
    ) -> Work:
        return self._call_tensors(what, fn, tensor, async_op=True, **kwargs)


def _let_go() -> None:
    """What is left of a release that let go of everything already (`GlooBackend.release`)."""
