"""Horovod's allreduce (plain, in place, grouped, async), and the rules it shares with
reducescatter (`_scatters.py`).

Each hands over to `dp.allreduce` / `dp.iallreduce` / `dp.reducescatter` on the process set's
group. What Horovod defines that dataparallel's own API does not is done here, and only that:

- `op=Average` on integer tensors: Horovod sums, then scales in float64 and truncates; so is it
  here (dataparallel refuses `"avg"` on integers, which would truncate silently).
- `prescale_factor` is applied to a copy before the reduction (integers in float64, half
  precision in float32, as Horovod); `postscale_factor` is dataparallel's `scale=` (integers:
  in float64 after the sum, as Horovod). Tensors of one in-place call that share memory
  (`grouped_allreduce_([t, t])`) have it scaled once (`_distinct`), and reduced once.
- `Adasum` raises `NotImplementedError` (dataparallel has no Adasum).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from dataparallel.arrays.aliases import clusters
from dataparallel.collectives import reductions
from dataparallel.horovod.torch import _handles
from dataparallel.horovod.torch._autograd import through
from dataparallel.horovod.torch._basics import Adasum, Average, Max, Min, Product, Sum
from dataparallel.horovod.torch._process_sets import ProcessSet, global_process_set, group_of
from dataparallel.types import Op

__all__ = [
    "Codec",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "average_or_op",
    "check_tensor",
    "compress",
    "copy_of",
    "decompress",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "scaled",
    "scaling",
]


class Codec(Protocol):
    """What Horovod's `compression=` takes: anything with its `compress` and `decompress` pair,
    `hvd.Compression.fp16` (the class) or one of the user's. Named apart from the library's
    `dp.Compression` compressors, which also name the wire dtype they reduce in."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]: ...

    def decompress(self, tensor: torch.Tensor, ctx: object) -> torch.Tensor: ...


_OPS: dict[int, Op] = {Sum: "sum", Average: "avg", Min: "min", Max: "max", Product: "prod"}


def average_or_op(op: int | None, average: bool | None) -> int:
    """Horovod's `op`/`average` rule: `op` wins, `average` is deprecated, default `Average`."""
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        return op
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average


