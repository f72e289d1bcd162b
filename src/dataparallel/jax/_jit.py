"""The gradient tree's reduction inside `jax.jit`: packed by XLA, one engine call per dtype.

What a traced `DistributedOptimizer.update` stages out, for a sum or an average (`Packed`):

1. Inside the traced function, the leaves of at most `bucket_bytes` are packed into one flat
   buffer per wire dtype (`jnp.concatenate` of the ravelled leaves, which XLA fuses with the
   gradient's computation); a larger leaf is a buffer of its own, in its own shape (no copy:
   packing it cost more than the engine calls it saves). float16 and bfloat16 travel as float32, the
   small integers and bool as int32 (exact: a sum is computed at least as
   precisely as the engine's native half sum would).
2. One reduction per step, each buffer by one engine call: with mpi4jax installed, on MPI, its
   XLA custom call (`mpi4jax.allreduce` on each buffer); else (one JAX CPU device per process)
   one XLA FFI call into Python (`_ffi.py`: the engine reduces every buffer in place in XLA's
   own memory, no host round trip); else one ordered host callback
   (`io_callback(ordered=True)`) from JAX's memory (a zero-copy NumPy view of the callback's
   argument) into the array it returns (`Backend.allreduce_into`), which JAX copies out.
3. The unpacking (slices, reshapes, casts back, the average's division) back inside the traced
   function, where XLA fuses it with what consumes the gradients.

Mismatches cost nothing per step. Shapes and dtypes are static under `jit`, so the ranks agree
on the traced signature once, when the update is traced (`handshake` on the world's engine: a
different tree, shape, dtype or op raises `CollectiveMismatchError` on every rank, at trace time).
What is checked per step is the call order: the first buffer carries two more items, `t` and
`t * t`, where `t` (1 to 251) is derived from the signature; after the sum every rank holds
`n * t` and `n * t * t` exactly when every rank ran a step of the same signature. Otherwise every
rank raises `CollectiveMismatchError` (inside JAX's runtime error). Steps of different signatures
with the same `t` (one chance in 251) are not told apart; steps whose buffers differ in size
fail in the engine (MPI's truncation error) before the check can run; worlds over 256 ranks
skip the check (`n * t * t` would not be exact in float32).

Everything else (min, max, prod, compression, uint32, uint64 and complex leaves) goes through
`collectives.allreduce` inside one ordered callback per step (`general`), as every call did
before, with its per-call handshake.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dataparallel import collectives, world
from dataparallel.arrays.actions import parse_op
from dataparallel.arrays.compression import Compressor
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.mpi import MPIBackend
from dataparallel.collectives.jitted import JittedStep, refuse, register_step
from dataparallel.errors import CollectiveMismatchError
from dataparallel.jax._ffi import Reduce, ffi_reason, reduce_ffi
from dataparallel.protocol import digest, handshake
from dataparallel.types import Op

__all__ = [
    "Packed",
    "Route",
    "allreduce_traced",
    "general",
    "mpi4jax_reason",
    "reduce_tree_traced",
]

# Which reduction a packed step stages out: "auto" takes mpi4jax where `mpi4jax_reason` finds
# nothing against it, else the FFI call where `ffi_reason` finds nothing, else the callback.
Route = Literal["auto", "callback", "ffi", "mpi4jax"]

# The wire dtype of each dtype a packed step reduces (the others: `general`).
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
Compressing = type[Compressor] | Compressor | None  # `compression=`: dp.Compression.fp16, ...
Details = Callable[[], dict[str, object]]  # the call field by field, to explain a mismatch
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
    def of(cls, leaves: Sequence[jax.Array], summary: str, size: int, alone: int) -> Packed | None:
        """Return the layout of `leaves`, or None when some dtype has no wire dtype.

        Leaves of more than `alone` bytes on the wire are buffers of their own (a reshape, no
        copy); the others are packed, one buffer per wire dtype, placed first.
        """
        dtypes = tuple(str(np.dtype(x.dtype)) for x in leaves)
        if any(d not in WIRE for d in dtypes):
            return None
        shared: dict[str, list[int]] = {}
        own: list[Bucket] = []
        for i, (d, x) in enumerate(zip(dtypes, leaves, strict=True)):
            if x.size * np.dtype(WIRE[d]).itemsize > alone:
                own.append(Bucket(WIRE[d], (i,)))
            else:
                shared.setdefault(WIRE[d], []).append(i)
        ticket = float(digest(summary) % TICKETS + 1) if size <= CHECK_LIMIT else 0.0
        if ticket and not shared:  # the order check needs a buffer to ride in
            shared["float32"] = []
        buckets = tuple(Bucket(w, tuple(m)) for w, m in shared.items()) + tuple(own)
        return cls(buckets, dtypes, tuple(tuple(x.shape) for x in leaves), ticket)

    def pack(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """The buffers, traced: one per bucket; the first one ends with the order check. A
        bucket of one leaf is that leaf in its own shape (not ravelled: a reshape between the
        gradient and the FFI call made XLA copy the leaf to alias it, seen in the HLO)."""
        flats = []
        for index, bucket in enumerate(self.buckets):
            if len(bucket.members) == 1 and not (index == 0 and self.ticket):
                flats.append(leaves[bucket.members[0]].astype(bucket.wire))
                continue
            parts = [jnp.ravel(leaves[i]).astype(bucket.wire) for i in bucket.members]
            if index == 0 and self.ticket:
                parts.append(jnp.asarray([self.ticket, self.ticket**2], bucket.wire))
            flats.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return flats

    def unpack(self, flats: Sequence[jax.Array], divide: int) -> list[jax.Array]:
        """The leaves' results, traced, from the reduced buffers (divided by `divide` if not 1)."""
        out: list[jax.Array | None] = [None] * len(self.dtypes)
        for bucket, shaped in zip(self.buckets, flats, strict=True):
            flat, offset = jnp.ravel(shaped), 0
            for i in bucket.members:
                n = int(np.prod(self.shapes[i], dtype=np.int64))
                piece = jax.lax.slice(flat, (offset,), (offset + n,)).reshape(self.shapes[i])
                offset += n
                if self.dtypes[i] == "bool":
                    out[i] = piece > 0  # a sum of bools is their logical or
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

    def first_call(self, private: Backend, route: str) -> JittedStep:
        """The step's first engine call (its first buffer), for ranks that join to answer."""
        first = self.buckets[0]
        n = sum(int(np.prod(self.shapes[i], dtype=np.int64)) for i in first.members)

        def call(buf: np.ndarray) -> None:
            if route == "mpi4jax":  # as mpi4jax's custom call: the engine does not count it
                from mpi4py import MPI

                assert isinstance(private, MPIBackend)
                private.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            else:
                private.allreduce(buf, ReduceOp.SUM)

        return JittedStep(private, n + 2, first.wire, call)


