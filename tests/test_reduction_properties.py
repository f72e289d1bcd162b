"""Property: a reduction of any tree gives what NumPy gives, aliases, scales, compression and joins
included.

Hypothesis draws a call: the collective (`allreduce`, `iallreduce`, `reduce`,
`allreduce_gradients`, `reducescatter`), the op and scale, the dtype and family (NumPy or
torch), a tree whose leaves are views of a few base arrays (the whole array, the same array
again, overlapping slices), sizes from a few items to past the bucket size, a 16-bit wire dtype,
a NaN on one rank, and whether the last rank has joined (`dp.join`) and answers with zeros. Every
rank can compute every rank's inputs, so every rank checks every base array against a NumPy
reference: where a leaf covers it, the op over all ranks' values (a joined rank's are zeros,
Horovod's rule) times the scale, once; elsewhere, its values untouched (a reduce-scatter's
results are new arrays: this rank's rows of each leaf's reduction). Under several ranks every
rank draws the same examples (`derandomize=True`, `conftest.py`); the job runs under its
launcher's timeout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dataparallel as dp
from dataparallel.arrays.segments import row_parts

torch = pytest.importorskip("torch")

# float64 items past the bucket size (256 KiB): such a leaf is reduced in place, alone.
SIZES = [1, 7, 300, 33_000]
COLLECTIVES = ["allreduce", "iallreduce", "reduce", "allreduce_gradients", "reducescatter"]
COMBINE = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


@dataclasses.dataclass(frozen=True)
class View:
    base: int  # which base array
    start: int  # a slice of it, in items
    stop: int


@dataclasses.dataclass(frozen=True)
class Call:
    collective: str
    op: str
    scale: float | None
    dtype: str
    family: str
    sizes: tuple[int, ...]  # each base array's length
    views: tuple[View, ...]  # the tree's leaves, in order
    wire: str | None
    nan: bool  # rank 0 holds a NaN in the first item of every base (floating min/max)
    joined: bool  # the last rank has joined
    root: int

    def base(self, rank: int, b: int) -> np.ndarray:
        """Rank `rank`'s values of base array `b`: small integers, exact in 16 bits."""
        n = self.sizes[b]
        items = np.arange(n)
        values = (rank + 2) * (items % 3 + 1) * np.where(items % 2 == 0, 1, -1) + b
        out = values.astype(self.dtype)
        if self.nan and rank == 0:
            out[0] = np.nan
        return out

    def expected(self, size: int, rank: int, b: int) -> np.ndarray:
        """Base array `b` on `rank` after the call."""
        mine = self.base(rank, b).astype(np.float64)
        if self.collective == "reducescatter" or (
            self.collective == "reduce" and rank != self.root
        ):
            return mine  # results are new arrays / not this rank's to receive
        covered = np.zeros(self.sizes[b], bool)
        for view in self.views:
            if view.base == b:
                covered[view.start : view.stop] = True
        return np.where(covered, self.total(size, b), mine)

    def total(self, size: int, b: int) -> np.ndarray:
        """The reduction of base array `b` over every rank, scaled."""
        live = size - 1 if self.joined else size
        stacked = [self.base(r, b).astype(np.float64) for r in range(live)]
        stacked += [np.zeros(self.sizes[b])] * (size - live)
        combine = {"min": np.minimum.reduce, "max": np.maximum.reduce}.get(self.op)
        total = combine(stacked) if combine else COMBINE[self.op](stacked, axis=0)
        total = total / size if self.op == "avg" else total
        result: np.ndarray = total * (1.0 if self.scale is None else self.scale)
        return result


@st.composite
def calls(draw: st.DrawFn) -> Call:
    collective = draw(st.sampled_from(COLLECTIVES))
    op = draw(
        st.sampled_from(["sum", "avg"] if collective == "allreduce_gradients" else list(COMBINE))
    )
    dtype = draw(st.sampled_from(["float32", "float64", "int64"]))
    assume(not (dtype == "int64" and op == "avg"))
    scales: list[float | None] = [None, 0.5, 3.0, -2.0] if dtype != "int64" else [None, 3.0]
    scale = draw(st.sampled_from([None] if collective == "allreduce_gradients" else scales))
    sizes = tuple(draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=2)))
    views = []
    for _ in range(draw(st.integers(1, 4))):
        b = draw(st.integers(0, len(sizes) - 1))
        n = sizes[b]
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        whole = draw(st.booleans())  # the whole base (so the same array often appears twice)
        views.append(View(b, 0, n) if whole else View(b, start, stop))
    compressible = collective not in ("reduce", "reducescatter") and dtype != "int64"
    wire = draw(st.sampled_from([None, "fp16", "bf16"])) if compressible else None
    nan = dtype != "int64" and op in ("min", "max") and draw(st.booleans())
    return Call(
        collective,
        op,
        scale,
        dtype,
        draw(st.sampled_from(["numpy", "torch"])),
        sizes,
        tuple(views),
        wire,
        nan,
        draw(st.booleans()),
        draw(st.integers(0, 2)),
    )


def _run(call: Call, tree: list[object]) -> object:
    compression = {None: None, "fp16": dp.Compression.fp16, "bf16": dp.Compression.bf16}
    wire = compression[call.wire]
    if call.collective == "allreduce":
        return dp.allreduce(tree, call.op, scale=call.scale, compression=wire)
    if call.collective == "iallreduce":
        return dp.iallreduce(tree, call.op, scale=call.scale, compression=wire).wait()
    if call.collective == "reduce":
        return dp.reduce(tree, call.op, root=call.root, scale=call.scale)
    if call.collective == "reducescatter":
        return dp.reducescatter(tree, call.op, scale=call.scale)
    return dp.allreduce_gradients(tree, call.op, compression=wire)


@settings(max_examples=80)
@given(call=calls())
def test_every_reduction_matches_numpy(call: Call) -> None:
    rank, size = dp.rank(), dp.size()
    joined = call.joined and size > 1
    call = dataclasses.replace(call, joined=joined, root=call.root % (size - joined))
    if joined and rank == size - 1:
        dp.join()
        return
    bases = [call.base(rank, b) for b in range(len(call.sizes))]
    if call.family == "torch":
        arrays: list[object] = [torch.from_numpy(b) for b in bases]  # the same memory
    else:
        arrays = list(bases)
    tree = [arrays[v.base][v.start : v.stop] for v in call.views]  # type: ignore[index]
    out = _run(call, tree)
    tolerance = 1e-2 if call.wire else 1e-6
    for b, base in enumerate(bases):
        expected = call.expected(size, rank, b)
        np.testing.assert_allclose(
            base.astype(np.float64), expected, rtol=tolerance, err_msg=str(b)
        )
    for got, view in zip(out, call.views, strict=True):  # type: ignore[call-overload]
        values = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        expected = call.expected(size, rank, view.base)[view.start : view.stop]
        if call.collective == "reducescatter":  # this rank's rows of the view's reduction
            parts = row_parts(view.stop - view.start, size)
            first = view.start + sum(parts[:rank])
            expected = call.total(size, view.base)[first : first + parts[rank]]
        np.testing.assert_allclose(values.astype(np.float64), expected, rtol=tolerance)
    if joined:
        dp.join()
