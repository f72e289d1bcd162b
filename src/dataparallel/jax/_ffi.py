"""A jitted step's reduction as an XLA FFI call into Python: no host round trip, no copy.

`reduce_ffi(flats, reduce, in_place)` stages out one custom call that hands XLA's own buffers to
`reduce` (NumPy views of them), an output aliasing its input where asked (the engine reduces in
place, in memory XLA reuses: `_bridges.py` asks it for every buffer), with no compiler at install
time: the handler is a `ctypes` function pointer over XLA's stable FFI C ABI
(`xla/ffi/api/c_api.h`, shipped in jaxlib), registered once per process with
`jax.ffi.register_ffi_target`. Where io_callback copies each buffer out of XLA and the result back
in, XLA here runs the handler on the step's own memory.

- Ordering: the call carries an ordered effect (as `io_callback(ordered=True)` and mpi4jax's
  primitives do), so XLA threads a runtime token through it: the calls run once per executed
  step, in program order, on every rank. This uses `jax._src.effects` (no public API registers
  an ordered effect); where it is missing, `ffi_reason` says so and the callback bridge is used.
- The GIL: `ctypes` takes it for the handler; JAX releases it while a computation runs.
- Errors: an exception in `reduce` becomes an `XLA_FFI_Error` (JAX raises `JaxRuntimeError`
  with its message); nothing crosses the C boundary.
- Lifetimes: the handler's function pointer stays referenced for the life of the process (XLA
  keeps its address). A step's `reduce` is found by the integer attribute `slot` its call
  carries: a hash of what the step is, not a count (`reduce_ffi`), so the same step traced in
  another process (the next run of a script) makes the same program, which JAX's persistent
  compilation cache finds. `dp.finalize()` empties the table (`caches`): a step compiled before
  then and called after raises, saying to trace it again, unless a step of equal key was traced
  since (it then runs that one's reduction: `reduce_ffi`).
"""

from __future__ import annotations

import ctypes as C
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.extend.core import Primitive

from dataparallel import caches
from dataparallel.protocol import digest

__all__ = ["Reduce", "ffi_reason", "host_device_reason", "reduce_ffi"]

Reduce = Callable[[list[np.ndarray], list[np.ndarray]], None]  # (inputs, outputs) as NumPy
Outputs = (
    tuple[tuple[tuple[int, ...], np.dtype[np.generic]], ...] | None
)  # (shape, dtype); None: inputs'
# How a call behaves under JAX's transformations: "opaque" (no vmap, no derivative: the
# optimizer's step), "elementwise" (vmap: the same call on the batched buffers), "rows" (vmap:
# the batch moved behind the first axis, which the call gathers or splits), "sum" (elementwise,
# and linear: mpi4jax's allreduce rules, its transpose "transposed", the identity).
Rule = Literal["opaque", "elementwise", "rows", "sum", "transposed"]

TARGET = "dataparallel_allreduce"
_TOKEN = 17  # XLA_FFI_DataType_TOKEN: the ordered effect's token, an argument and a result
_METADATA = 1  # XLA_FFI_Extension_Metadata: XLA asks the handler for its API version
_UNKNOWN = 2  # XLA_FFI_Error_Code_UNKNOWN
_TYPESTR = {  # XLA_FFI_DataType -> NumPy's typestr (bfloat16 travels bitcast to uint16)
    1: "|b1",
    2: "|i1",
    3: "<i2",
    4: "<i4",
    5: "<i8",
    6: "|u1",
    7: "<u2",
    8: "<u4",
    9: "<u8",
    10: "<f2",
    11: "<f4",
    12: "<f8",
    15: "<c8",
    18: "<c16",
}


class _ExtensionBase(C.Structure):
    pass


_ExtensionBase._fields_ = [
    ("struct_size", C.c_size_t),
    ("type", C.c_int),
    ("next", C.POINTER(_ExtensionBase)),
]


class _ApiVersion(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("major", C.c_int),
        ("minor", C.c_int),
    ]


class _Metadata(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", C.c_uint32),
        ("state_type_id", C.c_int64),
    ]


