"""A jitted step's layout: its leaves packed into one buffer per wire dtype, and back.

The layout (`Packed`) is the same on every rank that traced the same tree: which leaves each
buffer holds (`Bucket`), in what wire dtype (`WIRE`: float16 and bfloat16 travel as float32, the
small integers and bool as int32; with compression every floating leaf travels in its 16-bit
wire dtype, cast inside XLA, bfloat16 as its bits), and the order check's `t` (1 to `TICKETS`),
derived from the step's signature, that the first buffer carries with `t * t` (never a 16-bit
buffer: `n * t * t` would not be exact there). It packs the traced leaves
(`pack`) and unpacks the reduced buffers (`unpack`), both inside the traced function where XLA
fuses them, reads the reduced order check (`order_holds`, `joined`), and gives ranks that have
joined the step's first engine call to answer (`first_call`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dataparallel.arrays.compression import COMPRESSIBLE
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.mpi import MPIBackend
from dataparallel.collectives.jitted import JittedStep
from dataparallel.protocol import digest

__all__ = ["CHECK_LIMIT", "HALVES", "TICKETS", "WIRE", "Bucket", "Packed"]

# The wire dtype of each dtype a packed step reduces (the others: `_jit.general`).
WIRE = {
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
    "float16": "float32",
    "bfloat16": "float32",
    "int8": "int32",
    "int16": "int32",
    "uint8": "int32",
    "uint16": "int32",
    "bool": "int32",
}
HALVES = ("float16", "bfloat16")  # the compressed wire dtypes, reduced by `iallreduce_half`
# The order check cannot tell apart steps of different signatures with the same `t` (one chance in
# TICKETS); steps whose buffers differ in size fail in the engine (MPI's truncation error) before
# it can run.
TICKETS = 251  # how many call-order values `t` there are
CHECK_LIMIT = 256  # above this many ranks, n * t * t is not exact in float32: no order check


@dataclass(frozen=True)
class Bucket:
    """One wire dtype's buffer: which leaves it holds, in order."""

    wire: str
    members: tuple[int, ...]


