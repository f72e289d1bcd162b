"""How `ZeroRedundancyOptimizer` brings every rank's updated segments back, and when they land.

Rank r owns segment r of every bucket (`layout`), so each bucket is one plain allgather straight
into its slab. On a busy node each call costs about as much whatever its size (on Gloo a call is
a rendezvous of the ranks' worker threads), so consecutive buckets are merged into one call while
their total stays within `merge_bytes`: this rank's segments are packed end to end, gathered into
one receive buffer, and copied back into their buckets; a bucket of `merge_bytes` or more goes
alone, in place. On Gloo (`broadcasts`) each call is `size` broadcasts, rank r's segments from
rank r, all in flight at once on Gloo's threads, faster there than Gloo's ring allgather. Staged
(parameters on a device, which MPI and Gloo cannot read): every call has its own pinned host
buffers, one copy each way per bucket. Figures: benchmarks/NOTES.md.

`overlap_with_forward` (`ForwardOverlap`): `step()` only starts the calls, and a forward pre-hook
on every module holding some of the parameters waits for the calls carrying its buckets just
before it runs (as FSDP's prefetch); the model's forward post-hook waits for the rest. The calls
start in the order the model registers its modules (the same on every rank). The model's
`state_dict()`/`load_state_dict()`, the optimizer's entry points and `dp.finalize()` wait too. The
limit: a parameter read outside its module's forward and those waits (a norm logged right after
`step()`, a parent reading `self.child.weight`) may be the old value until the forward ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dataparallel import world
from dataparallel.backends.base import Backend, Handle
from dataparallel.torch._hooks import remove_hooks
from dataparallel.torch._zero.layout import Bucket, Slab, host_buffer

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardOverlap", "SliceGather"]


@dataclass
class _Call:
    """One exchange: its buckets, and where this rank's segments go and every rank's land."""

    buckets: list[int]
    rows: torch.Tensor  # uint8, `size` equal rows: row r is rank r's segments end to end
    send: torch.Tensor | None  # uint8: this rank's segments packed (None: its row is sent)
    merged: bool  # whether `rows` is a receive buffer (else: the one bucket, in place)
    # (always, when staged: the buckets are on a device)


class SliceGather:
    """The exchanges of the updated segments, made once over a layout.

    Args:
        slabs, buckets: the layout (`layout.lay_out_group`).
        backend: the engine.
        merge_bytes: the most bytes (the whole of the buckets) that one merged call gathers;
            0 makes one call per bucket.
        broadcasts: make each exchange `size` broadcasts, rank r's row from rank r, instead of
            one allgather: no send buffer (a bucket alone goes straight from and into the slab
            buffer; merged buckets are packed into this rank's row of the receive buffer).
        staged: the slabs are on a device: every call goes through host buffers.
    """

    def __init__(
        self,
        slabs: list[Slab],
        buckets: list[Bucket],
        backend: Backend,
        merge_bytes: int,
        broadcasts: bool = False,
        staged: bool = False,
    ) -> None:
        self.slabs, self.buckets, self.backend = slabs, buckets, backend
        self.broadcasts = broadcasts
        groups: list[list[int]] = []
        total = 0
        for b, bucket in enumerate(buckets):
            nbytes = self._bytes(bucket, bucket.stop - bucket.start)
            if not groups or total + nbytes > merge_bytes:
                groups.append([])
                total = 0
            groups[-1].append(b)
            total += nbytes
        self.calls: list[_Call] = []
        for group in groups:
            part = sum(self._bytes(buckets[b], buckets[b].counts[0]) for b in group)
            merged = len(group) > 1 or staged
            if merged:
                rows = host_buffer(part * backend.size, torch.uint8, staged)
            else:
                rows = self._raw(group[0])
            send = None if broadcasts else host_buffer(part, torch.uint8, staged)
            self.calls.append(_Call(group, rows.view(backend.size, part), send, merged))
        self._call_of = {b: c for c, call in enumerate(self.calls) for b in call.buckets}
        # The calls started and not landed: their index in `calls` -> their handles.
        self._flights: dict[int, list[Handle]] = {}

    def _bytes(self, bucket: Bucket, items: int) -> int:
        return items * self.slabs[bucket.slab].data.element_size()

    def call_of(self, bucket: int) -> int:
        """The index in `calls` of the call that carries `bucket`."""
        return self._call_of[bucket]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held (send and receive)."""
        held = [(c.send, c.rows if c.merged else None) for c in self.calls]
        return sum(t.nbytes for pair in held for t in pair if t is not None)

    def _raw(self, b: int) -> torch.Tensor:
        """Bucket `b` of its slab, as bytes (on the parameters' device)."""
        bucket = self.buckets[b]
        data = self.slabs[bucket.slab].data
        item = data.element_size()
        return data.view(torch.uint8)[bucket.start * item : bucket.stop * item]

    def run(self) -> None:
        """Every rank's segments to every rank: all calls started, then all waited for."""
        self.start()
        self.finish()

    def start(self, order: list[int] | None = None) -> None:
        """Start every call (in `order`, indices into `calls`: the same on every rank); each
        lands at `finish` (that call's) or `finish()` (all of them)."""
        for c in range(len(self.calls)) if order is None else order:
            call = self.calls[c]
            mine = call.rows[self.backend.rank]
            if call.send is not None:  # an allgather: from the send buffer into the rows
                self._pack(call, call.send)
                handle = self.backend.iallgather(call.send.numpy(), call.rows.numpy())
                self._flights[c] = [handle]
                continue
            if call.merged:
                self._pack(call, mine)
            self._flights[c] = self._broadcast(call.rows)

    @property
    def in_flight(self) -> bool:
        """Whether some call started has not landed yet."""
        return bool(self._flights)

    def finish(self, calls: list[int] | None = None) -> None:
        """Wait for `calls` (default: every call in flight) and copy merged ones back; a call
        not in flight is skipped."""
        for c in list(self._flights) if calls is None else calls:
            handles = self._flights.pop(c, None)
            if handles is None:
                continue
            for handle in handles:
                handle.wait()
            call = self.calls[c]
            if not call.merged:
                continue
            at = 0
            for b in call.buckets:
                bucket, raw = self.buckets[b], self._raw(b)
                n = self._bytes(bucket, bucket.counts[0])
                # Staged: one host-to-device copy per bucket (blocking: the step's next kernels
                # see the whole bucket).
                raw.view(self.backend.size, n).copy_(call.rows[:, at : at + n])
                at += n

    def _pack(self, call: _Call, into: torch.Tensor) -> None:
        """This rank's segments of `call`'s buckets, end to end, into `into`.

        Staged, each is one device-to-host copy into pinned memory: a blocking `copy_`, which
        waits for the stream that produced the segment (the inner optimizer's step) before the
        engine reads the bytes."""
        at = 0
        for b in call.buckets:
            bucket, raw = self.buckets[b], self._raw(b)
            n = self._bytes(bucket, bucket.counts[0])
            lo = self._bytes(bucket, bucket.mine[0] - bucket.start)
            into[at : at + n].copy_(raw[lo : lo + n])
            at += n

    def _broadcast(self, rows: torch.Tensor) -> list[Handle]:
        """Broadcast row r of `rows` (`size` equal rows, bytes) from rank r, all in flight."""
        if rows.numel() == 0:
            return []
        return [self.backend.ibroadcast(rows[r].numpy(), r) for r in range(self.backend.size)]


class ForwardOverlap:
    """Where each bucket's exchange is waited for in the forward of `model`.

    Args:
        model: the module whose forward runs next (the bare model, or its wrapper).
        params: the optimizer's parameters, in its order (`Bucket.params` index them).
        buckets: the optimizer's buckets.

    Raises:
        ValueError: `model` holds none of `params`.
    """

    def __init__(
        self, model: torch.nn.Module, params: list[torch.Tensor], buckets: list[Bucket]
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "ZeroRedundancyOptimizer: overlap_with_forward takes the model (a "
                f"torch.nn.Module) whose forward runs after step(), got {type(model).__name__}."
            )
        index = {id(p): k for k, p in enumerate(params)}
        bucket_of = {k: b for b, bucket in enumerate(buckets) for k in bucket.params}
        # Each module holding some of the parameters, with their buckets (registration order).
        self.modules: list[tuple[torch.nn.Module, list[int]]] = []
        for module in model.modules():
            held = sorted({bucket_of[index[id(p)]] for p in _own(module, index)})
            if held:
                self.modules.append((module, held))
        if not self.modules:
            raise ValueError(
                f"ZeroRedundancyOptimizer: overlap_with_forward={type(model).__name__} holds "
                "none of the optimizer's parameters, so its forward cannot wait for them. Give "
                "the model whose parameters the optimizer steps (or its wrapper)."
            )
        order: list[int] = []
        for _, held in self.modules:
            order += [b for b in held if b not in order]
        self.order = order + [b for b in range(len(buckets)) if b not in order]
        self._gather: SliceGather | None = None
        self._pending: list[world.Waitable] | None = None
        self._handles: list[RemovableHandle] = []
        self._cleanup = weakref.finalize(self, remove_hooks, self._handles)
        ref = weakref.ref(self)
        for module, held in self.modules:
            self._handles.append(module.register_forward_pre_hook(_waiter(ref, held)))
            self._handles.append(module.register_state_dict_pre_hook(_waiter(ref, None)))
            self._handles.append(module.register_load_state_dict_pre_hook(_waiter(ref, None)))
        self._handles.append(model.register_forward_hook(_waiter(ref, None), always_call=True))

    def start(self, gather: SliceGather) -> None:
        """Start `gather`'s calls, the first module's buckets first; they land in the hooks."""
        self.land()
        calls: list[int] = []
        for b in self.order:
            c = gather.call_of(b)
            if c not in calls:
                calls.append(c)
        gather.start(calls)
        self._gather = gather
        self._pending = world.current().pending
        self._pending.append(self)

    def land(self, buckets: list[int] | None = None) -> None:
        """Wait for the calls carrying `buckets` (default: every call in flight)."""
        gather = self._gather
        if gather is None:
            return
        gather.finish(None if buckets is None else [gather.call_of(b) for b in buckets])
        if not gather.in_flight:
            self._gather = None
            if self._pending is not None and self in self._pending:
                self._pending.remove(self)
            self._pending = None

    def wait(self) -> None:
        """What `dp.finalize()` and `dp.wait_all()` call on the requests in flight."""
        self.land()

    def close(self) -> None:
        """Land what is in flight and take the hooks off the model."""
        self.land()
        self._cleanup()

    def drop(self) -> None:
        """Forget the exchange in flight (its world is gone: an elastic re-form) and take the
        hooks off the model."""
        if self._pending is not None and self in self._pending:
            self._pending.remove(self)
        self._gather = self._pending = None
        self._cleanup()


def _own(module: torch.nn.Module, index: dict[int, int]) -> list[torch.Tensor]:
    """`module`'s own parameters (not its children's) that the optimizer steps."""
    return [p for p in module.parameters(recurse=False) if id(p) in index]


def _waiter(ref: weakref.ref[ForwardOverlap], buckets: list[int] | None) -> Callable[..., None]:
    """A hook (any signature) that lands `buckets` (None: all) of the overlap `ref` holds."""

    def hook(*_: object, **__: object) -> None:
        overlap = ref()
        if overlap is not None:
            overlap.land(buckets)

    return hook