class _MetadataExtension(C.Structure):
    _fields_ = [("base", _ExtensionBase), ("metadata", C.POINTER(_Metadata))]


class _List(C.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)),
        ("items", C.POINTER(C.c_void_p)),
    ]


class _Attrs(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("size", C.c_int64),
        ("types", C.POINTER(C.c_int)),
        ("names", C.c_void_p),
        ("attrs", C.POINTER(C.c_void_p)),
    ]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.POINTER(C.c_int64))]


class _Buffer(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("dtype", C.c_int),
        ("data", C.c_void_p),
        ("rank", C.c_int64),
        ("dims", C.POINTER(C.c_int64)),
    ]


class _ErrorArgs(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("message", C.c_char_p),
        ("errc", C.c_int),
    ]


_ErrorCreate = C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorArgs))


class _Api(C.Structure):  # the fields up to XLA_FFI_Error_Create, the one used here
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", C.c_void_p),
        ("error_create", _ErrorCreate),
    ]


class _CallFrame(C.Structure):
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("extension_start", C.POINTER(_ExtensionBase)),
        ("api", C.POINTER(_Api)),
        ("ctx", C.c_void_p),
        ("stage", C.c_int),
        ("args", _List),
        ("rets", _List),
        ("attrs", _Attrs),
        ("future", C.c_void_p),
    ]


_Handler = C.CFUNCTYPE(C.c_void_p, C.POINTER(_CallFrame))
_steps: dict[int, Reduce] = {}  # slot -> the step's reduction, until `dp.finalize()`
_slot_of: dict[Hashable, int] = {}  # a step's (key, within) -> its slot
_taken: dict[int, Hashable] = {}  # slot -> the step that holds it, until `dp.finalize()`
_lock = threading.Lock()


@caches.register
def _forget_steps() -> None:
    """Drop every step's reduction (`dp.finalize()`: they reduce on the world it ends)."""
    with _lock:
        _steps.clear()
        _slot_of.clear()
        _taken.clear()


def _step(slot: int) -> Reduce:
    reduce = _steps.get(slot)
    if reduce is None:
        raise RuntimeError(
            "this jitted step was traced in a world that dp.finalize() has ended (its reduction "
            "went with it); trace the step again in this world: call jax.clear_caches(), or "
            "jax.jit the step function anew"
        )
    return reduce


class _View:
    """An XLA buffer as NumPy sees it (`__array_interface__`): no copy."""

    __slots__ = ("__array_interface__",)

    def __init__(self, buffer: _Buffer, writable: bool) -> None:
        shape = tuple(buffer.dims[i] for i in range(buffer.rank))
        self.__array_interface__ = {
            "data": (buffer.data or 0, not writable),
            "shape": shape,
            "typestr": _TYPESTR[buffer.dtype],
            "version": 3,
        }


def _arrays(items: _List, writable: bool) -> list[np.ndarray]:
    out = []
    for i in range(items.size):
        buffer = C.cast(items.items[i], C.POINTER(_Buffer)).contents
        if buffer.dtype != _TOKEN:
            out.append(np.asarray(_View(buffer, writable)))
    return out


def _handle(frame_pointer: C._Pointer[_CallFrame]) -> int | None:
    """XLA's entry: answer the metadata query, or run the step's reduction on its buffers."""
    frame = frame_pointer.contents
    try:
        if frame.extension_start and frame.extension_start.contents.type == _METADATA:
            extension = C.cast(frame.extension_start, C.POINTER(_MetadataExtension)).contents
            metadata = extension.metadata.contents
            version = frame.api.contents.api_version  # the ABI this process's XLA speaks
            metadata.api_version = _ApiVersion(C.sizeof(_ApiVersion), None, version.major, 1)
            metadata.traits = 0
            metadata.state_type_id = 0
            return None
        slot = C.cast(frame.attrs.attrs[0], C.POINTER(_Scalar)).contents.value[0]
        _step(slot)(_arrays(frame.args, False), _arrays(frame.rets, True))
        return None
    except BaseException as error:  # nothing may cross into XLA: an XLA_FFI_Error instead
        message = f"{type(error).__name__}: {error}".encode(errors="replace")
        args = _ErrorArgs(C.sizeof(_ErrorArgs), None, message, _UNKNOWN)
        created: int | None = frame.api.contents.error_create(C.byref(args))
        return created


