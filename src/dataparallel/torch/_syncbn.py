"""`dp.torch.SyncBatchNorm`: batch normalization with statistics over every rank's batch.

In training, each rank computes its batch's count, mean and sum of squared deviations per channel
(`torch.var_mean`, accurate however large the mean), and one `dp.allgather` of those gives every
rank all of them; they are combined exactly (Chan's parallel formula) in float64 into the global
mean and variance. So the forward pass equals one process's `BatchNorm` over the concatenated
batch, whatever the ranks' batch sizes (a rank may even have none), and the running statistics
are updated as that one `BatchNorm` would update them (unbiased variance over the global count).

The backward pass is torch's and Horovod's: one fused `dp.allreduce` (sum) of the per-channel
sums of `grad` and of `grad * (x - mean)`, from which each rank's input gradient follows. The
weight and bias gradients stay local (this rank's share): `DistributedOptimizer` or
`DataParallelModel` averages them with the other gradients, as DDP does for torch's own
`SyncBatchNorm`. Under that average the input and parameter gradients are those of one process
training on the global batch.

In eval mode (with running statistics) nothing is communicated; in a world of one, or before
`dp.initialize()`, it is plain `BatchNorm`. Every rank must call it the same number of times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from dataparallel import world
from dataparallel.collectives import gathers, reductions
from dataparallel.groups import Group

if TYPE_CHECKING:
    from torch.types import Device


class _Ctx(Protocol):
    """The `ctx` autograd passes `_SyncBatchNormFunction`: what its forward keeps on it."""

    total: float
    group: Group | None
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """`BatchNorm` whose batch statistics cover every rank's batch (any input of 2+ dims).

    Args:
        num_features: channels `C` of inputs shaped `(N, C, ...)`.
        eps: as `torch.nn.BatchNorm2d`.
        momentum: as `torch.nn.BatchNorm2d` (`None`: cumulative average).
        affine: as `torch.nn.BatchNorm2d`.
        track_running_stats: as `torch.nn.BatchNorm2d`.
        device: as `torch.nn.BatchNorm2d`.
        dtype: as `torch.nn.BatchNorm2d`.
        group: normalize over the ranks of this `dp.new_group` only (default: the world).

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> bn = dp.torch.SyncBatchNorm(3)
    >>> bn(torch.randn(4, 3, 5)).shape
    torch.Size([4, 3, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group: Group | None = None,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of at least 2 dims (N, C, ...), got "
                f"{input.dim()}D with shape {tuple(input.shape)}."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input` with the global batch's statistics (training) or running ones."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not batch_stats or not world.initialized() or world.size(self.group) == 1:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                batch_stats,
                factor,
                self.eps,
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.group
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, group: Group | None = None
    ) -> torch.nn.Module:
        """Return `module` with every `BatchNorm*d` in it replaced by a `SyncBatchNorm`.

        Parameters, running statistics, `requires_grad` and the training flag carry over (the
        tensors themselves, not copies), as `torch.nn.SyncBatchNorm.convert_sync_batchnorm` does.

        >>> import torch, dataparallel as dp
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
        >>> type(dp.torch.SyncBatchNorm.convert_sync_batchnorm(net)[1]).__name__
        'SyncBatchNorm'
        """
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                group,
            )
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, group))
        return converted


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _accumulation(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: Group | None,
    ) -> torch.Tensor:
        channels, acc = x.shape[1], _accumulation(x)
        xf = x.detach().to(acc)
        count = x.numel() // channels if channels else 0
        if count > 0:
            var, mean = torch.var_mean(xf, dim=_reduce_dims(x), correction=0)
        else:
            var = mean = torch.zeros(channels, dtype=acc, device=x.device)
        local = torch.cat([mean.new_tensor([count]), mean, var * count]).double()
        every = gathers.allgather(local[None], group=group)
        counts, means, squares = every[:, :1], every[:, 1 : 1 + channels], every[:, 1 + channels :]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(total)} across all ranks (input of shape {tuple(x.shape)} on this rank)."
            )
        global_mean = (counts * means).sum(0) / total
        deviations = squares.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
        invstd = (deviations / total + eps).rsqrt()
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = deviations / (total - 1)
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean) * momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var) * momentum)
        shape = _channel_shape(x)
        mean_c, invstd_c = global_mean.to(acc), invstd.to(acc)
        out = (xf - mean_c.view(shape)) * invstd_c.view(shape)
        if weight is not None:
            out = out * weight.detach().to(acc).view(shape)
        if bias is not None:
            out = out + bias.detach().to(acc).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.total, ctx.group = total, group
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc, shape, dims = mean.dtype, _channel_shape(x), _reduce_dims(x)
        g = grad.to(acc)
        xmu = x.to(acc) - mean.view(shape)
        sum_dy = g.sum(dims)
        sum_dy_xmu = (g * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if need_weight and weight is not None:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if need_bias:
            grad_bias = sum_dy.to(grad.dtype if weight is None else weight.dtype)
        if need_input:
            both = reductions.allreduce(torch.cat([sum_dy, sum_dy_xmu]), "sum", group=ctx.group)
            channels = x.shape[1]
            mean_dy = (both[:channels] / ctx.total).view(shape)
            mean_dy_xmu = (both[channels:] / ctx.total).view(shape)
            scale = invstd.view(shape)
            if weight is not None:
                scale = scale * weight.detach().to(acc).view(shape)
            grad_input = ((g - mean_dy - xmu * invstd.view(shape) ** 2 * mean_dy_xmu) * scale).to(
                x.dtype
            )
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
