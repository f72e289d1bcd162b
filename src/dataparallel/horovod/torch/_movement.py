"""Horovod's data movement: allgather, broadcast and alltoall (plain, in place, grouped, async).

Each hands over to `dp.allgather`, `dp.broadcast` / `dp.ibroadcast` and `dp.alltoall` on the
process set's group. Roots are world ranks, as in Horovod, translated to the group's here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias, overload

import torch

from dataparallel import world
from dataparallel.collectives import broadcasts, exchanges, gathers
from dataparallel.horovod.torch import _handles
from dataparallel.horovod.torch._autograd import through
from dataparallel.horovod.torch._basics import Average
from dataparallel.horovod.torch._process_sets import (
    ProcessSet,
    global_process_set,
    group_of,
    root_in,
)
from dataparallel.horovod.torch._reductions import allreduce, check_tensor, grouped_allreduce

__all__ = [
    "allgather",
    "allgather_async",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
]


# Rows to send to each process of the set: a sequence of ints or an int32 tensor; None: equal parts.
Splits: TypeAlias = "Sequence[int] | torch.Tensor | None"


def _gather(tensors: list[torch.Tensor], ps: ProcessSet) -> _handles.Started:
    group = group_of(ps)
    return _handles.Done(gathers.allgather([t.detach() for t in tensors], group=group))


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start concatenating every process's `tensor` along the first axis, in rank order."""
    check_tensor(tensor)
    return _handles.submit(
        "allgather",
        name,
        lambda: _handles.Then(_gather([tensor], process_set), lambda out: out[0]),
    )


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every process's `tensor` along the first axis (which may differ per rank)."""
    return grouped_allgather([tensor], name, process_set)[0]


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start allgathering a list of tensors in one call."""
    listed = list(tensors)
    for t in listed:
        check_tensor(t)
    return _handles.submit("allgather", name, lambda: _gather(listed, process_set))


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather a list of tensors in one call; return the gathered tensors."""
    listed = list(tensors)
    for t in listed:
        check_tensor(t)

    def forward(*ts: torch.Tensor) -> list[torch.Tensor]:
        return list(_handles.blocking("allgather", name, lambda: _gather(list(ts), process_set)))

    return through(forward, lambda *gs: _gather_grads(list(gs), listed, process_set), *listed)


