"""`dp.reducescatter` under min and max keeps NaN wherever any rank has one, as `allreduce` does.

Engines compare with `a > b ? a : b`: which rank held the NaN decided whether it survived (MPI),
or it never did (Gloo). Every rank in turn holds the NaNs here, in every floating dtype, with
leaves that hold none beside, and with a rank that has joined (`dp.join`) answering the masks.
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.arrays.segments import row_parts

torch = pytest.importorskip("torch")

ROWS = 7  # uneven parts at 2 and 3 ranks


def _rows(rank: int, size: int) -> slice:
    parts = row_parts(ROWS, size)
    start = sum(parts[:rank])
    return slice(start, start + parts[rank])


def _inputs(rank: int, holder: int, dtype: str) -> np.ndarray:
    x = np.arange(ROWS * 2, dtype=np.float64).reshape(ROWS, 2) * (rank + 1)
    if rank == holder:
        x[0, 0] = x[3, 1] = x[ROWS - 1, 0] = np.nan  # rows of every rank's part
    return x.astype(dtype)


def _expected(size: int, holder: int, op: str) -> np.ndarray:
    stacked = np.stack([_inputs(r, holder, "float64") for r in range(size)])
    return (np.max if op == "max" else np.min)(stacked, axis=0)  # NaN wins, as in NumPy


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_nan_wins_whichever_rank_holds_it(rank: int, size: int, op: str, dtype: str) -> None:
    for holder in range(size):
        x = _inputs(rank, holder, dtype)
        ints = np.full((ROWS, 3), rank, np.int32)
        out = dp.reducescatter({"x": x, "i": ints, "t": torch.from_numpy(x.copy())}, op=op)
        expected = _expected(size, holder, op)[_rows(rank, size)]
        np.testing.assert_array_equal(out["x"], expected.astype(dtype))
        np.testing.assert_array_equal(out["t"].numpy(), expected.astype(dtype))
        np.testing.assert_array_equal(out["i"], np.full(out["i"].shape, (size - 1) * (op == "max")))
        assert not np.isnan(x[1, 0])  # the input is not written


@pytest.mark.parametrize("op", ["max", "min"])
def test_bfloat16_and_no_nan_at_all(rank: int, size: int, op: str) -> None:
    holder = size - 1
    x = torch.from_numpy(_inputs(rank, holder, "float32")).to(torch.bfloat16)
    out = dp.reducescatter(x, op=op)
    expected = torch.from_numpy(_expected(size, holder, op)[_rows(rank, size)]).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, equal_nan=True)
    clean = np.arange(ROWS, dtype=np.float32) * (rank + 1)
    reduced = dp.reducescatter(clean, op=op)
    factor = size if op == "max" else 1
    np.testing.assert_array_equal(
        reduced, np.arange(ROWS, dtype=np.float32)[_rows(rank, size)] * factor
    )


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_joined_rank_answers_the_masks(rank: int, size: int, op: str) -> None:
    if size == 1:
        pytest.skip("needs a rank that joins and one that works")
    if rank == 0:
        dp.join()
        return
    for holder in range(1, size):
        x = _inputs(rank, holder, "float64")
        out = dp.reducescatter([x, np.ones((ROWS, 1), np.float32)], op=op)
        live = np.stack(
            [_inputs(r, holder, "float64") for r in range(1, size)] + [np.zeros((ROWS, 2))]
        )
        expected = (np.max if op == "max" else np.min)(live, axis=0)[_rows(rank, size)]
        np.testing.assert_array_equal(out[0], expected)
    dp.join()
