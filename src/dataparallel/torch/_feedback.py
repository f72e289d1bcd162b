"""Error feedback for compressed gradient reductions (`dp.Compression.fp16_feedback`, ...).

A compressed reduction rounds each rank's gradient to 16 bits before it travels; what the rounding
takes is lost, step after step, in the same direction where a gradient keeps its sign (a float32
gradient of 1 + 2**-9 travels as 1.0 in bfloat16 at every step). With error feedback (EF-SGD, as
1-bit Adam and PowerSGD keep it) each rank keeps that residual per parameter and adds it to the
parameter's gradient at the next step, so what a rank sent over `T` steps differs from what it
computed by one residual, never by `T` of them.

Per parameter, when its bucket is launched: `g += e` (the residual of the last step), then
`e = g - round16(g)`, computed with the same cast `Fusion` applies to the bucket (round to
nearest even), so `e` is exactly what the wire drops. The residuals are this rank's own (ranks
differ); they live on the `GradientSync` and go with it.
"""

from __future__ import annotations

import torch

from dataparallel.types import WireDtype

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The rounding residual of each floating gradient, by the parameter's index in its sync."""

    def __init__(self, wire: WireDtype) -> None:
        self.wire = torch.float16 if wire == "float16" else torch.bfloat16
        self.residuals: dict[int, torch.Tensor] = {}

    def apply(self, index: int, grad: torch.Tensor) -> None:
        """Add the last residual of parameter `index` to `grad` (in place); keep the new one."""
        if not grad.is_floating_point() or grad.dtype == self.wire:
            return  # travels as it is: nothing is rounded away
        residual = self.residuals.get(index)
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            residual = self.residuals[index] = torch.zeros_like(grad)
        else:
            grad.add_(residual)
        torch.sub(grad, grad.to(self.wire), out=residual)  # what rounding to 16 bits drops
        if self.wire == torch.float16:  # beyond +-65504 the value travels as inf: carry nothing
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def clear(self) -> None:
        """Forget every residual (the parameters were renumbered)."""
        self.residuals.clear()