@dataclass(frozen=True)
class Packed:
    """A traced step's layout, the same on every rank that traced the same tree."""

    buckets: tuple[Bucket, ...]
    dtypes: tuple[str, ...]  # each leaf's dtype
    shapes: tuple[tuple[int, ...], ...]  # each leaf's shape
    ticket: float  # the order check's `t`, or 0 (no check)

    @classmethod
    def of(
        cls,
        leaves: Sequence[jax.Array],
        summary: str,
        size: int,
        alone: int,
        compression: str | None = None,
    ) -> Packed | None:
        """Return the layout of `leaves`, or None when some dtype has no wire dtype.

        Leaves of more than `alone` bytes on the wire are buffers of their own (a reshape, no
        copy); the others are packed, one buffer per wire dtype, placed first, the order check's
        first. `compression` (`"float16"`, `"bfloat16"`): the wire dtype of floating leaves.
        """
        dtypes = tuple(str(np.dtype(x.dtype)) for x in leaves)
        if any(d not in WIRE for d in dtypes):
            return None
        wires = [compression if compression and d in COMPRESSIBLE else WIRE[d] for d in dtypes]
        shared: dict[str, list[int]] = {}
        own: list[Bucket] = []
        for i, (w, x) in enumerate(zip(wires, leaves, strict=True)):
            if x.size * np.dtype(np.uint16 if w == "bfloat16" else w).itemsize > alone:
                own.append(Bucket(w, (i,)))
            else:
                shared.setdefault(w, []).append(i)
        ticket = float(digest(summary) % TICKETS + 1) if size <= CHECK_LIMIT else 0.0
        if ticket:  # the order check rides first, in a buffer that sums it exactly
            carrier = next((w for w in shared if w not in HALVES), "float32")
            shared = {carrier: shared.get(carrier, []), **shared}
        buckets = tuple(Bucket(w, tuple(m)) for w, m in shared.items()) + tuple(own)
        return cls(buckets, dtypes, tuple(tuple(x.shape) for x in leaves), ticket)

    def pack(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """The buffers, traced: one per bucket; the first one ends with the order check. A
        bucket of one leaf is that leaf in its own shape (not ravelled: a reshape between the
        gradient and the FFI call made XLA copy the leaf to alias it, seen in the HLO)."""
        flats = []
        for index, bucket in enumerate(self.buckets):
            if len(bucket.members) == 1 and not (index == 0 and self.ticket):
                flats.append(_to_wire(leaves[bucket.members[0]], bucket.wire))
                continue
            parts = [jnp.ravel(leaves[i]).astype(bucket.wire) for i in bucket.members]
            if index == 0 and self.ticket:
                parts.append(jnp.asarray([self.ticket, self.ticket**2], bucket.wire))
            flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            flats.append(_to_wire(flat, bucket.wire))
        return flats

    def unpack(self, flats: Sequence[jax.Array], divide: int) -> list[jax.Array]:
        """The leaves' results, traced, from the reduced buffers (divided by `divide` if not 1)."""
        out: list[jax.Array | None] = [None] * len(self.dtypes)
        for bucket, shaped in zip(self.buckets, flats, strict=True):
            flat, offset = jnp.ravel(shaped), 0
            if bucket.wire == "bfloat16":
                flat = jax.lax.bitcast_convert_type(flat, jnp.bfloat16)
            for i in bucket.members:
                n = int(np.prod(self.shapes[i], dtype=np.int64))
                piece = jax.lax.slice(flat, (offset,), (offset + n,)).reshape(self.shapes[i])
                offset += n
                if self.dtypes[i] == "bool":
                    out[i] = piece > 0  # a sum of bools is their logical or
                    continue
                if bucket.wire in HALVES:  # as the eager path: widened, scaled, then rounded
                    wide = piece.astype("float64" if self.dtypes[i] == "float64" else "float32")
                    out[i] = (wide * (1 / divide) if divide != 1 else wide).astype(self.dtypes[i])
                    continue
                if divide != 1:
                    piece = piece / divide  # floating only: avg on integers is refused earlier
                out[i] = piece.astype(self.dtypes[i])
        return [x for x in out if x is not None]

    def order_holds(self, first: np.ndarray, size: int) -> bool:
        """Whether the reduced order check says every rank ran a step of this signature."""
        t = self.ticket
        return not t or (float(first[-2]) == size * t and float(first[-1]) == size * t * t)

    def joined(self, first: np.ndarray, size: int) -> int:
        """How many ranks answered the order check with zeros (ranks that have joined,
        `collectives/jitted.py`): `k` working ranks sum to `k * t` and `k * t * t`."""
        t = self.ticket
        k = float(first[-2]) / t if t else size
        if k == int(k) and 0 <= k < size and float(first[-1]) == k * t * t:
            return size - int(k)
        return 0

    def first_call(self, private: Backend, bridge: str) -> JittedStep:
        """The step's first engine call (its first buffer), for ranks that join to answer."""
        first = self.buckets[0]
        n = sum(int(np.prod(self.shapes[i], dtype=np.int64)) for i in first.members)

        def call(buf: np.ndarray) -> None:
            if bridge == "mpi4jax":  # as mpi4jax's custom call: the engine does not count it
                from mpi4py import MPI

                assert isinstance(private, MPIBackend)
                private.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            else:
                private.allreduce(buf, ReduceOp.SUM)

        return JittedStep(private, n + 2, first.wire, call)


def _to_wire(values: jax.Array, wire: str) -> jax.Array:
    """`values` in `wire`, traced: bfloat16 as its bits (the engines and the FFI call take
    bfloat16 as `uint16`)."""
    values = values.astype(wire)
    return jax.lax.bitcast_convert_type(values, jnp.uint16) if wire == "bfloat16" else values