_HANDLER = _Handler(_handle)  # referenced for the process's life: XLA keeps its address


@functools.cache
def _primitive() -> Primitive:
    """The primitive with an ordered effect, lowered to the FFI call; the target registered."""
    from jax._src import dispatch, effects
    from jax._src.core import abstract_token
    from jax.interpreters import ad, batching, mlir

    class Ordered(effects.Effect):
        """dataparallel's engine calls: in program order, as io_callback(ordered=True)'s."""

    effect = Ordered()
    for kind in (
        effects.lowerable_effects,
        effects.ordered_effects,
        effects.control_flow_allowed_effects,
        effects.custom_derivatives_allowed_effects,
    ):
        kind.add_type(Ordered)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_HANDLER), platform="cpu")
    primitive = Primitive("dataparallel_allreduce")
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))

    def abstract(
        *avals: jax.core.ShapedArray, outputs: Outputs, rule: Rule, **_: object
    ) -> tuple[list[object], set[object]]:
        shapes = outputs if outputs is not None else [(a.shape, a.dtype) for a in avals]
        out: list[object] = [jax.core.ShapedArray(shape, dtype) for shape, dtype in shapes]
        return out, set() if rule == "transposed" else {effect}

    def lower(
        ctx: mlir.LoweringRuleContext,
        *args: Any,
        slot: int,
        in_place: tuple[bool, ...],
        rule: Rule,
        **_: object,
    ) -> Any:
        if rule == "transposed":  # a sum's transpose, as mpi4jax's: every rank's own cotangent
            return list(args)
        token = ctx.tokens_in.get(effect)
        with_token = ctx.replace(
            avals_in=(*ctx.avals_in, abstract_token), avals_out=(*ctx.avals_out, abstract_token)
        )
        aliases = {i: i for i, alias in enumerate(in_place) if alias}
        lowering = jax.ffi.ffi_lowering(
            TARGET, has_side_effect=True, operand_output_aliases=aliases
        )
        results = list(lowering(with_token, *args, token, slot=np.int64(slot)))
        ctx.set_tokens_out(mlir.TokenSet({effect: results.pop()}))
        return results

    def batch(
        args: Sequence[jax.Array], dims: Sequence[int | None], **params: Any
    ) -> tuple[object, list[int | None]]:
        rule, outputs = params["rule"], params["outputs"]
        if rule == "opaque":
            raise ValueError(
                f"{params['name']} cannot run inside jax.vmap: its buffers are laid out when it "
                "is traced, one engine call each. Call it outside vmap."
            )
        if rule != "rows":  # elementwise: the same call on the batched buffers, in place
            return primitive.bind(*args, **params), list(dims)
        moved, shapes = [], []  # the rows stay the first axis: the batch goes second
        for i, (arg, dim) in enumerate(zip(args, dims, strict=True)):
            shape, dtype = outputs[i]
            if dim is None:
                moved.append(arg)
                shapes.append((shape, dtype))
            else:
                moved.append(jax.numpy.moveaxis(arg, dim, 1))
                shapes.append(((shape[0], arg.shape[dim], *shape[1:]), dtype))
        params = {**params, "outputs": tuple(shapes)}
        out_dims = [dim if dim is None else 1 for dim in dims]
        return primitive.bind(*moved, **params), out_dims

    def jvp(
        primals: Sequence[jax.Array], tangents: Sequence[jax.Array], **params: Any
    ) -> tuple[object, object]:
        if params["rule"] not in ("sum", "transposed"):
            raise TypeError(
                f"{params['name']} has no derivative (as mpi4jax's): only dp.allreduce with "
                "op='sum' or 'avg' is differentiable inside jax.jit."
            )
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return primitive.bind(*primals, **params), primitive.bind(*tangents, **params)

    def transpose(cotangents: Sequence[jax.Array], *args: object, **params: Any) -> list[jax.Array]:
        flipped = "transposed" if params["rule"] == "sum" else "sum"
        cts = [ad.instantiate_zeros(c) for c in cotangents]
        return list(primitive.bind(*cts, **{**params, "rule": flipped}))

    primitive.def_effectful_abstract_eval(abstract)
    mlir.register_lowering(primitive, lower, platform="cpu")
    batching.primitive_batchers[primitive] = batch
    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transpose
    return primitive


