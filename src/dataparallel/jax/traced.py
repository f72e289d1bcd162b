"""`dp.allreduce` and friends inside `jax.jit`: each call traced into the compiled program.

What mpi4jax's users write (`mpi4jax.allreduce(x, op=MPI.SUM)` inside a jitted function) is
written here as the eager call (`dp.allreduce(x)`): `dataparallel.collectives.traced` hands a
call on traced values to `trace_collective`, which

1. agrees on the call with every rank **once, when it is traced**: a different collective, tree,
   shape, dtype, op or root raises `CollectiveMismatchError` on every rank, from the traced call;
2. puts one engine call per leaf into the program, on a private duplicate of the engine
   (`_own_engine`), through the XLA FFI call of `_ffi.py` (the buffers in XLA's own memory,
   reduced and broadcast in place), or where it cannot run (JAX off the CPU, several devices per
   process) an ordered `io_callback`. Both carry an ordered effect: XLA runs the calls once per
   execution, in program order, and never drops one whose result is unused;
3. converts back inside the program (the wire dtype to the leaf's, the average's division).

Under JAX's transformations a traced call follows mpi4jax's rules (`_ffi.Rule`): `allreduce`
with `op="sum"` or `"avg"` has `jax.jvp`, `jax.grad` and `jax.linear_transpose` (a sum's
transpose is the identity: each rank keeps its cotangent); the other ops and collectives raise a
`TypeError` naming themselves when differentiated; every one batches under `jax.vmap`. The
io_callback has none of these. `dp.send`, `dp.recv` and `dp.sendrecv` agree with their peers
only, and move each tree as one message on the same engine, with no transformation rules. A
world of one puts nothing in the program: the values are the result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypedDict, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dataparallel import world
from dataparallel.arrays import tree
from dataparallel.arrays.actions import parse_op, reduction_error
from dataparallel.arrays.dtypes import SUPPORTED_DTYPES
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.collectives.pointtopoint import agree_pair, check_copy, check_ends, describe
from dataparallel.jax._ffi import Rule, ffi_reason, reduce_ffi
from dataparallel.jax._jit import traced_here
from dataparallel.jax._packed import WIRE  # each reduced dtype's wire dtype: the optimizer's
from dataparallel.protocol import handshake

__all__ = ["trace_collective"]

_COLLECTIVES = (
    "allreduce",
    "reduce",
    "reducescatter",
    "broadcast",
    "allgather",
    "alltoall",
    "barrier",
)
_POINT_TO_POINT = ("send", "recv", "sendrecv")
HostCall = Callable[[list[np.ndarray], list[np.ndarray]], None]


class Checked(TypedDict, total=False):
    """A traced call's options once checked: what its trace reads and the ranks agree on."""

    op: str
    scale: float | None
    root: int


def trace_collective(collective: str, x: object, backend: Backend | None, **options: Any) -> object:
    """Put `collective(x, **options)` on traced values into the program being traced.

    `backend`: the engine (a group's), or None for the world's. Returns what the eager call
    returns: `x`'s structure with traced results (and, for `alltoall`, the received splits).
    """
    if collective in _POINT_TO_POINT:
        send_tree, recv_tree = cast(tuple[object, object], x)  # the public calls' pair
        return _trace_pointtopoint(collective, (send_tree, recv_tree), backend, **options)
    if collective not in _COLLECTIVES:
        raise TypeError(f"dp.{collective} cannot take traced JAX values (inside jax.jit).")
    active = world.current()
    engine = backend if backend is not None else active.backend
    privates = functools.partial(_own_engine, active.private)
    if collective == "barrier":
        _trace_barrier(engine, privates)
        return None
    flat = tree.flatten(x, "x")
    leaves = [jnp.asarray(leaf) for leaf in flat.leaves]
    dtypes = [str(np.dtype(leaf.dtype)) for leaf in leaves]
    signatures = [f"{d}{list(leaf.shape)}" for d, leaf in zip(dtypes, leaves, strict=True)]
    parts = _PARTS[collective]
    checked = parts.check(flat, leaves, dtypes, engine.size, options)
    summary = (
        f"jit {collective}|{sorted(checked.items())}|{flat.structure()}|{'|'.join(signatures)}"
    )

    def details() -> dict[str, object]:
        call: dict[str, object] = {"collective": f"{collective} (inside jax.jit)", **checked}
        call["tree structure"] = flat.structure()
        call.update(zip(flat.paths, signatures, strict=True))
        return call

    if engine.size > 1:
        handshake(engine, summary, details)  # once per trace: raises on every rank if they differ
    results, extra = parts.trace(leaves, engine, privates, summary, checked)
    out = tree.unflatten(flat.spec, list(results))
    return (out, extra) if collective == "alltoall" else out


