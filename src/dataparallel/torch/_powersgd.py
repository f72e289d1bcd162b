"""Low-rank gradient compression (`dp.Compression.powersgd`) on a `GradientSync`'s buckets.

PowerSGD (Vogels et al., 2019), as torch's batched `powerSGD_hook`, fitted into the buckets
`GradientSync` already sends, so the thin factors still travel during backward: each compressed
gradient, viewed as a matrix `M` (first dimension by the rest; this rank's residual added first),
is replaced in its bucket by `P = M Q`, beside the members not worth compressing (1-D tensors,
small matrices: `PowerSGDCompressor.min_compression_rate`). As torch's hook, per bucket: once
its averaged `P`s are back, they are orthonormalized and its `Q = M^T P` is sent; once the `Q`s
are back, its gradients become `P Q^T`, exact where the ranks' average has rank at most `rank`.
Unlike the hook, the `Q`s make no call of their own: those of bucket `b` travel in a later
bucket's call (`q_lag`; the last buckets' in one call after them), so that a step makes one call
per bucket and one more, as an uncompressed step does (the per-call cost dominates buckets this
thin). `GradientSync` runs these phases beside backward, leaving the last buckets' after it.

Error feedback keeps `M - P P^T M`, what the projection took from this rank's own matrix: the
residuals' average is what the approximation dropped from the average. (torch's hook keeps
`M - P Q^T`, whose average is the same, but each rank's then also holds its difference from the
average, which a joined rank contributing zeros would leave unbalanced.)

State, by parameter index: each matrix's `Q`, the same on every rank (drawn from `random_seed`
and the index, then last step's averaged `Q`: warm start), and the step count that decides
`start_iter`, are shared (any rank's checkpoint carries them; elastic runs take rank 0's); the
residuals are each rank's own. Every step's handshake carries the count, so ranks whose `Q`s may
have diverged (one answered steps in `dp.join`, one started afresh in a re-formed world) raise
`CollectiveMismatchError` instead of summing unrelated bases.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataparallel.arrays.compression import PowerSGDCompressor
from dataparallel.arrays.dtypes import BF16_BITS
from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.replay import Add, Replay
from dataparallel.backends.base import Backend

__all__ = ["LowRank", "Matrix", "PowerSGDReplay", "q_lag"]

NamedParams = list[tuple[str, torch.Tensor]]
_DENSE = torch.contiguous_format


def q_lag(backend: Backend) -> int:
    """How many calls after bucket `b`'s its `Q`s travel, on `backend`. They need `b`'s averaged
    `P`s, so `b`'s call must have landed before that call starts: chosen so that it has already,
    and the `Q`s wait for nothing the buckets' calls did not wait for. On MPI each call lands
    before the next starts: one call on. Where calls are left in flight (Gloo, NCCL:
    `Backend.calls_in_flight` of them once the next starts), that many more. The same on every
    rank (engines of one kind, and a Gloo hierarchy on every rank or none)."""
    return 1 if not backend.progresses else 1 + backend.calls_in_flight


@dataclass(frozen=True)
class Matrix:
    """How one parameter's gradient is compressed: viewed as `rows x cols`, at rank `rank`."""

    rows: int
    cols: int
    rank: int


@dataclass(frozen=True)
class PowerSGDReplay(Replay):
    """A compressed step's calls for a rank that has joined: each bucket (with its `P`s and the
    `Q`s due in its call: `q_lag`), then the last buckets' `Q`s, as `GradientSync` makes them.
    Under `dp.torch.join` the joined rank keeps the averaged `Q`s and counts the step, so that
    its basis stays the others' (`LowRank.answer`); under a plain `dp.join` it only makes the
    calls, and its next compressed step raises `CollectiveMismatchError` (the step counts
    differ) instead of mixing bases.

    Attributes:
        sync: which of the block's gradient reductions (their order in `dp.torch.join(...)`).
        qs: where each compressed bucket's `Q` buffer is among the arrays given, in bucket order.
    """

    sync: int = 0
    qs: tuple[int, ...] = ()


