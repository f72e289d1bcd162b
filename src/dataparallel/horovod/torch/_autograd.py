"""Horovod's gradients for its synchronous operations (`horovod/torch/mpi_ops.py`).

`hvd.allreduce`, `allgather`, `broadcast`, `alltoall`, `reducescatter` and their `grouped_` forms
are differentiable in Horovod, each with a backward made of Horovod operations. `through` runs an
operation so that autograd differentiates it by such a backward: the forward and the backward are
the drop-in's own calls (so `op`, the scale factors and `process_set` keep Horovod's meaning),
and nothing is recorded unless an input requires a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias, TypeVar, cast

import torch

__all__ = ["through"]

# What an operation returns: a tensor, a list of them, or a tuple (an alltoall's rows and splits).
Outputs: TypeAlias = "torch.Tensor | Sequence[torch.Tensor]"
_R = TypeVar("_R", bound=Outputs)


class _Rule:
    def __init__(self, forward: Callable[..., Outputs], backward: Callable[..., Outputs]) -> None:
        self.forward, self.backward = forward, backward
        self.kind: type = torch.Tensor


class _Ctx(Protocol):
    """The `ctx` autograd passes `_Through`: the rule its forward keeps for backward."""

    rule: _Rule


class _Through(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, rule: _Rule, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rule = rule
        result = rule.forward(*tensors)
        rule.kind = type(result)
        return (result,) if isinstance(result, torch.Tensor) else tuple(result)

    @staticmethod
    def backward(ctx: _Ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        got = ctx.rule.backward(*[g.contiguous() for g in grads])  # `sum()`'s are expanded
        return (None, *((got,) if isinstance(got, torch.Tensor) else got))


def through(
    forward: Callable[..., _R], backward: Callable[..., Outputs], *tensors: torch.Tensor
) -> _R:
    """Return `forward(*tensors)`, differentiated by `backward(*grads)` (one gradient per input).

    `forward` returns a tensor, a list of them, or a tuple (an alltoall's rows and splits).
    """
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return forward(*tensors)
    rule = _Rule(forward, backward)
    outputs = _Through.apply(rule, *tensors)
    if rule.kind is torch.Tensor or issubclass(rule.kind, torch.Tensor):
        return outputs[0]
    return cast(_R, list(outputs) if rule.kind is list else tuple(outputs))  # forward's kind