def _own_engine(private: Callable[[Backend], Backend], engine: Backend) -> Backend:
    """The engine traced calls run on: a duplicate of the world's private one, which the jitted
    optimizer's steps use. On the mpi4jax route those steps carry mpi4jax's ordered effect, not
    ours, so XLA may run one of theirs and one of these at the same time: never on one
    communicator."""
    return private(private(engine))


class _Parts:
    """One collective's parts: what it checks, and what it puts in the program."""

    def __init__(
        self,
        check: Callable[..., Checked],
        trace: Callable[..., tuple[list[jax.Array], list[int] | None]],
    ) -> None:
        self.check, self.trace = check, trace


def _run(
    inputs: list[jax.Array],
    outputs: list[jax.ShapeDtypeStruct],
    in_place: bool,
    host: HostCall,
    private: Backend,
    summary: str,
    rule: Rule,
    name: str,
) -> list[jax.Array]:
    """Put `host(inputs, outputs)` on NumPy views in the program: the FFI call (outputs aliasing
    inputs where `in_place`, else new, as many as `outputs` says; `rule`: how it transforms,
    `_ffi.Rule`), or an ordered io_callback
    where the FFI call cannot run (no vmap, no derivative there). `host` takes buffers of any
    shape a batch gives them."""
    traced_here()  # dp.finalize() drops JAX's caches: traced again in the next world
    if not inputs:
        return []
    if ffi_reason() is None:
        return reduce_ffi(
            inputs,
            host,
            [in_place] * len(inputs),
            key=f"traced|of {private.size}|{summary}",
            within=id(private),
            outputs=None if in_place else outputs,
            rule=rule,
            name=name,
        )

    def on_host(*arrays: jax.Array) -> list[np.ndarray]:
        sent = [np.asarray(a) for a in arrays]
        if in_place:
            received = [np.array(a, copy=True) for a in sent]
        else:
            received = [np.empty(o.shape, o.dtype) for o in outputs]
        host(sent, received)
        return received

    return list(io_callback(on_host, outputs, *inputs, ordered=True))


def _as_moved(leaf: jax.Array) -> jax.Array:
    """A leaf as it travels when only moved: bfloat16 as its bits (NumPy has no bfloat16)."""
    if leaf.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(leaf, jnp.uint16)
    return leaf


def _from_moved(moved: jax.Array, leaf: jax.Array) -> jax.Array:
    if leaf.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(moved, jnp.bfloat16)
    return moved


def _check_moved(dtypes: list[str], paths: list[str], collective: str) -> None:
    for dtype, path in zip(dtypes, paths, strict=True):
        if dtype not in SUPPORTED_DTYPES:  # every one moves: bfloat16 as its bits
            raise TypeError(f"{path}: dp.{collective} inside jax.jit cannot move {dtype} values.")


def _check_root(root: object, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"root={root!r} is not a rank: give an int from 0 to {size - 1}.")
    if not 0 <= int(root) < size:
        raise ValueError(f"root={root} is not a rank of this world of {size}.")
    return int(root)


# --- allreduce and reduce -------------------------------------------------------------------


def _check_reduction(
    flat: tree.Flat,
    leaves: list[jax.Array],
    dtypes: list[str],
    size: int,
    options: dict[str, Any],
    what: str = "dp.allreduce",
) -> Checked:
    op, scale = options["op"], options.get("scale")
    if options.get("compression") is not None:
        raise TypeError(
            "dp.allreduce inside jax.jit does not compress (compression=...): call it outside "
            "jax.jit, or use dp.DistributedOptimizer(..., compression=...) for optax."
        )
    parse_op(op)
    if scale is not None:
        scale = float(scale)
    for dtype, path in zip(dtypes, flat.paths, strict=True):
        if dtype not in WIRE:
            raise TypeError(
                f"{path}: {what} inside jax.jit reduces {', '.join(WIRE)} values, got "
                f"{dtype}; convert the leaf (x.astype(...)), or reduce it outside jax.jit."
            )
        error = reduction_error(dtype, op, scale)
        if error is not None:
            raise TypeError(f"{path}: {error}")
    checked: Checked = {"op": op, "scale": scale}
    if "root" in options:
        checked["root"] = _check_root(options["root"], size)
    return checked