def _gather_grads(
    grads: list[torch.Tensor], inputs: list[torch.Tensor], ps: ProcessSet
) -> list[torch.Tensor]:
    """Horovod's gradient of an allgather: the averaged gradients, at this process's rows."""
    reduced = grouped_allreduce(grads, op=Average, process_set=ps)
    rows = [t.shape[0] if t.dim() else 1 for t in inputs]
    every = allgather(torch.tensor([rows], dtype=torch.int64), process_set=ps)
    before = every[: ps.rank() or 0].sum(dim=0)
    return [
        r.narrow(0, int(offset), n).reshape(t.shape)
        for r, offset, n, t in zip(reduced, before, rows, inputs, strict=True)
    ]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor as Horovod does: gather every process's indices and values.

    Returns a function that waits and returns the sparse result (values averaged over the
    process set for `op=Average`; repeated indices are left for the consumer to coalesce).
    """
    indices = allgather_async(
        tensor._indices().transpose(0, 1).contiguous(),
        name=f"{name}.indices",
        process_set=process_set,
    )
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        gathered_values = _handles.synchronize(values)
        gathered_indices = _handles.synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / (process_set.size() or 1)
        # An explicit setting: torch warns when the invariant checks are implicitly off.
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            return torch.sparse_coo_tensor(
                gathered_indices.transpose(0, 1), gathered_values, tensor.size()
            )

    return handle


def _start_broadcast(
    output: torch.Tensor, root_rank: int, ps: ProcessSet, wait: bool
) -> _handles.Started:
    group = group_of(ps)
    root = root_in(ps, root_rank)
    if wait:
        return _handles.Done(broadcasts.broadcast(output, root=root, group=group))
    return broadcasts.ibroadcast(output, root=root, group=group)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start copying `root_rank`'s `tensor` to every process; the input is not modified."""
    check_tensor(tensor)
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start copying `root_rank`'s `tensor` into every process's `tensor`, in place."""
    check_tensor(tensor)
    return _handles.submit(
        "broadcast", name, lambda: _start_broadcast(tensor, root_rank, process_set, wait=False)
    )


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return `root_rank`'s `tensor` on every process (the input is not modified)."""
    check_tensor(tensor)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return broadcast_(t.detach().clone(), root_rank, name, process_set)

    def backward(g: torch.Tensor) -> torch.Tensor:  # Horovod's: averaged, on the root only
        reduced = allreduce(g, op=Average, process_set=process_set)
        return reduced if world.rank() == root_rank else reduced.zero_()

    return through(forward, backward, tensor)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Copy `root_rank`'s `tensor` into every process's `tensor`, in place; return it."""
    check_tensor(tensor)
    return _handles.blocking(
        "broadcast", name, lambda: _start_broadcast(tensor, root_rank, process_set, wait=True)
    )


def _splits_of(tensor: torch.Tensor, splits: Splits) -> tuple[torch.Tensor, list[int] | None]:
    """Check `splits` as Horovod does; return the rows to send (trimmed) and the splits."""
    if splits is None:
        return tensor, None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"splits must be a tensor of int32, got {splits.dtype}.")
        listed = [int(s) for s in splits.cpu().tolist()]
    else:
        listed = [int(s) for s in splits]
    rows = tensor.shape[0] if tensor.dim() else 0
    if sum(listed) > rows:
        raise ValueError(
            f"The splits {listed} send {sum(listed)} rows, more than the tensor's first "
            f"dimension ({rows})."
        )
    return tensor[: sum(listed)], listed


def _checked_splits(
    tensor: torch.Tensor, splits: Splits, ps: ProcessSet
) -> tuple[torch.Tensor, list[int] | None]:
    """Check `tensor` and `splits` where Horovod does, before anything is queued."""
    check_tensor(tensor)
    sent, listed = _splits_of(tensor, splits)
    n = ps.size() or 1
    if listed is None and (not tensor.dim() or tensor.shape[0] % n):
        rows = tensor.shape[0] if tensor.dim() else 0
        raise ValueError(
            f"alltoall without splits divides the first dimension ({rows}) equally among the "
            f"{n} processes: it must be a multiple of that number."
        )
    return sent, listed


def _start_alltoall(
    sent: torch.Tensor, listed: list[int] | None, ps: ProcessSet
) -> _handles.Started:
    output, received = exchanges.alltoall(sent.detach(), splits=listed, group=group_of(ps))
    return _handles.Done((output, torch.tensor(received, dtype=torch.int32)))


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start sending `splits[i]` rows of `tensor` to process i (default: equal parts)."""
    sent, listed = _checked_splits(tensor, splits, process_set)

    def start() -> _handles.Started:  # without splits, Horovod returns the rows alone
        started = _start_alltoall(sent, listed, process_set)
        return _handles.Then(started, lambda out: out if listed is not None else out[0])

    return _handles.submit("alltoall", name, start)


@overload
def alltoall(
    tensor: torch.Tensor,
    splits: None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor: ...


@overload
def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def alltoall(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send `splits[i]` rows of `tensor` to process i; return the rows received.

    With `splits` given, returns `(received, received_splits)` (an int32 tensor of how many rows
    came from each process); without, the received tensor alone, as Horovod.
    """
    sent, listed = _checked_splits(tensor, splits, process_set)
    received: list[torch.Tensor] = []

    def forward(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = _handles.blocking("alltoall", name, lambda: _start_alltoall(t, listed, process_set))
        received.append(out[1])
        return out

    def backward(g: torch.Tensor, *_: object) -> torch.Tensor:  # the rows go back where they came
        return alltoall(g.contiguous(), splits=received[0], process_set=process_set)[0]

    output, splits_back = through(forward, backward, sent)
    return (output, splits_back) if listed is not None else output
