"""Jitted `dp.allreduce` and `dp.sendrecv` against mpi4jax's and raw MPI's, side by side.

Run: `OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/jit_collectives.py`
(`--batches N`: rounds of the interleaved timing, 25 by default).

What an mpi4jax user ports (docs/migrate/mpi4jax.md): a jitted function that sums a float32
array across ranks, at 1 KiB, 64 KiB and 4 MiB, each case timed in short batches taken in turn
(`_timing.compare`), the result waited for:

- `dp`: `jax.jit(lambda x: dp.allreduce(x))` (the XLA FFI call, in place in XLA's memory);
- `mpi4jax`: `jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm))` on a duplicate of
  the world's communicator (the peer);
- `raw`: `comm.Allreduce(MPI.IN_PLACE, buf)` on a NumPy buffer (the floor: no JAX at all).

The same three for a halo exchange's call: a jitted `dp.sendrecv` round a ring (each rank sends
to the next and receives from the one before) against `mpi4jax.sendrecv` and a raw `Sendrecv`.

Printed: microseconds per call, and dp's time over mpi4jax's (goal: at most 1) and over raw.
Without mpi4jax its case is skipped, with the reason; docs/performance.md says how to build it
against the `mpich` wheel.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp

SIZES = {"1 KiB": 256, "64 KiB": 16384, "4 MiB": 1 << 20}  # float32 items


def cases_of(items: int, comm: MPI.Comm, m4j: bool) -> dict[str, Callable[[], Any]]:
    x = jnp.full(items, dp.rank() + 1.0, jnp.float32)
    ours = jax.jit(lambda v: dp.allreduce(v))
    cases: dict[str, Callable[[], Any]] = {"dp": lambda: jax.block_until_ready(ours(x))}
    if m4j:
        import mpi4jax

        theirs = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))
        cases["mpi4jax"] = lambda: jax.block_until_ready(theirs(x))
    buf = np.full(items, dp.rank() + 1.0, np.float32)
    cases["raw"] = lambda: comm.Allreduce(MPI.IN_PLACE, buf)
    expected = sum(range(1, dp.size() + 1))
    for name, case in cases.items():  # every case computes the same sum
        got = case()
        if name != "raw":
            np.testing.assert_array_equal(np.asarray(got)[:3], np.full(3, expected, np.float32))
    return cases


def ring_cases_of(items: int, comm: MPI.Comm, m4j: bool) -> dict[str, Callable[[], Any]]:
    rank, size = dp.rank(), dp.size()
    dest, source = (rank + 1) % size, (rank - 1) % size
    x = jnp.full(items, rank + 1.0, jnp.float32)
    ours = jax.jit(lambda v: dp.sendrecv(v, jnp.empty_like(v), source=source, dest=dest))
    cases: dict[str, Callable[[], Any]] = {"dp": lambda: jax.block_until_ready(ours(x))}
    if m4j:
        import mpi4jax

        theirs = jax.jit(
            lambda v: mpi4jax.sendrecv(v, jnp.empty_like(v), source=source, dest=dest, comm=comm)
        )
        cases["mpi4jax"] = lambda: jax.block_until_ready(theirs(x))
    buf, into = np.full(items, rank + 1.0, np.float32), np.empty(items, np.float32)
    cases["raw"] = lambda: comm.Sendrecv(buf, dest, 0, into, source, 0)
    for name, case in cases.items():  # every case receives the rank before's values
        got = case()
        got = into if name == "raw" else got
        np.testing.assert_array_equal(np.asarray(got)[:3], np.full(3, source + 1.0, np.float32))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=25)
    args = parser.parse_args()
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    m4j = importlib.util.find_spec("mpi4jax") is not None
    if dp.rank() == 0:
        print(f"{dp.size()} ranks, jax {jax.__version__} on {jax.devices()[0].platform}")
        if not m4j:
            print("mpi4jax case skipped: mpi4jax is not installed")
    kinds = {"allreduce": cases_of, "sendrecv round a ring": ring_cases_of}
    for (kind, make), (label, items) in itertools.product(kinds.items(), SIZES.items()):
        times = compare(make(items, comm, m4j), comm, batches=args.batches)
        if dp.rank() != 0:
            continue
        print(f"\n{label} float32 {kind} inside jax.jit")
        for case, seconds in times.items():
            print(f"  {case:10s} {seconds * 1e6:10.1f} us")
        if "mpi4jax" in times:
            print(f"  dp / mpi4jax = {times['dp'] / times['mpi4jax']:.2f}")
        print(f"  dp / raw = {times['dp'] / times['raw']:.2f}")
    comm.Free()
    dp.finalize()


if __name__ == "__main__":
    main()
