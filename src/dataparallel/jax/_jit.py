"""The gradient tree's reduction inside `jax.jit`: packed by XLA, one engine call per dtype.

What a traced `DistributedOptimizer.update` stages out for a sum or an average (docs/jax.md tells
it step by step):

1. Inside the traced function the leaves of at most `bucket_bytes` are packed into one buffer per
   wire dtype, where XLA fuses the packing with the gradient's computation; a larger leaf is a
   buffer of its own, in its own shape (packing it would cost more than the calls it saves).
   Half floats travel as float32, small integers and bool as int32: exact (`_packed.py`). With
   `dp.Compression.fp16` or `.bf16` the floating leaves are cast to the 16-bit wire dtype there
   instead, and the engine sums the 16-bit buffers (as the eager path: `arrays/compression.py`).
2. One reduction per step, each buffer by one engine call, over a bridge (`_bridges.py`).
3. The unpacking back inside the traced function, where XLA fuses it with what consumes it.

Mismatches cost nothing per step: shapes and dtypes are static under `jit`, so the ranks agree on
the traced signature once, when the update is traced (`handshake`: a different tree, shape, dtype
or op raises `CollectiveMismatchError` on every rank, at trace time). Per step only the call order
is checked: the first buffer carries `t` and `t * t`, `t` derived from the signature, and after the
sum every rank holds `n * t` and `n * t * t` exactly when every rank ran a step of the same
signature (`_packed.py` says what it cannot tell apart).

Everything else (min, max, prod, compressors with error feedback, uint32, uint64 and complex
leaves) goes through
`dp.allreduce` inside one ordered callback per step (`general`), with its per-call handshake.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dataparallel import caches, world
from dataparallel.arrays.actions import parse_op
from dataparallel.arrays.compression import COMPRESSIBLE, Compressing, wire_dtype
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.collectives import reductions
from dataparallel.collectives.jitted import register_step
from dataparallel.jax._bridges import (
    Bridge,
    Details,
    choose_bridge,
    through_callback,
    through_ffi,
    through_mpi4jax,
)
from dataparallel.jax._packed import Packed
from dataparallel.protocol import handshake
from dataparallel.types import Op

__all__ = ["allreduce_traced", "general", "reduce_tree_traced", "traced_here"]

_traced: list[bool] = []  # whether a step was traced in this world (`traced_here`)


def traced_here() -> None:
    """Note that a jitted step was traced in this world: `dp.finalize()` then drops JAX's caches,
    so that it is traced again in the next world (`_trace_again`)."""
    if not _traced:
        _traced.append(True)


@caches.register
def _trace_again() -> None:
    """Have the jitted steps traced in the world that `dp.finalize()` ends traced again at their
    next call: their compiled reductions call that world's engines (an elastic run re-forms its
    world this way). `jax.clear_caches()` is JAX's only way: every function JAX compiled in this
    process, ours or not, compiles again at its next call."""
    if _traced:
        _traced.clear()
        jax.clear_caches()


def allreduce_traced(
    leaves: list[jax.Array],
    describe: Details,
    summary: str,
    op: Op,
    engine: Backend,
    private: Backend,
    bridge: Bridge = "auto",
    *,
    first: bool = True,
    compression: str | None = None,
) -> list[jax.Array] | None:
    """Stage out the sum or average of traced `leaves` across ranks; None: not packable.

    `describe` and `summary` describe the call for the handshake (`summary` equal on two ranks
    exactly when their trees, dtypes, shapes and op are); `engine` is the world's engine (the
    handshake is made there, on the tracing thread), `private` its duplicate the steps reduce on.
    `first`: whether this is its step's first reduction, which ranks that join answer (a step
    that reduces twice, PowerSGD's, registers only its first). `compression`: the wire dtype
    of floating leaves (`"float16"`, `"bfloat16"`), or None.
    """
    engine_op, average = parse_op(op)
    if engine_op is not ReduceOp.SUM:
        return None
    size = engine.size
    if size == 1:  # nothing to reduce; an average over one rank is the value (as it travels)
        if compression is None:
            return list(leaves)
        return [x.astype(compression).astype(x.dtype) if _floating(x) else x for x in leaves]
    chosen = choose_bridge(bridge, private, compressed=compression is not None)
    summary = f"jit allreduce|{op}|{chosen}|{summary}"
    if compression is not None:
        summary = f"{summary}|compressed to {compression}"
    alone = world.current().settings.bucket_bytes
    summary = f"{summary}|alone over {alone} B"
    packed = Packed.of(leaves, summary, size, alone, compression)
    if packed is None:
        return None

    def details() -> dict[str, object]:
        packing = {"route": chosen, "packed": f"leaves of at most {alone} B"}
        return {**describe(), **packing, "compression": compression}

    handshake(engine, summary, details)  # once per trace: raises on every rank if they differ
    step = None  # ranks that join answer its first call (`collectives/jitted.py`)
    if packed.ticket and first:
        step = packed.first_call(private, chosen)
        register_step(engine, step, seen=chosen != "mpi4jax", settle=_settle)
    flats = packed.pack(leaves)
    if chosen == "mpi4jax":
        reduced = through_mpi4jax(flats, packed, engine, private, details)
    elif chosen == "ffi":
        reduced = through_ffi(flats, packed, engine, private, details, summary, step)
    else:
        reduced = through_callback(flats, packed, engine, private, details, step)
    return packed.unpack(reduced, size if average else 1)


def _settle() -> None:
    """Wait until every jitted step dispatched from this thread has run (a rank that joins notes
    which did: `collectives/jitted.py`). A step that failed raised its error where its results
    were read; JAX raises it again here (its effect token keeps it): not this call's to raise."""
    with contextlib.suppress(jax.errors.JaxRuntimeError):
        jax.effects_barrier()


