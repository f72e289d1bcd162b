"""Stage 2 of `ZeroRedundancyOptimizer`: gradients reduce-scattered during `backward()`.

The hook engine that `dp.torch.DataParallelModel` reduces through marks each parameter ready and
launches the buckets whose parameters all are; here a launch packs a bucket into a send buffer
(its parameters' `.grad` freed once every bucket they overlap is packed) and reduce-scatters it,
so that this rank receives the sum of its segment only, into its gradient shard. Buckets go out
strictly in one order, the same on every rank (`launch_order`), while backward runs when the
node has a core to spare, else all at the end of the pass; at the end of every pass the buckets
not launched yet go out, parameters without a gradient sending zeros. Every backward pass is
reduced (as DeepSpeed's stage 2): each pass's shard adds into the last, so no rank holds more
than its shard and the buckets in flight. Whether a parameter had a gradient on some rank
travels once per step (an allreduce of one flag per parameter), so that a parameter no rank used
keeps no gradient, as in one process.

Every rank must run as many passes before each `step()`: a pass after a step's first begins
with an exchange of the flags' shape, and both end in one slot per rank saying what that rank is
doing (`PASS` or `STEP`): where the slots differ, every rank raises `CollectiveMismatchError`
before sending anything else. A step of one pass costs nothing more (its slots ride on the flags).

Each reduce-scatter is one of a `Fusion`'s flights, so that what is in flight is bounded as every
other bucket's call is. Send and receive buffers come from the one `BufferPool`, at their exact
sizes (they count in `gradient_bytes`); a bucket of one parameter sends its gradient in place.
`staged` (parameters on a device, which the engines cannot read): the shards stay on the device;
a bucket is packed there, crosses to a pinned host buffer in one copy, and what this rank
receives comes back in one copy before it is scaled and added to the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import torch

from dataparallel.arrays.actions import Scatter
from dataparallel.arrays.fusion import Fusion, ShardFlight
from dataparallel.arrays.pool import BufferPool
from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.errors import CollectiveMismatchError
from dataparallel.torch._hooks import GradientHooks
from dataparallel.torch._zero.layout import Bucket, Slab, host_buffer

__all__ = ["GradientShards", "TorchMemory"]


def launch_order(buckets: list[Bucket]) -> list[int]:
    """Buckets in the order backward usually completes them: latest parameters first."""
    return sorted(range(len(buckets)), key=lambda b: (-max(buckets[b].params), buckets[b].start))


def reduced_dtype(dtype: torch.dtype, backend: Backend) -> torch.dtype:
    """The dtype a gradient bucket is reduced in: its own where the engine reduces it natively,
    else float32 (bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    return dtype if name in backend.native_dtypes else torch.float32


def sent_counts(bucket: Bucket) -> list[int]:
    """Items per rank of a bucket's reduce-scatter: its padding (which ends the last ranks'
    segments) is not sent, so that a bucket of one parameter sends its gradient as it is."""
    part, items = bucket.counts[0], bucket.filled - bucket.start
    return [min(part, max(0, items - r * part)) for r in range(len(bucket.counts))]


class TorchMemory:
    """Where a `BufferPool` of torch tensors makes them: on `device`, or (None) on the host,
    pinned if `staged` (`host_buffer`), so that the copies to and from the device are DMA."""

    def __init__(self, device: torch.device | None = None, staged: bool = False) -> None:
        self.device, self.staged = device, staged

    def empty(self, dtype: Hashable, items: int) -> torch.Tensor:
        assert isinstance(dtype, torch.dtype)
        if self.device is None:
            return host_buffer(items, dtype, self.staged)
        return torch.empty(items, dtype=dtype, device=self.device)

    def base(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if buf._base is None else buf._base

    def nbytes(self, buf: torch.Tensor) -> int:
        return buf.nbytes


# What a rank is doing, in its slot of a step's flags (or of a later pass's check): it began
# another backward pass, or it called `step()`. Every rank exchanged the same slots, so every
# rank reaches the same verdict.
PASS, STEP = 1.0, 2.0


def pass_mismatch(kinds: np.ndarray, doing: float) -> CollectiveMismatchError | None:
    """The error to raise unless every rank's slot in `kinds` says `doing`."""
    if (kinds == doing).all():
        return None
    passing = [r for r, kind in enumerate(kinds) if kind == PASS]
    stepping = [r for r, kind in enumerate(kinds) if kind == STEP]
    return CollectiveMismatchError(
        "ZeroRedundancyOptimizer(stage=2): the ranks ran different numbers of backward "
        f"passes before step(): {_ranks(passing)} began another pass where "
        f"{_ranks(stepping)} called step(). Every rank must run as many backward passes "
        "(and as many steps); this step's gradients are discarded: call zero_grad() on "
        "every rank to go on."
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class GradientShards:
    """Reduce-scatter the gradients of `params` into this rank's shards while backward runs.

    Args:
        params: every parameter of the optimizer, by index.
        slabs, buckets: their layout (`layout.lay_out_group`).
        backend: the engine.
        average: divide the sums by the world's size.
        overlap: launch buckets while backward runs (else at the end of each pass).
        staged: the parameters are on a device: stage every bucket through host buffers.
    """

    # This pass's state (`_new_pass`), beside the hooks' (which parameters are ready, which
    # bucket is next, in `order`'s positions): buckets each parameter has left to be packed in.
    _probing: Handle | None  # this pass's check, begun at its first gradient (passes after one)
    _joining: Callable[[], None] | None  # this pass's join handshake, to finish (`join_pass`)
    _left: list[int]

    def __init__(
        self,
        params: list[torch.Tensor],
        slabs: list[Slab],
        buckets: list[Bucket],
        backend: Backend,
        *,
        average: bool,
        overlap: bool,
        staged: bool = False,
    ) -> None:
        self.params, self.slabs, self.buckets, self.backend = params, slabs, buckets, backend
        self.scale = 1.0 / backend.size if average else 1.0
        self.overlap, self.displaced = overlap, False
        self.order = launch_order(buckets)
        self._hooks = GradientHooks(self)
        self._hooks.hook(params)
        self._hooks.lay_out([buckets[b].params for b in self.order], len(params))
        self.shards = [
            torch.zeros(f.shard_items, dtype=f.dtype, device=f.data.device) for f in slabs
        ]
        self._wires = [reduced_dtype(f.dtype, backend) for f in slabs]
        # What the engine reads and writes: host buffers (pinned when staged).
        self._pool = BufferPool(TorchMemory(staged=staged), exact=True)
        # Staged: buffers on the parameters' device, that buckets are packed in and land in.
        self._staging = (
            BufferPool(TorchMemory(slabs[0].data.device), exact=True) if staged and slabs else None
        )
        # The reduce-scatters in flight, summed and not scaled (the shards are scaled in torch,
        # `_land`); nothing is queued on it (every flight is packed by `_pack`), so its
        # bucket size does not matter.
        self._fusion = Fusion(backend, Scatter(ReduceOp.SUM), bucket_bytes=1)
        # Whether each parameter had a gradient, then one slot per rank (`PASS`/`STEP`).
        self.had = np.zeros(len(params) + backend.size, np.float32)
        self._probe = np.zeros_like(self.had)  # a later pass's check: no flags, its slot
        self._passes = 0  # passes ended since the last step
        self._fresh = [True] * len(buckets)
        # Set inside a `dp.torch.join` block: a pass's handshake, begun at its first gradient;
        # what it returns (if anything) finishes it, before the pass's first bucket.
        self.join_pass: Callable[[], Callable[[], None] | None] | None = None
        self._new_pass()

    @property
    def gradient_bytes(self) -> int:
        """Bytes this rank holds for gradients between steps: its shards and the send pool
        (and, staged, the device buffers the buckets pass through)."""
        staging = self._staging.allocated if self._staging is not None else 0
        return sum(s.nbytes for s in self.shards) + self._pool.allocated + staging

    def close(self) -> None:
        """Remove the hooks (the layout changed: a new `GradientShards` takes over)."""
        self._hooks.close()

    # -- the hooks' side ---------------------------------------------------------------------

    def refresh(self) -> bool:
        """Called when a newer wrapper claimed one of the parameters: it reduces them now."""
        self.displaced = True
        return False

    def on_grad(self, k: int) -> None:
        if self._hooks.queue(self._end_of_pass):
            if self.join_pass is not None and self.backend.size > 1:
                if not self.backend.progresses:
                    self.land()  # MPI: one call in flight at a time
                self._joining = self.join_pass()
            if self._joining is None:
                self._begin_pass()  # else once the handshake is done (`_settle_probe`)
        if self._hooks.mark(k) and self.overlap:
            self._hooks.launch_ready(self._launch_at)

    def _begin_pass(self) -> None:
        """A pass's first gradient: after a step's first pass, begin its check."""
        if self._passes and self.backend.size > 1:  # another pass: check before sending
            if not self.backend.progresses:
                self.land()  # MPI: one call in flight at a time
            self._probe[:] = 0
            self._probe[len(self.params) + self.backend.rank] = PASS
            # Non-blocking on every engine, as the step's flags: MPI matches no blocking
            # collective with a non-blocking one.
            self._probing = self.backend.iallreduce(self._probe, ReduceOp.MAX)

    def shadow_pass(self) -> None:
        """A pass without gradients, by a rank that has joined (`join`): the same
        calls as the others' pass, sending zeros; no parameter had a gradient here."""
        self._begin_pass()
        self._end_of_pass()

    def _new_pass(self) -> None:
        self._hooks.queued = False
        self._hooks.clear()
        self._probing = None
        self._joining = None
        self._left = [len(positions) for positions in self._hooks.buckets_of]

    def _end_of_pass(self) -> None:
        self.check()
        self._hooks.launch_rest(self._launch_at)
        self._settle_probe()  # where no bucket was sent (no trainable parameter)
        self._passes += 1
        self._new_pass()

    def _launch_at(self, position: int) -> None:
        self._launch(self.order[position])

    def _settle_probe(self) -> None:
        """Wait for this pass's check, if one is in flight; raise where the ranks disagree.
        In a join block, finish the pass's handshake first, then begin the check."""
        joining, self._joining = self._joining, None
        if joining is not None:
            joining()
            self._begin_pass()
        probing, self._probing = self._probing, None
        if probing is not None:
            probing.wait()
            self._agree(self._probe, PASS)

    def _launch(self, b: int) -> None:
        self._settle_probe()  # this pass's check, before its first bucket
        self._fusion.reduce_scatter(lambda: self._pack(b))

    def _pack(self, b: int) -> ShardFlight:
        """Pack bucket `b` for its reduce-scatter (the calls before it have landed as
        `Fusion` requires, so their buffers are free again)."""
        bucket, rank = self.buckets[b], self.backend.rank
        slab, wire = self.slabs[bucket.slab], self._wires[bucket.slab]
        base, send = None, None if self._staging is not None else self._alone(bucket, wire)
        if send is not None:  # one parameter: its gradient goes as it is
            self.had[bucket.params[0]] = 1
        else:
            items = bucket.filled - bucket.start
            base = self._pool.take(wire, items)
            send = base[:items]
            packed = send if self._staging is None else self._staging.take(wire, items)
            for k in bucket.params:
                p, at = self.params[k], slab.offsets[k] - bucket.start
                target = packed[at : at + p.numel()]
                if p.grad is None:
                    target.zero_()
                else:
                    target.copy_(p.grad.reshape(-1))
                    self.had[k] = 1
            if self._staging is not None:
                # One device-to-host copy per bucket. Blocking into pinned memory: it waits for
                # the stream that produced the gradients (and packed them) before the engine
                # reads `send`.
                send.copy_(packed[:items])
                self._staging.give(packed)
        for k in bucket.params:
            self._left[k] -= 1
            if self._left[k] == 0:  # packed (or in flight, holding it): this rank keeps its shard
                self.params[k].grad = None
        counts = sent_counts(bucket)
        mine = counts[rank]
        shard = self.shards[bucket.slab][bucket.shard_at : bucket.shard_at + mine]
        spare = None
        # Into the shard only for the step's first reduction of the bucket: a later pass's
        # must not overwrite the shard while the first is still in flight (it adds on landing).
        fresh, self._fresh[b] = self._fresh[b], False
        if fresh and wire == slab.dtype and self._staging is None:
            recv = shard
        else:
            spare = self._pool.take(wire, mine)
            recv = spare[:mine]
        sent = base if base is not None else send

        def land(_: np.ndarray) -> None:
            self._land(b, shard, spare, fresh)
            if sent is not send:  # packed into a pooled buffer, not sent in place
                self._pool.give(sent)

        name = str(wire).removeprefix("torch.")
        return ShardFlight(name, send.numpy(), recv.numpy(), tuple(counts), land)

    def _alone(self, bucket: Bucket, wire: torch.dtype) -> torch.Tensor | None:
        """The gradient of a bucket's one parameter, when it can be sent in place."""
        if len(bucket.params) != 1:
            return None
        grad = self.params[bucket.params[0]].grad
        if grad is None or grad.dtype != wire or not grad.is_contiguous():
            return None
        return grad.view(-1)

    def _land(self, b: int, shard: torch.Tensor, spare: torch.Tensor | None, fresh: bool) -> None:
        """Bring bucket `b`'s landed sum into its `shard`: received there, or in `spare`, copied
        (the step's first reduction of it) or added."""
        if spare is None:
            if self.scale != 1.0:
                shard.mul_(self.scale)
            return
        mine = shard.numel()
        received = spare[:mine]
        if self._staging is not None:  # one host-to-device copy, then as on the host
            landed = self._staging.take(received.dtype, mine)
            landed[:mine].copy_(received)
            self._pool.give(spare)
            spare, received = landed, landed[:mine]
        if self.scale != 1.0:
            received.mul_(self.scale)  # in the wire dtype, before any narrowing
        if fresh:
            shard.copy_(received)
        else:
            shard.add_(received)
        (self._pool if self._staging is None else self._staging).give(spare)

    @property
    def in_flight(self) -> bool:
        """Whether some reduce-scatter started has not landed yet."""
        return self._fusion.in_flight

    def land(self) -> None:
        """Complete every reduce-scatter in flight."""
        self._fusion.land()

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
        """Complete this step's reductions; return which parameters had a gradient on any rank
        (by parameter index; the `size` entries after them are the ranks' slots).

        Raises:
            CollectiveMismatchError: some rank began another backward pass instead (on every
                rank: that rank raises at its pass).
        """
        self.check()
        if self._hooks.queued:  # a pass still running: not expected between backward and step
            self._end_of_pass()
        had = self.had.copy()  # final: every bucket has been launched
        if self.backend.size == 1:
            self.land()
            return had
        had[len(self.params) + self.backend.rank] = STEP
        if self.backend.progresses:  # travels beside the last buckets
            flags = self.backend.iallreduce(had, ReduceOp.MAX)
            self.land()
        else:
            self.land()
            flags = self.backend.iallreduce(had, ReduceOp.MAX)  # as a later pass's check
        flags.wait()
        self._agree(had, STEP)
        return had

    def _agree(self, slots: np.ndarray, doing: float) -> None:
        """Raise `CollectiveMismatchError` unless every rank's slot says `doing` (every rank
        exchanged the same slots, so every rank raises alike)."""
        error = pass_mismatch(slots[len(self.params) :], doing)
        if error is not None:
            self._passes = 0  # the step is void on every rank: zero_grad() begins the next
            raise error

    def reset(self) -> None:
        """Begin a new step: reductions in flight complete (every rank started them), then the
        shards are overwritten by the next pass instead of added to."""
        self.land()
        self._fresh = [True] * len(self.buckets)
        self.had[:] = 0
        self._passes = 0
        self._new_pass()
