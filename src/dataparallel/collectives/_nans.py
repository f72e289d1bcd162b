"""min and max that keep NaN alike on every rank: the plans' "fused" calls, when a rank has one.

When the handshake says some rank holds a NaN (`local_nans`), the values are reduced as usual and,
beside them, a uint8 mask of each rank's NaNs (reduced with MAX); NaN is then written wherever
any rank had one (`arrays/nan.py` says why the engines alone cannot be trusted with it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.fusion import Fusion
from dataparallel.arrays.nan import FLOATING, has_nan, nan_mask, set_nan
from dataparallel.backends.base import Handle, ReduceOp
from dataparallel.collectives._call import CallContext, Leaf, run

__all__ = ["local_nans", "nan_preserving"]


def _host_values(leaf: Leaf) -> np.ndarray:
    work = leaf.work
    return work if type(work) is np.ndarray else leaf.family.to_host(leaf.value)


def local_nans(leaves: list[Leaf]) -> list[Leaf]:
    """Return the floating leaves that hold a NaN on this rank."""
    return [
        leaf
        for leaf in leaves
        if leaf.dtype in FLOATING and has_nan(_host_values(leaf), leaf.dtype)
    ]


def nan_preserving(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    action: Reduction,
    async_op: bool,
    wire: str | None,
) -> tuple[Handle, Callable[[], object]]:
    """Run a min/max reduction, then write NaN wherever any rank had one (see `arrays.nan`)."""
    floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
    masks = [nan_mask(_host_values(leaf), leaf.dtype) for leaf in floating]
    fusion, finish = run(ctx, collective, flat, leaves, action, async_op, compression=wire)
    mask_fusion = _fuse_masks(ctx, masks, async_op)

    def finish_with_nan() -> object:
        mask_fusion.wait()
        if action.root is None or action.root == ctx.backend.rank:
            for leaf, mask in zip(floating, masks, strict=True):
                if type(leaf.work) is np.ndarray:
                    set_nan(leaf.work, leaf.dtype, mask)
                else:  # a device leaf: its reduction has landed already
                    host = leaf.family.to_host(leaf.value)
                    set_nan(host, leaf.dtype, mask)
                    leaf.family.from_host(leaf.value, host)
        return finish()

    return _Both(fusion, mask_fusion), finish_with_nan


def _fuse_masks(ctx: CallContext, masks: list[np.ndarray], async_op: bool) -> Fusion:
    fusion = Fusion(
        ctx.backend,
        Reduction(ReduceOp.MAX),
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=async_op,
        pool=ctx.buffers,
    )
    for mask in masks:
        fusion.add(mask, "uint8")
    fusion.flush()
    return fusion


class _Both:
    """Two collectives in flight, waited for together."""

    def __init__(self, first: Handle, second: Handle) -> None:
        self.first, self.second = first, second

    def wait(self) -> None:
        self.first.wait()
        self.second.wait()

    def test(self) -> bool:
        return self.first.test() and self.second.test()