class LowRank:
    """A `GradientSync`'s PowerSGD: which parameters are compressed, their `Q`s and residuals."""

    def __init__(self, config: PowerSGDCompressor) -> None:
        self.config = config
        self.iteration = 0  # steps completed (the same on every rank)
        self.matrices: dict[int, Matrix] = {}  # compressed parameters, by index
        self.qs: dict[int, torch.Tensor] = {}  # their Q, transposed (`rank x cols`)
        self.residuals: dict[int, torch.Tensor] = {}  # this rank's, by parameter index
        self.world = 1  # what the reduced Qs are divided by: the world's size for a sum
        self.lag = 1  # bucket `b`'s Qs travel in bucket `b + lag`'s call (`q_lag`)
        # This step's gradients, Ms (their matrix views, residual added) and Ps (transposed,
        # in the buffers reduced), by index; each bucket's P buffer.
        self._grads: dict[int, torch.Tensor] = {}
        self._ms: dict[int, torch.Tensor] = {}
        self._ps: dict[int, torch.Tensor] = {}
        self._p_buffers: dict[int, torch.Tensor] = {}
        self._q_of: dict[int, torch.Tensor] = {}  # this step's Qs, in the buffers reduced
        self._kept: dict[int, torch.Tensor] = {}  # this rank's own Qs (P P^T M = P Q^T)
        self.carrying: set[int] = set()  # the buckets that carry Ps (by layout)
        # This step's buckets whose Ps went out: their matrices; `Fusion.calls` once each bucket's
        # call went out (`sent`), to land no later call than it; the bucket whose call carries
        # each bucket's Qs, once computed (`q_in`).
        self.buckets: dict[int, list[int]] = {}
        self.sent: dict[int, int] = {}
        self.q_in: dict[int, int] = {}

    # -- which parameters, and what travels -----------------------------------------------------

    def lay_out(self, params: NamedParams, buckets: list[list[int]]) -> None:
        """Choose the parameters to compress (among those reduced in `buckets`, by index)."""
        rank, rate = self.config.rank, self.config.min_compression_rate
        dense = {i for members in buckets for i in members}
        self.matrices = {}
        for i, (_, p) in enumerate(params):
            if i not in dense or p.dim() < 2 or not p.is_floating_point() or p.numel() == 0:
                continue
            rows = p.shape[0]
            cols = p.numel() // rows
            r = min(rank, rows, cols)
            if rows * cols > (rows + cols) * r * rate:  # torch's `_should_compress`
                self.matrices[i] = Matrix(rows, cols, r)
        for gone in set(self.qs) - set(self.matrices):
            del self.qs[gone]
        self.carrying = {b for b, members in enumerate(buckets) if self.compressed([members])[0]}

    def due(self, b: int, count: int) -> list[int]:
        """The buckets whose `Q`s travel in bucket `b`'s call (`b` = `count`, the bucket count:
        in the call after the last bucket's), in bucket order."""
        first, last = (b - self.lag, b - self.lag) if b < count else (count - self.lag, count - 1)
        return [c for c in range(max(first, 0), last + 1) if c in self.carrying]

    def clear(self) -> None:
        """Forget every `Q` and residual (the parameters were renumbered)."""
        self.qs.clear()
        self.residuals.clear()

    def active(self) -> bool:
        """Whether this step is compressed (`start_iter` steps have been reduced exactly)."""
        return self.iteration >= self.config.start_iter and bool(self.matrices)

    def describe(self) -> str:
        """What every rank's step must agree on beyond the layout: the step count."""
        return f"|powersgd iteration {self.iteration}" if self.matrices else ""

    def _q(self, i: int, p: torch.Tensor) -> torch.Tensor:
        m = self.matrices[i]
        q = self.qs.get(i)
        if q is None or not self.config.warm_start or q.dtype != p.dtype or q.device != p.device:
            # The same on every rank: drawn from the seed, the parameter and (without warm start)
            # the step.
            step = 0 if self.config.warm_start else self.iteration
            seed = (self.config.random_seed * 1_000_003 + i) * 1_000_033 + step
            gen = torch.Generator().manual_seed(seed % (1 << 63))
            q = torch.randn(m.cols, m.rank, generator=gen, dtype=torch.float32).t()
            q = self.qs[i] = q.to(device=p.device, dtype=p.dtype, memory_format=_DENSE)
        return q

    def first(
        self, bucket: int, members: list[int], params: NamedParams, computed: set[int]
    ) -> torch.Tensor:
        """Compute the `P`s of a bucket's compressed `members` (gradients present), residuals
        added to those `computed` this step; return the bucket's `P` buffer, to be reduced.

        `P` and `Q` are kept transposed (`rank x rows`, `rank x cols`, row-major), so that both
        products read the gradient row by row, as it lies (`P^T = Q^T M^T`, `Q^T = P^T M`):
        with the factors' columns strided, each product took several times as long from rank 2
        on. The `P`s lie in the buffer grouped by shape (`ordered`), for `second`'s batched
        orthonormalization."""
        members = self.ordered(members)
        self.buckets[bucket] = members
        grads = [params[i][1].grad for i in members]
        total = sum(self.matrices[i].rows * self.matrices[i].rank for i in members)
        first = grads[0]
        assert first is not None
        buffer = torch.empty(total, dtype=first.dtype, device=first.device)
        self._p_buffers[bucket] = buffer
        offset = 0
        for i, g in zip(members, grads, strict=True):
            assert g is not None
            m = self.matrices[i]
            if self.config.use_error_feedback and i in computed:
                residual = self.residuals.get(i)
                if residual is not None and residual.shape == g.shape:
                    g.add_(residual)
            matrix = g.reshape(m.rows, m.cols)  # a view, unless the gradient is not contiguous
            p = buffer[offset : offset + m.rows * m.rank].view(m.rank, m.rows)
            torch.matmul(self._q(i, g), matrix.t(), out=p)
            self._grads[i], self._ms[i], self._ps[i] = g, matrix, p
            offset += m.rows * m.rank
        return buffer

    def second(self, bucket: int) -> torch.Tensor:
        """With the bucket's averaged `P`s back: orthonormalize them (one batched QR per shape),
        compute each `Q = M^T P`; return the bucket's `Q` buffer, to be reduced."""
        members = self.buckets[bucket]
        ps = self._p_buffers.pop(bucket)
        offset = 0
        for (rows, rank), group in itertools.groupby(members, self._shape):
            size = len(list(group)) * rows * rank
            _orthonormalize(ps[offset : offset + size].view(-1, rank, rows))
            offset += size
        total = sum(self.matrices[i].cols * self.matrices[i].rank for i in members)
        buffer = torch.empty(total, dtype=ps.dtype, device=ps.device)
        kept = torch.empty_like(buffer) if self.config.use_error_feedback else None
        offset = 0
        for i in members:
            m = self.matrices[i]
            at = slice(offset, offset + m.cols * m.rank)
            q = self._q_of[i] = buffer[at].view(m.rank, m.cols)
            torch.matmul(self._ps[i], self._ms[i], out=q)
            if kept is not None:  # P (M^T P)^T is this rank's M, projected (formed in finish)
                self._kept[i] = kept[at].view(m.rank, m.cols)
            offset += m.cols * m.rank
        if kept is not None:  # kept apart: the buffer is reduced in place
            kept.copy_(buffer)
        return buffer

    def finish(self, bucket: int) -> None:
        """With the bucket's reduced `Q`s back: each gradient becomes `P Q^T` (the average's
        approximation, times `world` for a sum), the residual `M - P P^T M` (what this rank's
        own matrix lost to the projection), and `Q` is kept (a view of the buffer it came back
        in: nothing copied)."""
        for i in self.buckets.pop(bucket):
            g, m, p, q = self._grads.pop(i), self._ms.pop(i), self._ps.pop(i), self._q_of.pop(i)
            p = p.t()  # rows x rank
            if self.config.use_error_feedback:
                m = self._keep_residual(i, g, m, p, self._kept.pop(i))
            # P Q^T with the reduced Q as it came (a sum's when `world` != 1: the gradient is the
            # ranks' sum then), written straight into the gradient where M is its view
            if m.data_ptr() == g.data_ptr() and g.is_contiguous():
                torch.matmul(p, q, out=m)
            else:
                g.copy_(torch.matmul(p, q).view(g.shape))
            if self.world != 1:
                q.div_(self.world)  # the average's Q, kept for the next step
            self.qs[i] = q

    def _keep_residual(
        self, i: int, g: torch.Tensor, m: torch.Tensor, p: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """Keep `M - P P^T M` (`kept`: this rank's `Q^T = P^T M`) as parameter `i`'s residual,
        before `M` (maybe the gradient `g`) is overwritten; return where the gradient's matrix
        now lies. Where `M` is all of `g`'s memory, the residual is formed in place and `g`
        takes the last residual's memory instead (a swap of storages): one pass over the
        matrix fewer than forming it elsewhere, and nothing allocated."""
        residual = self.residuals.get(i)
        fits = (
            residual is not None
            and residual.shape == g.shape
            and residual.dtype == g.dtype
            and residual.device == g.device
        )
        if fits and residual is not None and _owns_its_storage(residual) and _owns_its_storage(g):
            m.addmm_(p, kept, alpha=-1)  # g holds the residual now
            swapped = torch.empty(0, dtype=g.dtype, device=g.device)
            swapped.set_(g.untyped_storage(), 0, g.shape, g.stride())
            g.set_(residual.untyped_storage(), 0, g.shape, g.stride())
            self.residuals[i] = swapped
            return g.view(m.shape)
        if not fits:
            residual = self.residuals[i] = torch.empty_like(g, memory_format=_DENSE)
        assert residual is not None
        torch.addmm(m, p, kept, alpha=-1, out=residual.view(m.shape))
        return m

    def back(self, newest: int) -> bool:
        """Whether some bucket's `Q`s travelled in bucket `newest`'s call or an earlier one."""
        return any(at <= newest for at in self.q_in.values())

    def finish_back(self, newest: int | None = None) -> None:
        """`finish` each bucket whose `Q`s travelled in bucket `newest`'s call or an earlier one
        (None: every bucket whose `Q`s went out), in bucket order: those calls have landed."""
        for c in sorted(c for c, at in self.q_in.items() if newest is None or at <= newest):
            del self.q_in[c]
            self.finish(c)

    def discard(self) -> None:
        """Drop this step's matrices (done, or failed)."""
        self._grads, self._ms, self._ps, self._q_of, self._kept = {}, {}, {}, {}, {}
        self._p_buffers = {}
        self.buckets, self.sent, self.q_in = {}, {}, {}

    # -- ranks that have joined ------------------------------------------------------------------

    def compressed(self, buckets: list[list[int]]) -> list[list[int]]:
        """Each bucket's compressed members, in the order `first` takes them (`ordered`)."""
        return [self.ordered([i for i in members if i in self.matrices]) for members in buckets]

    def ordered(self, members: list[int]) -> list[int]:
        """Compressed `members` in the order their factors lie in a bucket's buffers: grouped by
        the shape of `P` (the same on every rank), in bucket order within a group."""
        return sorted(members, key=self._shape)

    def _shape(self, i: int) -> tuple[int, int]:
        m = self.matrices[i]
        return m.rows, m.rank

    def q_add(self, members: list[int], key: Add) -> Add:
        """The `Q` buffer of a bucket whose compressed `members` travel in `key`'s buffers (the
        `P`'s array, for a replay)."""
        total = sum(self.matrices[i].cols * self.matrices[i].rank for i in members)
        return (key[0], key[1], (total,))

    def answer(
        self,
        replay: PowerSGDReplay,
        params: NamedParams,
        buckets: list[list[int]],
        backend: Backend,
        pool: BufferPool,
    ) -> None:
        """Make a compressed step's calls on zeros (this rank has joined) and keep the averaged
        `Q`s it brings back, so that this rank's basis stays the others'."""
        given = replay.reduce_zeros(backend, pool)
        compressed = [members for members in self.compressed(buckets) if members]
        for at, members in zip(replay.qs, compressed, strict=True):
            values = given[at]
            if values.dtype == BF16_BITS:  # bfloat16, as its bits
                flat = torch.from_numpy(values.reshape(-1).view(np.int16)).view(torch.bfloat16)
            else:
                flat = torch.from_numpy(values.reshape(-1))
            offset = 0
            for i in members:
                m, p = self.matrices[i], params[i][1]
                part = flat[offset : offset + m.cols * m.rank].view(m.rank, m.cols)
                offset += m.cols * m.rank
                q = part.to(device=p.device, dtype=p.dtype, copy=True)
                self.qs[i] = q.div_(self.world) if self.world != 1 else q
        self.iteration += 1

    # -- checkpoints ------------------------------------------------------------------------------

    def shared_state(self, params: NamedParams) -> dict[str, Any]:
        """The state every rank holds alike: the step count and each matrix's `Q` (`cols x
        rank`), by name."""
        qs = {params[i][0]: q.t().clone(memory_format=_DENSE) for i, q in sorted(self.qs.items())}
        return {"iteration": self.iteration, "q": qs}

    def load_shared_state(self, state: Mapping[str, Any], params: NamedParams, owner: str) -> None:
        """Take `shared_state()`'s (saved by any rank)."""
        index = {name: i for i, (name, _) in enumerate(params)}
        qs: dict[int, torch.Tensor] = {}
        for name, q in state["q"].items():
            i = index.get(name, -1)
            m = self.matrices.get(i)
            if m is None or tuple(q.shape) != (m.cols, m.rank):
                raise ValueError(
                    f"{owner}: the PowerSGD basis of {name!r} (shape {tuple(q.shape)}) fits no "
                    "matrix compressed here: load a state saved from the same model, optimizer "
                    "and dp.Compression.powersgd(...) settings."
                )
            p = params[i][1]
            qs[i] = q.detach().t().to(device=p.device, dtype=p.dtype).clone(memory_format=_DENSE)
        self.qs = qs
        self.iteration = int(state["iteration"])


def _orthonormalize(ps: torch.Tensor) -> None:
    """Replace each of the `k x rank x rows` stack's matrices by an orthonormal basis of its rows'
    span: one batched QR (in float32 at least: Householder, so a row the others already span,
    or a zero one, gives a unit vector, not NaN, and the basis never collapses to zero)."""
    wide = ps if ps.dtype == torch.float64 else ps.float()
    q, _ = torch.linalg.qr(wide.transpose(1, 2))
    ps.copy_(q.transpose(1, 2))


def _owns_its_storage(t: torch.Tensor) -> bool:
    """Whether `t` is contiguous and alone on its storage (no view of a larger buffer)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