def host_device_reason(off_cpu: str, what: str, fix: str = "") -> str | None:
    """Return why a bridge of ordered effects on the host cannot run in this process (JAX not on
    the CPU: `off_cpu` says what then; several devices: `what` runs on one, `fix` the remedy),
    or None when it can."""
    if jax.default_backend() != "cpu":
        return f"JAX runs on {jax.default_backend()}: {off_cpu}"
    if jax.local_device_count() > 1:
        return (
            f"this process has {jax.local_device_count()} JAX devices, and {what} on one (the "
            f"callback gathers a sharded gradient onto one device){fix}"
        )
    return None


def ffi_reason() -> str | None:
    """Return why the FFI bridge cannot be used in this process, or None when it can."""
    reason = host_device_reason(
        "the FFI handler is registered for the CPU", "an ordered effect runs"
    )
    if reason is not None:
        return reason
    try:
        _primitive()
    except (ImportError, AttributeError) as error:  # JAX's private effects API has moved
        return f"this JAX has no ordered effects for FFI calls ({error})"
    return None


def reduce_ffi(
    flats: Sequence[jax.Array],
    reduce: Reduce,
    in_place: Sequence[bool],
    *,
    key: str,
    within: Hashable = None,
    outputs: Sequence[jax.ShapeDtypeStruct] | None = None,
    rule: Rule = "opaque",
    name: str = "a jitted dp.DistributedOptimizer step",
) -> list[jax.Array]:
    """Stage out `reduce(inputs, outputs)` on the traced buffers `flats`; return the outputs
    (each `flats[i]`'s shape and dtype, or `outputs`' where given, written by `reduce`). Where
    `in_place[i]`, output `i` is input `i`'s memory (the same shape and dtype). Alias a value as
    XLA made it (a concatenation, a gradient leaf in its own shape): aliasing a reshape of a leaf
    made XLA copy the leaf first (seen in the HLO), and XLA copies any aliased value still read
    elsewhere, or a parameter of the computation.

    `key` says what the step is, in words equal in every process that traces it (no object's
    id), and `within` tells apart steps of equal `key` in this process (the engine they reduce
    on). Steps traced with equal `key` and `within` must reduce alike: they share a slot, whose
    `reduce` becomes the latest one traced. The slot is `key`'s hash, or where another step of
    this process holds it, the next free number: never shared. JAX traces a step, and so
    registers its slot, before it looks for its program in the persistent cache, so a program
    found there calls this process's `reduce`. What the program does outside the call (the
    world's size; this rank, where the program depends on it) belongs in `key`: a program
    compiled before `dp.finalize()` runs the reduction of a step of equal `key` traced after
    it; ranks whose programs are equal (an optimizer's step) share a cached one. `rule` says
    how the call transforms (`Rule`; `reduce` must then take buffers of any shape the batch
    gives), `name` what it is, for errors.
    """
    primitive = _primitive()
    step = (key, within)
    with _lock:
        slot = _slot_of.get(step)
        if slot is None:
            slot = digest(key)  # under 2**62: the int64 attribute has room to count on
            while _taken.setdefault(slot, step) != step:  # held by another step: the next one
                slot += 1
            _slot_of[step] = slot
        _steps[slot] = reduce
    shapes = (
        None if outputs is None else tuple((tuple(o.shape), np.dtype(o.dtype)) for o in outputs)
    )
    params = {"slot": slot, "in_place": tuple(in_place), "outputs": shapes, "rule": rule}
    return list(primitive.bind(*flats, **params, name=name))