def allreduce_traced(
    leaves: list[jax.Array],
    describe: Details,
    summary: str,
    op: Op,
    engine: Backend,
    private: Backend,
    route: Route = "auto",
) -> list[jax.Array] | None:
    """Stage out the sum or average of traced `leaves` across ranks; None: not packable.

    `describe` and `summary` describe the call for the handshake (`summary` equal on two ranks
    exactly when their trees, dtypes, shapes and op are); `engine` is the world's engine (the
    handshake is made there, on the tracing thread), `private` its duplicate the steps reduce on.
    """
    engine_op, average = parse_op(op)
    if engine_op is not ReduceOp.SUM:
        return None
    size = engine.size
    if size == 1:  # nothing to reduce; an average over one rank is the value
        return list(leaves)
    chosen = _route(route, private)
    summary = f"jit allreduce|{op}|{chosen}|{summary}"
    alone = world.current().settings.bucket_bytes
    summary = f"{summary}|alone over {alone} B"
    packed = Packed.of(leaves, summary, size, alone)
    if packed is None:
        return None

    def details() -> dict[str, object]:
        return {**describe(), "route": chosen, "packed": f"leaves of at most {alone} B"}

    handshake(engine, summary, details)  # once per trace: raises on every rank if they differ
    if packed.ticket:  # ranks that join later answer its first call (`collectives/jitted.py`)
        register_step(engine, packed.first_call(private, chosen))
    flats = packed.pack(leaves)
    if chosen == "mpi4jax":
        reduced = _through_mpi4jax(flats, packed, engine, private, details)
    elif chosen == "ffi":
        reduced = _through_ffi(flats, packed, engine, private, details, summary)
    else:
        reduced = _through_callback(flats, packed, engine, private, details)
    return packed.unpack(reduced, size if average else 1)


