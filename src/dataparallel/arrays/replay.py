"""What a rank that has joined (`dp.join`) does in place of a collective: the same calls, on zeros.

A rank that has run out of data keeps answering the collectives of the ranks still working. It
does not have their arrays, so the ranks describe, in the handshake that begins every collective
(`protocol.handshake`), what they are about to send: a `Replay`. The joined rank runs it: the same
`Fusion`, with the same action, bucket size and flushes, over zero arrays of the same keys,
dtypes and shapes, so it makes exactly the engine calls the others make and contributes zeros
(Horovod's join). A `Replay` is small and picklable; it travels only while some rank has joined.

Limitation: the joined rank's zeros are host arrays. Where the other ranks hand GPU buffers to an
engine that reduces some dtype natively on the device but not on the host (NCCL and bfloat16),
the calls would differ; such calls are described as not joinable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataparallel.arrays.actions import Reduction, Scatter
from dataparallel.arrays.dtypes import storage_dtype
from dataparallel.arrays.fusion import BucketKey, Fusion
from dataparallel.arrays.pool import BufferPool
from dataparallel.backends.base import Backend, ReduceOp

__all__ = ["Add", "Replay"]

# One array given to `Fusion`: (bucket key, dtype, shape).
Add = tuple[BucketKey, str, tuple[int, ...]]


@dataclass(frozen=True)
class Replay:
    """The engine calls a collective makes after its handshake, to be made again on zeros.

    Attributes:
        action: what the calls do (`Reduction` or `Scatter`), or None for a barrier.
        flushes: the arrays given to `Fusion`, flush by flush (empty: nothing more is
            sent, as when the values travelled in the handshake itself).
        bucket_bytes, async_op, contiguous: `Fusion`'s settings.
        compression: the 16-bit wire dtype of floating buckets (`Fusion`'s `compression`), so
            that the zeros travel as the live ranks' values do, or None.
        then: calls made after these (a second fused call), or None.
    """

    action: Reduction | Scatter | None
    flushes: tuple[tuple[Add, ...], ...] = ()
    bucket_bytes: int = 1
    async_op: bool = False
    contiguous: bool = True
    then: Replay | None = None
    compression: str | None = None

    @classmethod
    def barrier(cls) -> Replay:
        """The replay of a barrier: a barrier."""
        return cls(None)

    @classmethod
    def nothing(cls) -> Replay:
        """The replay of a call whose values travelled in the handshake: no more calls."""
        return cls(Reduction(ReduceOp.SUM))

    @classmethod
    def of(
        cls,
        action: Reduction | Scatter,
        flushes: Sequence[Sequence[Add]],
        *,
        bucket_bytes: int,
        async_op: bool = False,
        contiguous: bool = True,
        then: Replay | None = None,
        compression: str | None = None,
    ) -> Replay:
        """Describe calls that give `Fusion` `flushes` (arrays, flushed after each)."""
        frozen = tuple(
            tuple((tuple(key), dtype, tuple(shape)) for key, dtype, shape in f) for f in flushes
        )
        return cls(action, frozen, bucket_bytes, async_op, contiguous, then, compression)

    def run(self, backend: Backend, pool: BufferPool | None = None) -> None:
        """Make the described calls on `backend`, with zeros, and wait for them."""
        if self.action is None:
            backend.barrier()
        elif self.flushes:
            self.reduce_zeros(backend, pool)
        if self.then is not None:
            self.then.run(backend, pool)

    def reduce_zeros(self, backend: Backend, pool: BufferPool | None) -> list[np.ndarray]:
        """Make the described fused calls with zeros and wait; return the arrays given, in
        order (an in-place reduction's arrays hold its results)."""
        assert self.action is not None
        fusion = Fusion(
            backend,
            self.action,
            bucket_bytes=self.bucket_bytes,
            async_op=self.async_op,
            contiguous=self.contiguous,
            pool=pool,
            compression=self.compression,
        )
        scatter = isinstance(self.action, Scatter)
        given = []
        for arrays in self.flushes:
            for key, dtype, shape in arrays:
                zeros = np.zeros(shape, storage_dtype(dtype))
                fusion.add(zeros, dtype, key, _discard if scatter else None)
                given.append(zeros)
            fusion.flush()
        fusion.wait()
        return given


def _discard(_: np.ndarray) -> None:
    """Where a joined rank's share of a reduce-scatter goes: nowhere."""
