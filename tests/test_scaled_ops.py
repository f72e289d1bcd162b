"""Every op with and without a scale, on every path a reduction takes, NumPy and torch.

A scale multiplies the *result* of the reduction: `op(x_0, ..., x_{n-1}) * scale`. Prescaling each
rank's share is exact only for sums (and averages); for a product it would scale `size` times, and
for min/max of negative factors it would swap them. The sizes reach every path: inline (in the
handshake), packed (one leaf in place, several in one buffer), fused (several dtypes, several
buckets, leaves past the bucket size alone), non-blocking, to a root, and Horovod's prescale and
postscale factors. Rank r holds `r + 2` with alternating signs, so products and extremes differ.
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.config import DEFAULT_BUCKET_BYTES

torch = pytest.importorskip("torch")

OPS = ["sum", "avg", "prod", "min", "max"]
SCALES = [None, 0.5, 3.0, -2.0]
# float32 items: inline, just past the handshake's payload, one small leaf, at the bucket size,
# past it (a pair of these: two buckets).
SIZES = [3, 13, 1000, DEFAULT_BUCKET_BYTES // 4, DEFAULT_BUCKET_BYTES // 4 + 1]


def _values(r: int, n: int, dtype: str) -> np.ndarray:
    signs = np.where(np.arange(n) % 2 == 0, 1, -1)
    return ((r + 2) * signs).astype(dtype)


def _expected(size: int, n: int, op: str, scale: float | None) -> np.ndarray:
    stacked = np.stack([_values(r, n, "float64") for r in range(size)])
    combine = {"sum": np.sum, "avg": np.mean, "prod": np.prod, "min": np.min, "max": np.max}
    result: np.ndarray = combine[op](stacked, axis=0)
    return result * (1.0 if scale is None else scale)


def _check(got: object, size: int, n: int, op: str, scale: float | None) -> None:
    values = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    np.testing.assert_allclose(values.astype(np.float64), _expected(size, n, op, scale), rtol=1e-6)


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("op", OPS)
def test_every_op_and_scale_on_every_path(size: int, op: str, scale: float | None) -> None:
    rank = dp.rank()
    for n in SIZES:
        for dtype in ("float32", "float64"):
            x = _values(rank, n, dtype)
            _check(dp.allreduce(x, op, scale=scale), size, n, op, scale)  # inline, packed
            pair = [_values(rank, n, dtype), _values(rank, n, dtype)]
            for got in dp.allreduce(pair, op, scale=scale):  # packed in a buffer, or fused
                _check(got, size, n, op, scale)
            mixed = {"a": _values(rank, n, "float32"), "b": _values(rank, 5, "float64")}
            out = dp.allreduce(mixed, op, scale=scale)  # two dtypes: fused
            _check(out["a"], size, n, op, scale)
            _check(out["b"], size, 5, op, scale)
            got = dp.iallreduce(_values(rank, n, dtype), op, scale=scale).wait()
            _check(got, size, n, op, scale)
            root = size - 1
            got = dp.reduce(_values(rank, n, dtype), op, root=root, scale=scale)
            if rank == root:
                _check(got, size, n, op, scale)
        t = torch.from_numpy(_values(rank, SIZES[-1], "float32"))
        _check(dp.allreduce(t, op, scale=scale), size, SIZES[-1], op, scale)
        ts = [torch.from_numpy(_values(rank, n, "float32")) for n in SIZES]
        for n, got in zip(SIZES, dp.allreduce(ts, op, scale=scale), strict=True):  # buckets
            _check(got, size, n, op, scale)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_integers_with_an_integral_scale(size: int, op: str) -> None:
    rank = dp.rank()
    for n in SIZES:
        for dtype in ("int32", "int64"):
            got = dp.allreduce(_values(rank, n, dtype), op, scale=3)
            np.testing.assert_array_equal(got, _expected(size, n, op, 3.0).astype(dtype))
            tree = [_values(rank, n, dtype), _values(rank, 4, "float64")]
            got = dp.allreduce(tree, op, scale=-2)
            np.testing.assert_array_equal(got[0], _expected(size, n, op, -2.0).astype(dtype))


@pytest.mark.parametrize("op", ["Sum", "Average", "Product", "Min", "Max"])
def test_horovod_prescale_and_postscale(size: int, op: str) -> None:
    """Horovod scales every rank's input by `prescale_factor` before the reduction (so a product
    gains `prescale ** size`) and the result by `postscale_factor` after."""
    hvd = pytest.importorskip("dataparallel.horovod.torch")
    hvd.init()
    rank = dp.rank()
    name = {"Sum": "sum", "Average": "avg", "Product": "prod", "Min": "min", "Max": "max"}[op]
    for n in SIZES:
        for pre, post in [(1.0, 0.5), (0.5, 1.0), (2.0, -3.0)]:
            t = torch.from_numpy(_values(rank, n, "float64"))
            got = hvd.allreduce(t, op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post)
            stacked = np.stack([_values(r, n, "float64") * pre for r in range(size)])
            combine = {"sum": np.sum, "avg": np.mean, "prod": np.prod, "min": np.min}
            expected = combine.get(name, np.max)(stacked, axis=0) * post
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