def _trace_reduction(
    leaves: list[jax.Array],
    engine: Backend,
    privates: Callable[[Backend], Backend],
    summary: str,
    options: Checked,
) -> tuple[list[jax.Array], None]:
    op, root, size = options["op"], options.get("root"), engine.size
    engine_op, factor = _reduced_by(options, size)
    if size == 1:
        return [_finish(leaf, leaf, factor) for leaf in leaves], None
    private = privates(engine)
    wires = [leaf.astype(WIRE[str(np.dtype(leaf.dtype))]) for leaf in leaves]
    outputs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in wires]

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r in zip(sent, received, strict=True):
            flat = r.reshape(-1)
            if s.ctypes.data != r.ctypes.data:
                flat[...] = s.reshape(-1)
            if root is None:
                private.allreduce(flat, engine_op)
            else:
                private.reduce(flat, engine_op, root)

    if root is None:  # a sum is linear: mpi4jax's derivative rules (`_ffi.Rule`)
        rule: Rule = "sum" if engine_op is ReduceOp.SUM else "elementwise"
        name = f"dp.allreduce(op={op!r}) inside jax.jit"
        reduced = _run(wires, outputs, True, host, private, summary, rule, name)
        return [_finish(r, leaf, factor) for r, leaf in zip(reduced, leaves, strict=True)], None
    name = "dp.reduce inside jax.jit"
    summary = f"{summary}|at rank {private.rank}"  # the root's program differs from the others'
    reduced = _run(wires, outputs, True, host, private, summary, "elementwise", name)
    if private.rank != root:  # the others get their own values back, as eagerly
        return list(leaves), None
    return [_finish(r, leaf, factor) for r, leaf in zip(reduced, leaves, strict=True)], None


def _check_scatter(
    flat: tree.Flat, leaves: list[jax.Array], dtypes: list[str], size: int, options: dict[str, Any]
) -> Checked:
    checked = _check_reduction(flat, leaves, dtypes, size, options, "dp.reducescatter")
    for leaf, path in zip(leaves, flat.paths, strict=True):
        if leaf.ndim == 0:
            raise ValueError(
                f"{path}: dp.reducescatter splits the first axis, and a number has none."
            )
    return checked