def mpi4jax_reason(engine: Backend) -> str | None:
    """Return why the mpi4jax route cannot reduce on `engine`, or None when it can."""
    if importlib.util.find_spec("mpi4jax") is None:
        return "mpi4jax is not installed"
    if not isinstance(engine, MPIBackend):
        return f"the engine is {engine.name}, not MPI"
    if engine.timeout is not None:
        return "a timeout is set: only the callback can keep a deadline"
    if jax.default_backend() != "cpu":
        return f"JAX runs on {jax.default_backend()}: the callback stages through the host"
    if jax.local_device_count() > 1:
        return (
            f"this process has {jax.local_device_count()} JAX devices, and mpi4jax's ordered "
            "effects run on one (the callback gathers a sharded gradient onto one device); "
            "give each process one device (one rank per device) to use mpi4jax"
        )
    return None


def _route(route: Route, private: Backend) -> Literal["callback", "ffi", "mpi4jax"]:
    """The route a step takes: the one asked for, or for "auto" the fastest available (measured,
    benchmarks/jax_step.py: mpi4jax's custom call, then the FFI call, then the callback)."""
    if route == "callback":
        return "callback"
    if route in ("auto", "mpi4jax"):
        reason = mpi4jax_reason(private)
        if route == "mpi4jax" and reason is not None:
            raise RuntimeError(f"route='mpi4jax' cannot be used: {reason}.")
        if reason is None:
            return "mpi4jax"
    reason = ffi_reason()
    if route == "ffi" and reason is not None:
        raise RuntimeError(f"route='ffi' cannot be used: {reason}.")
    return "ffi" if reason is None else "callback"


def _on_host(packed: Packed, engine: Backend, private: Backend, describe: Details) -> Reduce:
    """Each buffer reduced by one engine call from `sent` into `received` (in place where they
    are the same memory, as the FFI call makes them); the order check after the first."""

    def reduce(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for index, (shaped, into) in enumerate(zip(sent, received, strict=True)):
            buf, recv = shaped.reshape(-1), into.reshape(-1)  # views: a leaf keeps its shape
            if buf.ctypes.data == recv.ctypes.data:
                private.allreduce(recv, ReduceOp.SUM)
            else:
                private.allreduce_into(buf, recv, ReduceOp.SUM)
            if index == 0 and not packed.order_holds(recv, private.size):
                _order_broken(engine, private, describe, packed.joined(recv, private.size))

    return reduce


def _through_ffi(
    flats: list[jax.Array],
    packed: Packed,
    engine: Backend,
    private: Backend,
    describe: Details,
    summary: str,
) -> list[jax.Array]:
    """The buffers through one XLA FFI call per step (`_ffi.py`), every one reduced in place in
    XLA's memory (its output aliases its input: a large leaf is reduced where backward wrote it,
    no output allocated; measured 0.79x / 1.09x mpi4jax per leaf's overhead at 1.86 / 8.40 M
    against 1.31x / 1.45x with large leaves reduced into new outputs, benchmarks/NOTES.md).
    The step's slot is keyed by its signature (`summary`) and engine, so retracing it does not
    add one."""
    reduce = _on_host(packed, engine, private, describe)
    return reduce_ffi(flats, reduce, [True] * len(flats), key=(id(private), summary))


def _through_callback(
    flats: list[jax.Array], packed: Packed, engine: Backend, private: Backend, describe: Details
) -> list[jax.Array]:
    """One ordered host callback: each buffer reduced by one engine call, JAX's memory to ours."""
    shapes = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flats]
    received: list[np.ndarray] = []  # the arrays returned, reused: JAX copies them out at once
    reduce = _on_host(packed, engine, private, describe)

    def reduce_on_host(*buffers: jax.Array) -> list[np.ndarray]:
        if not received:
            received.extend(np.empty(s.shape, s.dtype) for s in shapes)
        reduce([np.asarray(buf) for buf in buffers], received)
        return received

    return list(io_callback(reduce_on_host, shapes, *flats, ordered=True))


