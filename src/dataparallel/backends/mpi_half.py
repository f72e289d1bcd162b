"""MPI sums of float16 and bfloat16: user-defined reduction ops, so a compressed sum is one call.

MPI has no bfloat16, and MPICH's float16 sum is a scalar loop. Horovod registers its own float16
sum with MPI; so does this module, through mpi4py's `MPI.Op.Create`: MPI calls the Python function
once per piece of the buffer it reduces (a whole buffer, or a part of it), never per value, and
the function adds with `half.add16` (torch's vectorized 16-bit addition when torch is loaded;
NumPy in float32 blocks else). Each addition is rounded once to 16 bits, as a native half sum is.

The values travel as `MPI.UINT16_T` (two bytes that MPI only moves). MPICH reduces with a
user-defined op by recursive doubling: at 2 ranks each rank sends and receives the buffer once
(a ring's traffic); at `p` ranks `log2(p)` times (a ring: `2 (p - 1) / p` times), which is why
only SUM goes this way: PROD, MIN and MAX keep `half.TwoPhase`.

The ops depend on nothing of a world: made once per process on first use, freed with the
caches at `dp.finalize()` (mpi4py has a few dozen slots for user-defined ops).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from dataparallel import caches
from dataparallel.backends.half import add16
from dataparallel.types import WireDtype

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["half_sum"]

_OPS: dict[WireDtype, MPI.Op] = {}


def half_sum(mpi: ModuleType, dtype: WireDtype) -> MPI.Op:
    """Return the MPI op that sums `dtype` (`"float16"`, `"bfloat16"`) values sent as `UINT16_T`."""
    op = _OPS.get(dtype)
    if op is None:
        view = np.float16 if dtype == "float16" else np.uint16

        def reduce(values: memoryview, into: memoryview, _datatype: object) -> None:
            add16(np.frombuffer(values, view), np.frombuffer(into, view), dtype)

        op = _OPS[dtype] = mpi.Op.Create(reduce, commute=True)
    return op


def _free() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not mpi.Is_finalized():  # else MPI freed them itself
        for op in _OPS.values():
            op.Free()
    _OPS.clear()


caches.register(_free)