def _floating(leaf: jax.Array) -> bool:
    return str(np.dtype(leaf.dtype)) in COMPRESSIBLE


def general(
    leaves: list[jax.Array], op: Op, private: Backend, compression: Compressing
) -> list[jax.Array]:
    """Stage `leaves` out to one ordered host callback that allreduces them as NumPy arrays."""
    shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]

    def reduce_on_host(*arrays: jax.Array) -> list[np.ndarray]:
        # JAX hands over CPU jax.Arrays; writable NumPy copies are reduced in place by the engine.
        work = [np.array(a, copy=True) for a in arrays]
        reduced = reductions.allreduce(work, op=op, backend=private, compression=compression)
        return [np.asarray(a) for a in reduced]

    return list(io_callback(reduce_on_host, shapes, *leaves, ordered=True))


def reduce_tree_traced(
    with_paths: list[tuple[str, jax.Array]],
    structure: str,
    op: Op,
    backend: Backend | None,
    compression: Compressing,
    bridge: Bridge = "auto",
    *,
    first: bool = True,
) -> list[jax.Array]:
    """Reduce the traced leaves of a gradient tree (`(path, leaf)` pairs): packed where it can
    (`allreduce_traced`), else through `general`. `backend`: None for the world's engine;
    `first`: whether this is the step's first reduction (`allreduce_traced`)."""
    active = world.current()
    engine = backend if backend is not None else active.backend
    private = active.private(engine)
    traced_here()
    leaves = [leaf for _, leaf in with_paths]
    wire = wire_dtype(compression)  # checked already (`distributed_optax`): no feedback here
    signatures = [f"{np.dtype(x.dtype)}{list(x.shape)}" for x in leaves]

    def describe() -> dict[str, object]:
        call: dict[str, object] = {"collective": "jit allreduce", "op": op}
        call["tree structure"] = structure
        call.update(zip([path for path, _ in with_paths], signatures, strict=True))
        return call

    summary = f"{structure}|{'|'.join(signatures)}"
    reduced = allreduce_traced(
        leaves, describe, summary, op, engine, private, bridge, first=first, compression=wire
    )
    if reduced is not None:
        return reduced
    return general(leaves, op, private, compression)