def _trace_reducescatter(
    leaves: list[jax.Array],
    engine: Backend,
    privates: Callable[[Backend], Backend],
    summary: str,
    options: Checked,
) -> tuple[list[jax.Array], None]:
    """Each leaf reduced and split by rows as the eager call splits it (rank r keeps
    `n // size` rows, one more when `r < n % size`): each rank's program has its own result
    shapes, and its own key."""
    size = engine.size
    engine_op, factor = _reduced_by(options, size)
    if size == 1:
        return [_finish(leaf, leaf, factor) for leaf in leaves], None
    private = privates(engine)
    wires = [leaf.astype(WIRE[str(np.dtype(leaf.dtype))]) for leaf in leaves]
    rows = [[w.shape[0] // size + (r < w.shape[0] % size) for r in range(size)] for w in wires]
    mine = [counts[private.rank] for counts in rows]
    outputs = [
        jax.ShapeDtypeStruct((n, *w.shape[1:]), w.dtype) for n, w in zip(mine, wires, strict=True)
    ]

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r, counts in zip(sent, received, rows, strict=True):
            per_row = s.size // s.shape[0] if s.shape[0] else 0  # a batch may widen the rows
            send = np.ascontiguousarray(s).reshape(-1)
            private.reduce_scatter(send, r.reshape(-1), [n * per_row for n in counts], engine_op)

    summary = f"{summary}|at rank {private.rank}"  # each rank keeps rows of its own
    name = "dp.reducescatter inside jax.jit"
    done = _run(wires, outputs, False, host, private, summary, "rows", name)
    return [_finish(d, leaf, factor) for d, leaf in zip(done, leaves, strict=True)], None


def _reduced_by(options: Checked, size: int) -> tuple[ReduceOp, float]:
    """The engine's op of a checked reduction, and the factor its result is multiplied by
    after (the average's `1 / size`, times `scale`)."""
    engine_op, average = parse_op(options["op"])
    scale = options["scale"]
    return engine_op, (1.0 / size if average else 1.0) * (1.0 if scale is None else scale)


def _finish(reduced: jax.Array, leaf: jax.Array, factor: float) -> jax.Array:
    """The wire values back in the leaf's dtype, the average's or `scale`'s factor applied."""
    if factor != 1.0:
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            reduced = reduced * int(factor)  # an integral scale (checked)
        else:
            reduced = reduced * factor
    return reduced.astype(leaf.dtype)


# --- broadcast --------------------------------------------------------------------------------


def _check_broadcast(
    flat: tree.Flat, leaves: list[jax.Array], dtypes: list[str], size: int, options: dict[str, Any]
) -> Checked:
    _check_moved(dtypes, flat.paths, "broadcast")
    return {"root": _check_root(options["root"], size)}


def _trace_broadcast(
    leaves: list[jax.Array],
    engine: Backend,
    privates: Callable[[Backend], Backend],
    summary: str,
    options: Checked,
) -> tuple[list[jax.Array], None]:
    if engine.size == 1:
        return list(leaves), None
    root, private = options["root"], privates(engine)
    moved = [_as_moved(leaf) for leaf in leaves]
    outputs = [jax.ShapeDtypeStruct(m.shape, m.dtype) for m in moved]

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r in zip(sent, received, strict=True):
            flat = r.reshape(-1).view(np.uint8)
            if s.ctypes.data != r.ctypes.data:
                flat[...] = s.reshape(-1).view(np.uint8)
            private.broadcast(flat, root)

    done = _run(
        moved, outputs, True, host, private, summary, "elementwise", "dp.broadcast inside jax.jit"
    )
    return [_from_moved(d, leaf) for d, leaf in zip(done, leaves, strict=True)], None


# --- allgather and alltoall -----------------------------------------------------------------


def _check_gather(
    flat: tree.Flat, leaves: list[jax.Array], dtypes: list[str], size: int, options: dict[str, Any]
) -> Checked:
    _check_moved(dtypes, flat.paths, "allgather")
    return {}


def _trace_allgather(
    leaves: list[jax.Array],
    engine: Backend,
    privates: Callable[[Backend], Backend],
    summary: str,
    options: Checked,
) -> tuple[list[jax.Array], None]:
    size = engine.size
    rows = [leaf.reshape(1) if leaf.ndim == 0 else leaf for leaf in leaves]  # a number: a row
    if size == 1:
        return rows, None
    private = privates(engine)
    moved = [_as_moved(r) for r in rows]
    outputs = [jax.ShapeDtypeStruct((size * m.shape[0], *m.shape[1:]), m.dtype) for m in moved]

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r in zip(sent, received, strict=True):
            send = np.ascontiguousarray(s).reshape(-1).view(np.uint8)
            private.allgather(send, r.reshape(-1).view(np.uint8))

    done = _run(
        moved, outputs, False, host, private, summary, "rows", "dp.allgather inside jax.jit"
    )
    return [_from_moved(d, leaf) for d, leaf in zip(done, leaves, strict=True)], None


def _check_alltoall(
    flat: tree.Flat, leaves: list[jax.Array], dtypes: list[str], size: int, options: dict[str, Any]
) -> Checked:
    _check_moved(dtypes, flat.paths, "alltoall")
    if options.get("splits") is not None:
        raise ValueError(
            "dp.alltoall inside jax.jit sends equal parts only (splits=None, as mpi4jax's "
            "alltoall): the counts of uneven splits are data, and a jitted program's shapes are "
            "fixed when it is traced. Call it outside jax.jit for uneven splits."
        )
    for leaf, path in zip(leaves, flat.paths, strict=True):
        if leaf.ndim == 0 or leaf.shape[0] % size:
            raise ValueError(
                f"{path}: dp.alltoall inside jax.jit needs a first axis that divides into "
                f"{size} equal parts, got shape {tuple(leaf.shape)}."
            )
    return {}


def _trace_alltoall(
    leaves: list[jax.Array],
    engine: Backend,
    privates: Callable[[Backend], Backend],
    summary: str,
    options: Checked,
) -> tuple[list[jax.Array], list[int]]:
    size = engine.size
    rows = leaves[0].shape[0] if leaves else 0
    got = [rows // size] * size
    if size == 1:
        return list(leaves), got
    private = privates(engine)
    moved = [_as_moved(leaf) for leaf in leaves]
    outputs = [jax.ShapeDtypeStruct(m.shape, m.dtype) for m in moved]

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r in zip(sent, received, strict=True):
            send = np.ascontiguousarray(s).reshape(-1).view(np.uint8)
            counts = [send.size // size] * size
            private.alltoallv(send, counts, r.reshape(-1).view(np.uint8), counts)

    done = _run(moved, outputs, False, host, private, summary, "rows", "dp.alltoall inside jax.jit")
    return [_from_moved(d, leaf) for d, leaf in zip(done, leaves, strict=True)], got


# --- barrier ----------------------------------------------------------------------------------


def _trace_barrier(engine: Backend, privates: Callable[[Backend], Backend]) -> None:
    """Put a barrier in the program: one FFI call on a dummy buffer, kept by its ordered effect."""
    if engine.size == 1:
        return
    handshake(engine, "jit barrier", lambda: {"collective": "barrier (inside jax.jit)"})
    private = privates(engine)

    def host(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        private.barrier()

    dummy = jnp.zeros(1, jnp.int32)
    outputs = [jax.ShapeDtypeStruct((1,), jnp.int32)]
    _run([dummy], outputs, True, host, private, "jit barrier", "opaque", "dp.barrier")


# --- send, recv and sendrecv ----------------------------------------------------------------


def _trace_pointtopoint(
    call: str,
    pair: tuple[object, object],
    backend: Backend | None,
    *,
    dest: int | None,
    source: int | None,
    sendtag: int,
    recvtag: int,
) -> object:
    """Put `dp.send`, `dp.recv` or `dp.sendrecv` in the program: the two ends of each transfer
    agree when it is traced (`pointtopoint.agree_pair`), then every run moves the sent tree's
    bytes in one message, on the engine the traced collectives use. A message to this rank
    itself (`sendrecv` to and from it) is the sent values, with no call at all."""
    active = world.current()
    engine = backend if backend is not None else active.backend
    sending, receiving = dest is not None, source is not None
    dest, source, sendtag, recvtag, to_self = check_ends(
        call, engine, dest, source, sendtag, recvtag
    )
    send_flat = tree.flatten(pair[0], "sendbuf") if sending else None
    recv_flat = tree.flatten(pair[1], "recvbuf") if receiving else None
    sends = [jnp.asarray(leaf) for leaf in send_flat.leaves] if send_flat is not None else []
    templates = [jnp.asarray(leaf) for leaf in recv_flat.leaves] if recv_flat is not None else []
    for leaves, flat in ((sends, send_flat), (templates, recv_flat)):
        if flat is not None:
            _check_moved([str(np.dtype(leaf.dtype)) for leaf in leaves], flat.paths, call)
    sent = _description(send_flat, sends, sendtag)
    expected = _description(recv_flat, templates, recvtag)
    if to_self:
        check_copy(engine.rank, sent, expected)
        assert recv_flat is not None
        return tree.unflatten(recv_flat.spec, list(sends))
    private = _own_engine(active.private, engine)  # collective the first time (`_own_engine`)
    agree_pair(engine, call, sent, dest, expected, source)  # once per trace
    # The sent leaves are read where they are and the received ones land in new outputs: an
    # input aliased to an output is copied first by XLA when it is a parameter of the program or
    # read again (a halo exchange's array always is). `dp.recv` alone passes its templates,
    # aliased: the call needs an input, and nothing else reads them.
    moved = [_as_moved(leaf) for leaf in (sends if sending else templates)]
    outputs = [jax.ShapeDtypeStruct(m.shape, m.dtype) for m in map(_as_moved, templates)]
    count = len(sends)

    def host(arrays: list[np.ndarray], received: list[np.ndarray]) -> None:
        parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays[:count]]
        out = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else None
        targets = [r.reshape(-1).view(np.uint8) for r in received]
        into = targets[0] if len(targets) == 1 else None
        if into is None and targets:
            into = np.empty(sum(t.size for t in targets), np.uint8)
        out = out if sending and out is not None and out.size else None
        into = into if receiving and into is not None and into.size else None
        if out is None and into is None:
            return
        private.sendrecv(out, dest, into, source, sendtag, recvtag)
        if into is not None and len(targets) > 1:
            offset = 0
            for target in targets:
                target[...] = into[offset : offset + target.size]
                offset += target.size

    summary = f"jit {call}|to {dest}: {sent}|from {source}: {expected}"
    name = f"dp.{call} inside jax.jit"
    done = _run(moved, outputs, not sending, host, private, summary, "opaque", name)
    if recv_flat is None:
        return None
    received: list[object] = [_from_moved(d, t) for d, t in zip(done, templates, strict=True)]
    return tree.unflatten(recv_flat.spec, received)


def _description(flat: tree.Flat | None, leaves: list[jax.Array], tag: int) -> str | None:
    if flat is None:
        return None
    dtypes = [str(np.dtype(leaf.dtype)) for leaf in leaves]
    return describe(flat, dtypes, [tuple(leaf.shape) for leaf in leaves], tag)


_PARTS = {
    "allreduce": _Parts(_check_reduction, _trace_reduction),
    "reduce": _Parts(_check_reduction, _trace_reduction),
    "reducescatter": _Parts(_check_scatter, _trace_reducescatter),
    "broadcast": _Parts(_check_broadcast, _trace_broadcast),
    "allgather": _Parts(_check_gather, _trace_allgather),
    "alltoall": _Parts(_check_alltoall, _trace_alltoall),
}
