"""16-bit floats on the host: fast casts (`widen`, `narrow`), a 16-bit sum (`add16`, which MPI's
own op calls), and a reduction that moves 16 bits and adds in float32 (`TwoPhase`).

`TwoPhase` is what a compressed allreduce hands an engine (`Backend.iallreduce_half`) where the
engine's own reduction of the 16-bit type is missing (bfloat16 on a generic engine; PROD, MIN and
MAX on MPI, whose sum is an op of its own). The buffer is cut into one part per rank
(Horovod's split: the first `n % size` ranks get one item more); one all-to-all gives every rank
all ranks' copies of its part; each rank reduces its part in float32, in rank order, and rounds
it once to 16 bits; one allgather gives every rank every part. The traffic is a ring allreduce's
(twice `(size - 1) / size` of the buffer per rank, in 16 bits), the result is rounded once
(closer than rounding at every step of a native reduction), and every rank gets the same bits.

NumPy here, and torch's casts when torch is loaded; `op` is a `ReduceOp` (read by its value, so
that this module needs no import of the protocol it serves).
"""

from __future__ import annotations

import enum
import sys
import weakref
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dataparallel import caches
from dataparallel.types import WireDtype

__all__ = ["TwoPhase", "add16", "narrow", "widen"]

_UFUNCS: dict[str, np.ufunc] = {"sum": np.add, "prod": np.multiply, "min": np.minimum}
_UFUNCS["max"] = np.maximum


class Waitable(Protocol):
    """What an engine's `ialltoallv` returns: a backend handle (`base.Handle`, restated here
    because `base.py` imports this module)."""

    def wait(self) -> object: ...

    def test(self) -> bool: ...


class Engine(Protocol):
    """What `TwoPhase` uses of a `Backend` (which this module serves, so cannot import)."""

    rank: int
    size: int

    def ialltoallv(
        self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]
    ) -> Waitable: ...

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None: ...


def widen(values: np.ndarray, dtype: WireDtype, out: np.ndarray) -> None:
    """Write 16-bit `values` (float16, or bfloat16 bits) into float32 `out`, exactly.

    torch's vectorized cast when torch is loaded (faster than NumPy's); else NumPy's (float16) or
    a shift of the bits (bfloat16).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.from_numpy(out).copy_(_torch_view(torch, values, dtype))
    elif dtype == "bfloat16":
        bits = out.view(np.uint32)
        bits[...] = values
        bits <<= 16
    else:
        out[...] = values


def narrow(wide: np.ndarray, dtype: WireDtype, out: np.ndarray) -> None:
    """Round float32 `wide` to nearest even into 16-bit `out` (bfloat16 as bits; NaN kept).

    torch's vectorized cast when torch is loaded (faster than NumPy's float16 cast); beyond
    float16's range values become inf, as a cast.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_view(torch, out, dtype).copy_(torch.from_numpy(wide))
        return
    if dtype != "bfloat16":
        with np.errstate(over="ignore"):
            out[...] = wide
        return
    bits = wide.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out[...] = rounded
    nan = np.isnan(wide)
    if nan.any():
        out[nan] = 0x7FC0


# Values per block of `add16`'s NumPy path: its float32 scratch stays in the caches.
_BLOCK = 1 << 14


def add16(values: np.ndarray, into: np.ndarray, dtype: WireDtype) -> None:
    """Add 16-bit `values` into `into` (same dtype and length), each sum rounded once to 16 bits.

    Each sum is computed in float32 and rounded to nearest even: float32 holds a sum of two
    float16 or bfloat16 values closely enough that this is the correctly rounded 16-bit sum (the
    result of a native 16-bit addition). torch's vectorized 16-bit addition when torch is loaded;
    else NumPy in float32 blocks.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_view(torch, into, dtype).add_(_torch_view(torch, values, dtype))
        return
    first = np.empty(min(_BLOCK, into.size), np.float32)
    second = np.empty_like(first)
    for start in range(0, into.size, _BLOCK):
        end = min(start + _BLOCK, into.size)
        a, b = first[: end - start], second[: end - start]
        widen(values[start:end], dtype, a)
        widen(into[start:end], dtype, b)
        np.add(a, b, out=a)
        narrow(a, dtype, into[start:end])


def _torch_view(torch: ModuleType, values: np.ndarray, dtype: WireDtype) -> Any:
    """Return a torch view (a `torch.Tensor`: this generic module names no framework) of host
    16-bit `values` (bfloat16 held as its bits)."""
    if dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


# Scratch arrays of `TwoPhase.wait` per engine, reused from call to call (fresh large arrays cost
# page faults). A wait runs to its end before the next on the same engine; a private duplicate
# engine may run in another thread (the optax callbacks), hence one set per engine. The receive
# buffer of the all-to-all is not scratch: several calls may be in flight at once.
_SCRATCH: weakref.WeakKeyDictionary[Engine, dict[tuple[str, int], np.ndarray]]
_SCRATCH = weakref.WeakKeyDictionary()
caches.register(_SCRATCH.clear)  # dp.finalize(): the ended world's engines keep none


def scratch(backend: Engine, dtype: npt.DTypeLike, items: int, slot: int) -> np.ndarray:
    """Return `items` items of `dtype`, `backend`'s own until its next wait (`slot`: which)."""
    mine = _SCRATCH.setdefault(backend, {})
    key = (np.dtype(dtype).str, slot)
    held = mine.get(key)
    if held is None or held.size < items:
        held = mine[key] = np.empty(max(items, 1024), dtype)
    return held[:items]


def parts(items: int, size: int) -> list[int]:
    """Return how many of `items` each of `size` ranks owns (the first `items % size`: one more)."""
    return [items // size + (1 if r < items % size else 0) for r in range(size)]


class TwoPhase:
    """A 16-bit allreduce in flight on `backend`, as the module describes; a backend `Handle`.

    Args:
        backend: the engine (its `ialltoallv` and `allgatherv` move the bits).
        buf: the values, 1-D: `float16`, or bfloat16 as `uint16` bits; the result lands here.
        op: a `ReduceOp`.
        dtype: `"float16"` or `"bfloat16"`.
    """

    def __init__(self, backend: Engine, buf: np.ndarray, op: enum.Enum, dtype: WireDtype) -> None:
        self.backend, self.buf, self.dtype = backend, buf, dtype
        self.ufunc = _UFUNCS[op.value]
        self.counts = parts(buf.size, backend.size)
        mine = self.counts[backend.rank]
        self.received = np.empty(mine * backend.size, buf.dtype)
        self.request = backend.ialltoallv(buf, self.counts, self.received, [mine] * backend.size)
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        if not self.request.test():
            return False
        self.wait()
        return True

    def wait(self) -> None:
        if self.done:
            return
        self.request.wait()
        size, mine = self.backend.size, self.counts[self.backend.rank]
        copies = self.received.reshape(size, mine)
        total, other = (
            scratch(self.backend, np.float32, mine, 1),
            scratch(self.backend, np.float32, mine, 2),
        )
        widen(copies[0], self.dtype, total)
        for r in range(1, size):  # in rank order: every rank's part is reduced the same way
            widen(copies[r], self.dtype, other)
            self.ufunc(total, other, out=total)
        part = scratch(self.backend, self.buf.dtype, mine, 3)
        narrow(total, self.dtype, part)
        self.backend.allgatherv(part, self.buf, self.counts)
        self.done = True
