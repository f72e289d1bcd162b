"""Stage 2 of `ZeroRedundancyOptimizer`: gradients reduce-scattered during `backward()`.

A post-accumulate-grad hook on every trainable parameter marks it ready; a bucket whose
parameters are all ready is packed into a send buffer (its parameters' `.grad` freed once every
bucket they overlap is packed) and reduce-scattered, so that this rank receives the sum of its
segment only, into its gradient shard. Buckets are launched strictly in one order, the same on
every rank (that of `launch_order`), while backward runs when the node has a core to spare
(`_buckets.overlaps`), else all at the end of the pass; at the end of every pass the buckets not
launched yet go out, their parameters without a gradient sending zeros. Every backward pass is
reduced (as DeepSpeed's stage 2): accumulation adds each pass's shard into the last, so no rank
ever holds more than its shard and the buckets in flight. Whether a parameter had a gradient on
some rank travels once per step (an allreduce of one flag per parameter), so that a parameter
no rank used keeps no gradient, as in one process.

Send buffers come from a pool of at most `MAX_IN_FLIGHT + 1` buffers of one bucket per dtype.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.torch._hooks import claim, make_hook, remove_hooks
from dataparallel.torch._hooks import owner as owner_of
from dataparallel.torch._zero_layout import Bucket, Flat

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientShards", "launch_order", "wire_dtype"]

# Reduce-scatters left in flight when the next starts, on engines that progress by themselves.
MAX_IN_FLIGHT = 1


def launch_order(buckets: list[Bucket]) -> list[int]:
    """Buckets in the order backward usually completes them: latest parameters first."""
    return sorted(range(len(buckets)), key=lambda b: (-max(buckets[b].params), buckets[b].start))


def wire_dtype(dtype: torch.dtype, backend: Backend) -> torch.dtype:
    """The dtype a gradient bucket is reduced in: its own where the engine reduces it natively,
    else float32 (bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    return dtype if name in backend.native_dtypes else torch.float32


class _Pool:
    """Buffers of one bucket's items per dtype, taken and given back (allocated once)."""

    def __init__(self, items: int) -> None:
        self.items, self._free = items, dict[torch.dtype, list[torch.Tensor]]()
        self.allocated = 0  # bytes

    def take(self, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault(dtype, [])
        if free:
            return free.pop()
        buf = torch.empty(self.items, dtype=dtype)
        self.allocated += buf.nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[buf.dtype].append(buf)


class GradientShards:
    """Reduce-scatter the gradients of `params` into this rank's shards while backward runs.

    Args:
        params: every parameter of the optimizer, by index.
        flats, buckets: their layout (`_zero_layout.plan_group`).
        backend: the engine.
        average: divide the sums by the world's size.
        overlap: launch buckets while backward runs (else at the end of each pass).
    """

    # This pass's state (`_new_pass`): a callback queued, parameters ready, their buckets'
    # parameters not ready yet, buckets each parameter has left to be packed in, the next bucket.
    _queued: bool
    _ready: list[bool]
    _pending: list[int]
    _left: list[int]
    _next: int

    def __init__(
        self,
        params: list[torch.Tensor],
        flats: list[Flat],
        buckets: list[Bucket],
        backend: Backend,
        *,
        average: bool,
        overlap: bool,
    ) -> None:
        self.params, self.flats, self.buckets, self.backend = params, flats, buckets, backend
        self.scale = 1.0 / backend.size if average else 1.0
        self.overlap, self.displaced = overlap, False
        self.order = launch_order(buckets)
        position = {b: i for i, b in enumerate(self.order)}
        self.buckets_of: list[list[int]] = [[] for _ in params]
        for b in self.order:
            for k in buckets[b].params:
                self.buckets_of[k].append(position[b])
        self.shards = [torch.zeros(f.shard_items, dtype=f.dtype) for f in flats]
        self._wires = [wire_dtype(f.dtype, backend) for f in flats]
        self._pool = _Pool(max((b.stop - b.start for b in buckets), default=0))
        self._flights: list[tuple[int, Handle, torch.Tensor, torch.Tensor | None]] = []
        self._handles: list[RemovableHandle] = []
        self._cleanup = weakref.finalize(self, remove_hooks, self._handles)
        ref = weakref.ref(self)
        for k, p in enumerate(params):
            if p.requires_grad:
                claim(p, self)
                self._handles.append(p.register_post_accumulate_grad_hook(make_hook(ref, k)))
        self.had = np.zeros(len(params), np.float32)
        self._fresh = [True] * len(buckets)
        self._new_pass()

    @property
    def gradient_bytes(self) -> int:
        """Bytes this rank holds for gradients between steps: its shards and the send pool."""
        return sum(s.nbytes for s in self.shards) + self._pool.allocated

    def close(self) -> None:
        """Remove the hooks (the layout changed: a new `GradientShards` takes over)."""
        self._cleanup()

    # -- the hooks' side ---------------------------------------------------------------------

    def refresh(self) -> bool:
        """Called when a newer wrapper claimed one of the parameters: it reduces them now."""
        self.displaced = True
        return False

    def on_grad(self, k: int) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
            self._queued = True
        if self._ready[k]:
            return
        self._ready[k] = True
        for position in self.buckets_of[k]:
            self._pending[position] -= 1
        if self.overlap:
            self._launch_ready()

    def _new_pass(self) -> None:
        self._queued = False
        self._ready = [False] * len(self.params)
        self._pending = [len(self.buckets[b].params) for b in self.order]
        self._left = [len(positions) for positions in self.buckets_of]
        self._next = 0

    def _end_of_pass(self) -> None:
        self.check()
        self._pending = [0] * len(self.order)
        self._launch_ready()
        self._new_pass()

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._pending[self._next] == 0:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket, rank = self.buckets[b], self.backend.rank
        flat, wire = self.flats[bucket.flat], self._wires[bucket.flat]
        if not self.backend.progresses:  # MPI: one call in flight at a time (`fusion.py`)
            self.land()
        elif len(self._flights) > MAX_IN_FLIGHT:
            self._land(self._flights.pop(0))
        base = self._pool.take(wire)
        send = base[: bucket.stop - bucket.start]
        for k in bucket.params:
            p, at = self.params[k], flat.offsets[k]
            lo, hi = max(at, bucket.start), min(at + p.numel(), bucket.stop)
            target = send[lo - bucket.start : hi - bucket.start]
            if p.grad is None:
                target.zero_()
            else:
                target.copy_(p.grad.reshape(-1)[lo - at : hi - at])
                self.had[k] = 1
            self._left[k] -= 1
            if self._left[k] == 0:
                p.grad = None  # every bucket it overlaps is packed: this rank keeps its shard only
        mine = bucket.counts[rank]
        shard = self.shards[bucket.flat][bucket.shard_at : bucket.shard_at + mine]
        spare = None
        if self._fresh[b] and wire == flat.dtype:
            recv = shard
        else:
            spare = self._pool.take(wire)
            recv = spare[:mine]
        handle = self.backend.ireduce_scatter(
            send.numpy(), recv.numpy(), bucket.counts, ReduceOp.SUM
        )
        self._flights.append((b, handle, base, spare))

    def _land(self, flight: tuple[int, Handle, torch.Tensor, torch.Tensor | None]) -> None:
        b, handle, base, spare = flight
        handle.wait()
        bucket = self.buckets[b]
        mine = bucket.counts[self.backend.rank]
        shard = self.shards[bucket.flat][bucket.shard_at : bucket.shard_at + mine]
        if spare is None:
            if self.scale != 1.0:
                shard.mul_(self.scale)
        else:
            received = spare[:mine]
            if self.scale != 1.0:
                received.mul_(self.scale)  # in the wire dtype, before any narrowing
            if self._fresh[b]:
                shard.copy_(received)
            else:
                shard.add_(received)
            self._pool.give(spare)
        self._fresh[b] = False
        self._pool.give(base)

    def land(self) -> None:
        """Complete every reduce-scatter in flight."""
        flights, self._flights = self._flights, []
        for flight in flights:
            self._land(flight)

    # -- the step's side ---------------------------------------------------------------------

    def check(self) -> None:
        if self.displaced:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(stage=2): another gradient reducer "
                "(DataParallelModel or DistributedOptimizer) was made over its parameters "
                "after it, so their gradients would be reduced twice. Use stage=1 under a "
                "model wrapper, or stage=2 on the unwrapped model."
            )

    def wait(self) -> np.ndarray:
        """Complete this step's reductions; return which parameters had a gradient on any rank."""
        self.check()
        if self._queued:  # a pass still running: not expected between backward and step
            self._end_of_pass()
        self.land()
        had = self.had.copy()
        if self.backend.size > 1:
            self.backend.allreduce(had, ReduceOp.MAX)
        return had

    def reset(self) -> None:
        """Begin a new step: reductions in flight complete (every rank started them), then the
        shards are overwritten by the next pass instead of added to."""
        self.land()
        self._fresh = [True] * len(self.buckets)
        self.had[:] = 0
        self._new_pass()


def refuse_reduced(params: list[tuple[str, torch.Tensor]]) -> None:
    """Raise `ValueError` for a parameter whose gradients a model wrapper already reduces."""
    for name, p in params:
        reducer = owner_of(p)
        if reducer is not None and not isinstance(reducer, GradientShards):
            who = getattr(reducer, "owner", type(reducer).__name__)
            raise ValueError(
                f"ZeroRedundancyOptimizer(stage=2): {name} is already reduced by a {who}; "
                "stage 2 reduce-scatters the gradients itself, so they would be reduced twice. "
                "Give stage=2 the unwrapped model's parameters, or use stage=1 under the "
                "wrapper."
            )