def check_tensor(tensor: object) -> None:
    """Raise Horovod's `ValueError` for what it cannot communicate: non-tensors, strided views."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"Horovod operations take torch tensors, got {type(tensor).__name__}.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


@dataclass(frozen=True)
class _Scaling:
    """How one Horovod reduction runs on dataparallel: the op, the scale, and local scalings."""

    op: Op
    scale: float | None
    pre: float | None  # applied to the input copy before communicating
    post: float | None  # applied locally afterwards (integers: float64, truncated)


def scaling(tensors: Sequence[torch.Tensor], op: int, pre: float, post: float, n: int) -> _Scaling:
    if op == Adasum:
        raise NotImplementedError(
            "Adasum is not supported by dataparallel: use op=hvd.Average (or hvd.Sum)."
        )
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not one of hvd.Sum, Average, Min, Max, Product, Adasum.")
    integral = any(not (t.is_floating_point() or t.is_complex()) for t in tensors)
    pre_factor = None if pre == 1.0 else float(pre)
    if integral:  # Horovod: the sum, then the scaling in float64, truncated
        total = float(post) / n if op == Average else float(post)
        engine_op = "sum" if op == Average else _OPS[op]
        return _Scaling(engine_op, None, pre_factor, None if total == 1.0 else total)
    return _Scaling(_OPS[op], None if post == 1.0 else float(post), pre_factor, None)


def scaled(t: torch.Tensor, factor: float | None) -> torch.Tensor:
    """Multiply `t` by `factor` in place as Horovod does: integers through float64."""
    if factor is None or factor == 1.0:
        return t
    if t.is_floating_point() or t.is_complex():
        return t.mul_(factor)  # half precision: computed in float32 by torch on the CPU
    return t.copy_(t.double().mul_(factor))


def _start_allreduce(
    outputs: list[torch.Tensor], op: int, pre: float, post: float, ps: ProcessSet, wait: bool
) -> _handles.Started:
    group = group_of(ps)
    how = scaling(outputs, op, pre, post, ps.size() or 1)
    memory = _distinct(outputs) if how.pre is not None or how.post is not None else []
    for t in memory:
        scaled(t, how.pre)

    def after(_: object) -> list[torch.Tensor]:
        for t in memory:
            scaled(t, how.post)
        return outputs

    if wait:
        reductions.allreduce(outputs, op=how.op, scale=how.scale, group=group)
        return _handles.Done(after(None))
    request = reductions.iallreduce(outputs, op=how.op, scale=how.scale, group=group)
    return _handles.Then(request, after)


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return tensors that cover the memory of `tensors` (contiguous, `check_tensor`) once each:
    tensors that share memory are replaced by one flat view of their union, so that an in-place
    call's factors scale every element once (`grouped_allreduce_([t, t])`)."""
    spans: dict[torch.device, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            low = t.data_ptr()
            spans.setdefault(t.device, []).append((low, low + t.numel() * t.element_size(), i))
    shared = [group for device_spans in spans.values() for group in clusters(device_spans)]
    if not shared:
        return tensors
    out = [t for i, t in enumerate(tensors) if not any(i in group for group in shared)]
    for group in shared:
        members = [tensors[i] for i in group]
        first = members[0]
        if any(m.dtype != first.dtype for m in members):
            raise ValueError(
                f"tensors {group} of one in-place allreduce share memory with different dtypes "
                f"({', '.join(str(m.dtype) for m in members)}); pass each memory once."
            )
        low = min(int(m.storage_offset()) for m in members)
        high = max(int(m.storage_offset()) + m.numel() for m in members)
        out.append(first.as_strided((high - low,), (1,), low))
    return out


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _allreduce_async(
    tensors: list[torch.Tensor],
    name: str | None,
    op: int,
    pre: float,
    post: float,
    ps: ProcessSet,
    single: bool,
) -> int:
    """Queue an allreduce of `tensors`, in place; the handle returns them (or the one)."""
    for t in tensors:
        check_tensor(t)

    def start() -> _handles.Started:
        started = _start_allreduce(tensors, op, pre, post, ps, wait=False)
        return _handles.Then(started, lambda out: out[0] if single else out)

    return _handles.submit("allreduce", name, start)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing `tensor` across the process set; `synchronize(handle)` returns the result.

    The input is not modified. `op` is `Average` (default), `Sum`, `Min`, `Max` or `Product`.
    """
    op = average_or_op(op, average)
    check_tensor(tensor)
    return allreduce_async_(
        copy_of(tensor),
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it."""
    op = average_or_op(op, average)
    return _allreduce_async(
        [tensor], name, op, prescale_factor, postscale_factor, process_set, single=True
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Codec | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` across the process set and return the result (the input is not modified).

    Differentiable: the gradient is the same reduction of the output's gradient (Horovod's).
    `compression` (`hvd.Compression.fp16`) sends floating-point values in 16 bits.
    """
    op = average_or_op(op, average)
    check_tensor(tensor)
    return grouped_allreduce(
        [tensor],
        name=name,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )[0]


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` in place across the process set and return it."""
    handle = allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return _handles.synchronize(handle)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a list of tensors in one fused call; the inputs are not modified."""
    op = average_or_op(op, average)
    for t in tensors:
        check_tensor(t)
    return grouped_allreduce_async_(
        [copy_of(t) for t in tensors],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a list of tensors in place, in one fused call."""
    op = average_or_op(op, average)
    return _allreduce_async(
        list(tensors), name, op, prescale_factor, postscale_factor, process_set, single=False
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Codec | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in one fused call and return the results."""
    op = average_or_op(op, average)
    for t in tensors:
        check_tensor(t)
    packed = [compress(compression, t) for t in tensors]
    pre, post, ps = prescale_factor, postscale_factor, process_set

    def forward(*ts: torch.Tensor) -> list[torch.Tensor]:
        outputs = [copy_of(t) for t in ts]
        start = partial(_start_allreduce, outputs, op, pre, post, ps, True)
        return list(_handles.blocking("allreduce", name, start))

    def backward(*gs: torch.Tensor) -> list[torch.Tensor]:  # Horovod's: the same reduction
        return grouped_allreduce(
            list(gs), op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
        )

    results = through(forward, backward, *[c for c, _ in packed])
    return [decompress(compression, r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place, in one fused call, and return them."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return _handles.synchronize(handle)


def compress(compression: Codec | None, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
    return (tensor, None) if compression is None else compression.compress(tensor)


def decompress(compression: Codec | None, tensor: torch.Tensor, ctx: object) -> torch.Tensor:
    return tensor if compression is None else compression.decompress(tensor, ctx)
