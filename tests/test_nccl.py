"""The NCCL backend, at any world size.

Without a GPU (or without CuPy and NCCL) what runs is: the error that says what to install, from
`create`, the constructor and `dp.initialize("nccl")` in a fresh process; and the pure logic
(which NCCL datatype reduces which dtype, which engine carries host buffers). The NCCL
collectives themselves need a GPU: those tests skip with the reason. See docs/gpu.md.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from _families import (
    FAMILY,
    OPS,
    Family,
    assert_values,
    expected,
    invalid,
    rank_values,
    usable,
)
from _jobs import run_job

import dataparallel as dp
from dataparallel.backends import registry
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.nccl import INSTALL_HINT, NCCLBackend, unavailable_reason
from dataparallel.backends.nccl.support import nccl_reduction
from dataparallel.backends.registry import choose
from dataparallel.backends.single import SingleBackend
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

REASON = unavailable_reason()
# The reason's first sentence (what is missing); the install hint is tested below.
MISSING = f"NCCL is not usable here: {(REASON or '').split(' The ')[0]} (see docs/gpu.md)"
needs_nccl = pytest.mark.skipif(REASON is not None, reason=MISSING)
without_nccl = pytest.mark.skipif(REASON is None, reason="NCCL is usable here")
GPU_FAMILIES = [pytest.param(FAMILY[name], id=name) for name in ("torch-cuda", "cupy")]


# -- without a GPU -----------------------------------------------------------------------------


@without_nccl
def test_the_reason_says_what_is_needed() -> None:
    assert REASON is not None
    assert "GPU" in REASON and "pip install cupy-cuda12x" in REASON
    assert REASON.endswith(INSTALL_HINT)


@without_nccl
def test_create_raises_backend_unavailable_with_the_install_hint() -> None:
    with pytest.raises(
        BackendUnavailableError, match=r"needs an NVIDIA GPU.*pip install cupy-cuda12x"
    ):
        NCCLBackend.create(settings=Settings())
    with pytest.raises(BackendUnavailableError, match=r"backend='mpi' or 'gloo'"):
        NCCLBackend(SingleBackend())


@without_nccl
@pytest.mark.spawns
def test_initialize_nccl_without_a_gpu_fails_with_the_install_hint() -> None:
    code = "import dataparallel as dp\ndp.initialize('nccl')\n"
    done = run_job(["-c", code], launcher="python")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dataparallel.errors.BackendUnavailableError: "), done.stderr
    assert "pip install cupy-cuda12x" in last and "GPU" in last


@pytest.mark.parametrize(
    ("dtype", "op", "want"),
    [
        ("float32", ReduceOp.SUM, (7, 1)),
        ("float16", ReduceOp.PROD, (6, 1)),
        ("bfloat16", ReduceOp.MAX, (9, 1)),
        ("float64", ReduceOp.MIN, (8, 1)),
        ("int8", ReduceOp.SUM, (0, 1)),
        ("uint8", ReduceOp.MAX, (1, 1)),  # bool travels as uint8 with MAX/MIN
        ("int32", ReduceOp.SUM, (2, 1)),
        ("uint32", ReduceOp.SUM, (3, 1)),
        ("int64", ReduceOp.PROD, (4, 1)),
        ("uint64", ReduceOp.MIN, (5, 1)),
        ("complex64", ReduceOp.SUM, (7, 2)),  # real and imaginary parts, summed apart
        ("complex128", ReduceOp.SUM, (8, 2)),
        ("complex64", ReduceOp.PROD, None),  # not a part-wise operation: host round trip
        ("int16", ReduceOp.SUM, None),  # NCCL has no 16-bit integers
        ("uint16", ReduceOp.MAX, None),
        ("bool", ReduceOp.MAX, None),
    ],
)
def test_nccl_reduction_table(dtype: str, op: ReduceOp, want: Any) -> None:
    assert nccl_reduction(dtype, op) == want


def test_every_supported_dtype_is_reduced_in_device_memory() -> None:
    from dataparallel.arrays.dtypes import SUPPORTED_DTYPES

    assert {"bool"} | set(NCCLBackend.device_native_dtypes) == set(SUPPORTED_DTYPES)
    assert NCCLBackend.stream_aware is True


def test_the_fallback_is_picked_as_auto_picks_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # as if MPI were not started
    # ... and torch.distributed neither (under Gloo, or alongside MPI, this pass's world has it)
    monkeypatch.setattr(registry, "_torch_distributed_initialized", lambda: False)
    assert choose("auto", None, Settings()) == "single"
    assert choose("auto", "mpi", Settings()) == "mpi"
    assert choose("auto", None, Settings(mpi_launched=True)) == "mpi"
    assert choose("auto", "tcp://127.0.0.1:29500", Settings()) == "gloo"
    assert choose("auto", "env://", Settings(mpi_launched=True)) == "gloo"
    torchrun = Settings(rank=0, world_size=2, master_addr="127.0.0.1")
    assert choose("auto", None, torchrun) == "gloo"


def test_the_fallback_is_mpi_once_mpi_is_running(world: Backend) -> None:
    if world.name != "mpi":
        pytest.skip("MPI is not running in this pass")
    assert choose("auto", None, Settings()) == "mpi"


# -- with a GPU --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_of_one() -> Any:
    """An NCCL backend over this process alone (a world of one as its fallback)."""
    if REASON is not None:
        pytest.skip(MISSING)
    device = dp.device()
    backend = NCCLBackend(SingleBackend(), device=0 if device is None else device)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def nccl_of_world(world: Backend) -> Any:
    """An NCCL backend over the whole world (one GPU per process), MPI carrying host buffers."""
    if REASON is not None:
        pytest.skip(MISSING)
    if world.name != "mpi":
        pytest.skip("needs the MPI pass (mpiexec -n 2 ... pytest) to bootstrap NCCL over MPI")
    n_gpus = world_gpus()
    if world.local_size > n_gpus:
        pytest.skip(f"NCCL needs one GPU per process: {world.local_size} ranks, {n_gpus} GPU(s)")
    from dataparallel.backends.mpi import MPIBackend

    backend = NCCLBackend(MPIBackend(), device=dp.device())
    yield backend
    backend.close()


def world_gpus() -> int:
    from dataparallel.gpus import cuda_device_count

    return cuda_device_count()


@needs_nccl
def test_nccl_takes_cuda_and_host_buffers(nccl_of_one: NCCLBackend) -> None:
    assert nccl_of_one.accepts_device("cuda:0") and nccl_of_one.accepts_device("cpu")
    assert nccl_of_one.name == "nccl" and nccl_of_one.size == 1
    host = np.arange(4.0)
    nccl_of_one.allreduce(host, ReduceOp.SUM)  # to the fallback
    np.testing.assert_array_equal(host, np.arange(4.0))


def _check_allreduce(family: Family, backend: NCCLBackend, rank: int, size: int) -> None:
    """Allreduce every dtype with every op (int16, uint16, complex products on the host path)."""
    for dtype in family.dtypes:
        for op in OPS:
            if invalid(op, dtype):
                continue
            x = family.make(rank_values(rank, dtype, (2, 3)), dtype)
            out = dp.allreduce({"x": x}, op=op, backend=backend)["x"]
            assert out is x
            assert_values(family, out, expected(op, dtype, size), dtype)


@needs_nccl
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_nccl_with_one_rank(family: Family, nccl_of_one: NCCLBackend) -> None:
    usable(family)
    _check_allreduce(family, nccl_of_one, 0, 1)
    x = family.make(np.arange(6.0), "float32")
    request = dp.iallreduce(x, scale=3.0, backend=nccl_of_one)
    np.testing.assert_allclose(family.read(request.wait()), np.arange(6.0) * 3)


@needs_nccl
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_nccl_across_the_world(
    family: Family, nccl_of_world: NCCLBackend, rank: int, size: int
) -> None:
    usable(family)
    _check_allreduce(family, nccl_of_world, rank, size)
    for root in range(size):
        x = family.make(np.full(5, float(rank)), "float64")
        np.testing.assert_array_equal(
            family.read(dp.broadcast(x, root=root, backend=nccl_of_world)), root
        )
        y = family.make(np.full(3, rank + 1), "int64")
        dp.reduce(y, root=root, backend=nccl_of_world)
        want = size * (size + 1) // 2 if rank == root else rank + 1
        np.testing.assert_array_equal(family.read(y), want)


@needs_nccl
def test_nccl_allgatherv_on_device_buffers(
    nccl_of_world: NCCLBackend, rank: int, size: int
) -> None:
    cupy = pytest.importorskip("cupy")
    counts = [r + 1 for r in range(size)]
    send = cupy.full(rank + 1, rank, dtype=cupy.int32)
    recv = cupy.empty(sum(counts), dtype=cupy.int32)
    nccl_of_world.allgatherv(send, recv, counts)
    want = np.concatenate([np.full(r + 1, r, np.int32) for r in range(size)])
    np.testing.assert_array_equal(recv.get(), want)