def _through_mpi4jax(
    flats: list[jax.Array], packed: Packed, engine: Backend, private: Backend, describe: Details
) -> list[jax.Array]:
    """mpi4jax's XLA custom call on each buffer, on the private communicator; the order check
    calls back to the host only when it fails."""
    import mpi4jax
    from mpi4py import MPI

    assert isinstance(private, MPIBackend)  # `mpi4jax_reason` said so
    comm = private.comm
    reduced = [mpi4jax.allreduce(f, op=MPI.SUM, comm=comm) for f in flats]
    reduced = [r[0] if isinstance(r, tuple) else r for r in reduced]  # older mpi4jax: (x, token)
    if packed.ticket:
        n, t = private.size, packed.ticket
        tail = reduced[0][-2:]
        broken = (tail[0] != n * t) | (tail[1] != n * t * t)

        def fail(tail: np.ndarray) -> None:
            _order_broken(engine, private, describe, packed.joined(np.asarray(tail), n))

        jax.lax.cond(broken, lambda: io_callback(fail, None, tail, ordered=False), lambda: None)
    return reduced


def _order_broken(engine: Backend, private: Backend, describe: Details, joined: int) -> None:
    """Every rank saw the order check fail: where `joined` ranks answered it with zeros (they
    have joined, `collectives/jitted.py`) tell them and raise `RankJoinedError`; else tell each
    rank what every rank ran, and raise."""
    if joined:
        raise refuse(engine, joined, describe)
    every = private.allgather_object(describe())
    lines = [f"  rank {rank}: {call}" for rank, call in enumerate(every)]
    raise CollectiveMismatchError(
        "Ranks ran different jitted DistributedOptimizer steps at the same point (the step's "
        "order check failed):\n" + "\n".join(lines) + "\nEvery rank must run the same jitted "
        "updates in the same order; a step inside a branch that depends on rank-local data "
        "(a loss, a NaN) runs on some ranks only."
    )


def general(
    leaves: list[jax.Array], op: Op, private: Backend, compression: Compressing
) -> list[jax.Array]:
    """Stage `leaves` out to one ordered host callback that allreduces them as NumPy arrays."""
    shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]

    def reduce_on_host(*arrays: jax.Array) -> list[np.ndarray]:
        # JAX hands over CPU jax.Arrays; writable NumPy copies are reduced in place by the engine.
        work = [np.array(a, copy=True) for a in arrays]
        reduced = collectives.allreduce(work, op=op, backend=private, compression=compression)
        return [np.asarray(a) for a in reduced]

    return list(io_callback(reduce_on_host, shapes, *leaves, ordered=True))


def reduce_tree_traced(
    with_paths: list[tuple[str, jax.Array]],
    structure: str,
    op: Op,
    backend: Backend | None,
    compression: Compressing,
    route: Route = "auto",
) -> list[jax.Array]:
    """Reduce the traced leaves of a gradient tree (`(path, leaf)` pairs): packed where it can
    (`allreduce_traced`), else through `general`. `backend`: None for the world's engine."""
    active = world.current()
    engine = backend if backend is not None else active.backend
    private = active.private(engine)
    leaves = [leaf for _, leaf in with_paths]
    if compression is None:
        signatures = [f"{np.dtype(x.dtype)}{list(x.shape)}" for x in leaves]

        def describe() -> dict[str, object]:
            call: dict[str, object] = {"collective": "jit allreduce", "op": op}
            call["tree structure"] = structure
            call.update(zip([path for path, _ in with_paths], signatures, strict=True))
            return call

        summary = f"{structure}|{'|'.join(signatures)}"
        reduced = allreduce_traced(leaves, describe, summary, op, engine, private, route)
        if reduced is not None:
            return reduced
    return general(leaves, op, private, compression)
