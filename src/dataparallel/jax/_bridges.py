"""The bridges by which a jitted step's buffers reach the engine, one engine call per buffer.

A bridge is how a step compiled by XLA reaches this library's engine; the public `route=`
argument of `dp.jax.distributed_optax` chooses one.

With mpi4jax installed, on MPI, its XLA custom call on each buffer (`through_mpi4jax`); else,
with one JAX CPU device per process, one XLA FFI call into Python per step (`through_ffi`, the
buffers reduced in place in XLA's own memory, `_ffi.py`); else one ordered host callback
(`through_callback`) from JAX's memory into the arrays it returns. `choose_bridge` picks the one
asked for, or for "auto" the fastest available. On the host, the first buffer's order check is
read after its reduction; when it fails, every rank raises (`order_broken`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Literal

import jax
import numpy as np
from jax.experimental import io_callback

from dataparallel.arrays.compression import WIRE_DTYPES
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.mpi import MPIBackend
from dataparallel.collectives.jitted import JittedStep, ran, refuse
from dataparallel.errors import CollectiveMismatchError
from dataparallel.jax._ffi import Reduce, ffi_reason, host_device_reason, reduce_ffi
from dataparallel.jax._packed import HALVES, Packed

__all__ = [
    "Bridge",
    "Details",
    "choose_bridge",
    "mpi4jax_reason",
    "order_broken",
    "through_callback",
    "through_ffi",
    "through_mpi4jax",
]

# The bridge a packed step is compiled with: "auto" takes mpi4jax where `mpi4jax_reason` finds
# nothing against it, else the FFI call where `ffi_reason` finds nothing, else the callback.
Bridge = Literal["auto", "callback", "ffi", "mpi4jax"]
Details = Callable[[], dict[str, object]]  # the call field by field, to explain a mismatch


def mpi4jax_reason(engine: Backend) -> str | None:
    """Return why the mpi4jax bridge cannot reduce on `engine`, or None when it can."""
    if importlib.util.find_spec("mpi4jax") is None:
        return "mpi4jax is not installed"
    if not isinstance(engine, MPIBackend):
        return f"the engine is {engine.name}, not MPI"
    if engine.timeout is not None:
        return "a timeout is set: only the callback can keep a deadline"
    return host_device_reason(
        "the callback stages through the host",
        "mpi4jax's ordered effects run",
        "; give each process one device (one rank per device) to use mpi4jax",
    )


def choose_bridge(
    asked: Bridge, private: Backend, compressed: bool = False
) -> Literal["callback", "ffi", "mpi4jax"]:
    """The bridge a step takes: the one asked for, or for "auto" the fastest available
    (mpi4jax's custom call, then the FFI call, then the callback: benchmarks/jax_step.py).
    `compressed`: some buffers are 16-bit floats, which mpi4jax cannot sum (MPI has no such
    type): the engine's own 16-bit sum reduces them, through the FFI call or the callback."""
    if asked == "callback":
        return "callback"
    if asked in ("auto", "mpi4jax"):
        reason = "16-bit compressed buffers need the engine's 16-bit sum" if compressed else None
        reason = reason or mpi4jax_reason(private)
        if asked == "mpi4jax" and reason is not None:
            raise RuntimeError(f"route='mpi4jax' cannot be used: {reason}.")
        if reason is None:
            return "mpi4jax"
    reason = ffi_reason()
    if asked == "ffi" and reason is not None:
        raise RuntimeError(f"route='ffi' cannot be used: {reason}.")
    return "ffi" if reason is None else "callback"


def on_host(
    packed: Packed, engine: Backend, private: Backend, describe: Details, step: JittedStep | None
) -> Reduce:
    """Each buffer reduced by one engine call from `sent` into `received` (in place where they
    are the same memory, as the FFI call makes them); the order check after the first. `step`:
    the first call, noted as run (`collectives/jitted.py`), or None where ranks that join do not
    answer it."""

    # The 16-bit (compressed) buffers' wire dtypes, by index.
    halves = {i: WIRE_DTYPES[b.wire] for i, b in enumerate(packed.buckets) if b.wire in HALVES}

    def reduce(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        if step is not None:
            ran(engine, step)
        for index, (shaped, into) in enumerate(zip(sent, received, strict=True)):
            buf, recv = shaped.reshape(-1), into.reshape(-1)  # views: a leaf keeps its shape
            if index in halves:  # compressed: the engine's 16-bit sum (bfloat16 as its bits)
                if buf.ctypes.data != recv.ctypes.data:
                    recv[...] = buf
                private.iallreduce_half(recv, ReduceOp.SUM, halves[index]).wait()
            elif buf.ctypes.data == recv.ctypes.data:
                private.allreduce(recv, ReduceOp.SUM)
            else:
                private.allreduce_into(buf, recv, ReduceOp.SUM)
            if index == 0 and not packed.order_holds(recv, private.size):
                order_broken(engine, private, describe, packed.joined(recv, private.size))

    return reduce


def through_ffi(
    flats: list[jax.Array],
    packed: Packed,
    engine: Backend,
    private: Backend,
    describe: Details,
    summary: str,
    step: JittedStep | None = None,
) -> list[jax.Array]:
    """The buffers through one XLA FFI call per step (`_ffi.py`), every one reduced in place in
    XLA's memory (its output aliases its input: a large leaf is reduced where backward wrote it,
    and no output is allocated, which the benchmarks found to cost well under new outputs:
    benchmarks/NOTES.md, "The FFI bridge reduces in place").
    The step's slot is keyed by its signature (`summary`) and the engine's size, within the
    engine itself, so retracing it does not add one (`reduce_ffi`), and every rank makes the
    same program. `step`: its first call, for ranks that join (`on_host`)."""
    reduce = on_host(packed, engine, private, describe, step)
    key = f"of {private.size}|{summary}"
    return reduce_ffi(flats, reduce, [True] * len(flats), key=key, within=id(private))


def through_callback(
    flats: list[jax.Array],
    packed: Packed,
    engine: Backend,
    private: Backend,
    describe: Details,
    step: JittedStep | None = None,
) -> list[jax.Array]:
    """One ordered host callback: each buffer reduced by one engine call, JAX's memory to ours.
    `step`: its first call, for ranks that join (`on_host`)."""
    shapes = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flats]
    received: list[np.ndarray] = []  # the arrays returned, reused: JAX copies them out at once
    reduce = on_host(packed, engine, private, describe, step)

    def reduce_on_host(*buffers: jax.Array) -> list[np.ndarray]:
        if not received:
            received.extend(np.empty(s.shape, s.dtype) for s in shapes)
        reduce([np.asarray(buf) for buf in buffers], received)
        return received

    return list(io_callback(reduce_on_host, shapes, *flats, ordered=True))


def through_mpi4jax(
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
            order_broken(engine, private, describe, packed.joined(np.asarray(tail), n))

        jax.lax.cond(broken, lambda: io_callback(fail, None, tail, ordered=False), lambda: None)
    return reduced


def order_broken(engine: Backend, private: Backend, describe: Details, joined: int) -> None:
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
