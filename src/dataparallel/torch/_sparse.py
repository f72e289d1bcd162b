"""Sparse gradients (`nn.Embedding(sparse=True)`) in `GradientSync`: gathered, or made dense.

A sparse gradient cannot go into a fused bucket as it is: its size differs from rank to rank. It
is reduced the way Horovod reduces one: every rank's rows (indices and values) are gathered
(`dp.allgather`), summed where they repeat (`coalesce`) and scaled as a dense gradient would be
(averaged over every rank, ranks without a gradient counting as zeros). The result is a sparse
gradient again, equal on every rank, so sparse optimizers (`SparseAdam`) work. With
`sparse_as_dense=True` (Horovod's name) sparse gradients are made dense and go into the buckets
like any other, and are made sparse again afterwards, as Horovod does (`SparseAdam` still works).

Which parameters take the gathered path must be the same on every rank, yet a rank learns that a
gradient is sparse only when it arrives, and a rank that did not use the embedding has none. So:

- A parameter starts in the dense buckets. A sparse gradient found there is made dense for the
  bucket, and the flag vector that travels with the last bucket says so (one float per
  parameter). After that step's reduction, every rank reads the same reduced flags: each such
  gradient is made sparse again (rows that are not all zero), and the parameter moves to the
  gathered path for the next steps (the buckets are laid out again without it). The first step
  is thus dense: correct values, one dense reduction.
- A parameter on the gathered path contributes its rows, or none (a rank without a gradient, or
  with a dense one, which is made sparse first). Gathers run when the step completes
  (`GradientSync.wait`), after the buckets, in parameter order.
"""

from __future__ import annotations

import numpy as np
import torch

from dataparallel.backends.base import Backend
from dataparallel.collectives import gathers

__all__ = ["SparseGrads"]


class SparseGrads:
    """The sparse side of one `GradientSync`: which parameters are gathered, and gathering them.

    Args:
        as_dense: make sparse gradients dense for good (`sparse_as_dense`).
    """

    def __init__(self, as_dense: bool) -> None:
        if not isinstance(as_dense, bool):
            raise TypeError(f"sparse_as_dense={as_dense!r} must be True or False.")
        self.as_dense = as_dense
        self.members: set[int] = set()  # parameter indices reduced by gathering
        self.seen: list[int] = []  # this step: sparse gradients made dense for the buckets

    def dense_order(self, order: list[int]) -> list[int]:
        """Return `order` without the gathered parameters (they go into no bucket)."""
        return [i for i in order if i not in self.members]

    def densify(self, index: int, p: torch.Tensor) -> torch.Tensor:
        """Make `p.grad` (there) dense for a bucket, noting that it was sparse on this rank;
        return it."""
        grad = p.grad
        assert grad is not None
        if grad.layout != torch.strided:
            grad = p.grad = grad.to_dense()
            self.seen.append(index)
        return grad

    def learn(self, params: list[tuple[str, torch.Tensor]], flags: np.ndarray) -> bool:
        """After a step's buckets: give back sparse layouts, and move the parameters found
        sparse on some rank to the gathered path. Return whether the gathered set grew.

        `flags` are the step's reduced sparse flags (1 where a rank sent a sparse gradient dense,
        `seen`; `StepTemplate.flags`), equal everywhere.
        """
        if not flags.any():  # most steps: no sparse gradient anywhere
            return False
        found = [int(i) for i in np.flatnonzero(flags)]
        for i in found:
            grad = params[i][1].grad
            if grad is not None:
                params[i][1].grad = grad.to_sparse(1)
        if self.as_dense or not found:  # as Horovod's sparse_as_dense: dense on the wire only
            return False
        self.members.update(found)
        return True

    def reduce(
        self, params: list[tuple[str, torch.Tensor]], backend: Backend, average: bool
    ) -> None:
        """Gather, coalesce and scale the gradients of the gathered parameters."""
        for i in sorted(self.members):
            p = params[i][1]
            rows, values = _rows(p)
            got: dict[str, torch.Tensor] = gathers.allgather(
                {"has": torch.tensor([p.grad is not None]), "rows": rows, "values": values},
                backend=backend,
            )
            if not bool(got["has"].any()):
                p.grad = None  # no rank had a gradient: as one process would
                continue
            total = got["values"] / backend.size if average else got["values"]
            # The context, not check_invariants=True alone: torch 2.11-2.12 warn unless the global
            # setting is explicit (pytorch#184610).
            with torch.sparse.check_sparse_tensor_invariants(enable=True):
                p.grad = torch.sparse_coo_tensor(got["rows"][None], total, p.shape).coalesce()


def _rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return this rank's gradient of `p` as (row indices, rows), coalesced; empty without one."""
    grad = p.grad
    if grad is None:
        return (
            torch.zeros(0, dtype=torch.int64, device=p.device),
            torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
        )
    if grad.layout == torch.strided:
        grad = grad.to_sparse(1)
    elif grad.sparse_dim() != 1:
        grad = grad.to_dense().to_sparse(1)
    grad = grad.coalesce()
    return grad.indices()[0].contiguous(), grad.values().contiguous()
