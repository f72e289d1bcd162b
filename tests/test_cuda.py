"""The device path of `Fusion`, CUDA-aware MPI and GPU assignment, at any world size.

Three kinds of test live here.

- Device buckets on CPU memory (run everywhere). `devices.py` works on torch tensors through
  torch's own operations, which behave the same on every device. The `cpu_as_device` fixture
  routes torch CPU tensors through that real path (`TorchFamily.work` returns a `DeviceWork` for
  them, as it does for CUDA tensors), and `Handing` wraps the world's backend to answer
  `accepts_device` as a test wants and to record what it is handed, so both ways a device bucket
  can travel (handed over as a tensor, or staged through a host buffer) run with real
  communication under MPI. Not exercised here: pinned host memory and stream synchronization,
  whose branches need CUDA tensors.
- Real GPU tests (torch CUDA tensors and CuPy arrays), skipped with the reason when no CUDA device
  is visible. See docs/gpu.md for the commands to run them on a GPU machine.
- CUDA-aware MPI detection, its override, and GPU assignment: logic that needs no GPU.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from _families import (
    DTYPES,
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
from dataparallel import gpus, world
from dataparallel.arrays import families
from dataparallel.arrays.device import DeviceWork
from dataparallel.arrays.family_torch import TorchFamily
from dataparallel.backends.base import Backend, DeviceBuffer, Handle, ReduceOp
from dataparallel.backends.single import SingleBackend
from dataparallel.config import Settings

N_GPUS = world.cuda_device_count()
GPU_FAMILIES = [pytest.param(FAMILY[name], id=name) for name in ("torch-cuda", "cupy")]


class Handing(Backend):
    """The world's backend, answering `accepts_device` with `accepts`; records what it is handed."""

    name = "handing"

    def __init__(self, inner: Backend, accepts: bool) -> None:
        self.inner, self.accepts = inner, accepts
        self.rank, self.size = inner.rank, inner.size
        self.local_rank, self.local_size = inner.local_rank, inner.local_size
        self.handed: list[Any] = []

    @property  # type: ignore[misc]
    def native_dtypes(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.native_dtypes

    @classmethod
    def create(cls, **kwargs: Any) -> Backend:
        raise NotImplementedError

    def accepts_device(self, device: str) -> bool:
        return self.accepts

    def tensors(self) -> list[Any]:
        """Return the device buffers (torch or CuPy, not NumPy) this backend was handed."""
        return [b for b in self.handed if not isinstance(b, np.ndarray)]

    def _take(self, buf: Any) -> Any:
        """Record what was handed over; a device buffer must come framework-free."""
        assert isinstance(buf, (np.ndarray, DeviceBuffer)), type(buf)
        # CPU memory stands in for a GPU's here: the inner engine gets the owning tensor.
        array = buf.owner if isinstance(buf, DeviceBuffer) else buf
        self.handed.append(array)
        return array

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        self.inner.allreduce(self._take(buf), op)

    def iallreduce(self, buf: Any, op: ReduceOp) -> Handle:
        return self.inner.iallreduce(self._take(buf), op)

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> None:
        self.inner.reduce(self._take(buf), op, root)

    def broadcast(self, buf: Any, root: int) -> None:
        self.inner.broadcast(self._take(buf), root)

    def ibroadcast(self, buf: Any, root: int) -> Handle:
        return self.inner.ibroadcast(self._take(buf), root)

    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        self.inner.allgatherv(send, recv, counts)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self.inner.broadcast_object(obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def barrier(self) -> None:
        self.inner.barrier()

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)


@pytest.fixture
def cpu_as_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every torch tensor down the device path, CPU memory standing in for a GPU's."""

    def work(self: TorchFamily, x: Any) -> tuple[Any, bool]:
        return DeviceWork(self, x), True

    monkeypatch.setattr(TorchFamily, "work", work)


def make(family: Family, values: np.ndarray, dtype: str) -> Any:
    return family.make(np.array(values), dtype)


def check(family: Family, out: Any, before: Any, want: np.ndarray, dtype: str) -> None:
    """Check a leaf written in place with values `want` (exact for integers and bool)."""
    assert out is before, "device leaves must be written in place and returned"
    assert_values(family, out, want, dtype)


def tree_of(family: Family, rank: int, dtype: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Return a tree of four leaves of rank `rank` (one non-contiguous, one 0-d) and the shapes'
    value makers, so that the expected results can be computed for any op."""
    tree = {
        "a": make(family, rank_values(rank, dtype, (2, 3)), dtype),
        "b": make(family, rank_values(rank, dtype, (5,)), dtype),
        "c": make(family, rank_values(rank, dtype, (3, 2)), dtype).T,  # not contiguous
        "d": make(family, rank_values(rank, dtype, ()), dtype),
    }
    shapes = {"a": (2, 3), "b": (5,), "c": (3, 2), "d": ()}
    return tree, shapes


def want_of(key: str, shape: tuple[int, ...], op: str, dtype: str, size: int) -> np.ndarray:
    want = expected(op, dtype, size, shape)
    return want.T if key == "c" else want


def run_reduction(
    family: Family, backend: Backend | None, dtype: str, op: str, rank: int, size: int
) -> None:
    tree, shapes = tree_of(family, rank, dtype)
    if invalid(op, dtype):
        with pytest.raises(TypeError, match=rf"^x\['a'\]: op='{op}' "):
            dp.allreduce(tree, op=op, backend=backend)
        return
    out = dp.allreduce(tree, op=op, backend=backend)
    for key, shape in shapes.items():
        check(family, out[key], tree[key], want_of(key, shape, op, dtype, size), dtype)


# -- device buckets, with CPU memory standing in for device memory ------------------------------

TORCH = FAMILY["torch"]
PATHS = ("handed", "staged")


@pytest.mark.matrix
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_buckets_reduce_every_dtype_and_op(
    cpu_as_device: None, world: Backend, rank: int, size: int, dtype: str, op: str, path: str
) -> None:
    backend = Handing(world, accepts=path == "handed")
    run_reduction(TORCH, backend, dtype, op, rank, size)
    if invalid(op, dtype):
        return
    # Host arrays handed over are only the mismatch check's 16 bytes, when the world has peers.
    hosts = [b for b in backend.handed if isinstance(b, np.ndarray)]
    if path == "handed":
        assert [t.numel() for t in backend.tensors()] == [18], "one device buffer, 4 leaves"
        assert all(h.dtype == np.int64 and h.size == 2 for h in hosts)
    else:
        assert backend.tensors() == [], "a staged bucket must reach the backend as a host array"
        assert any(h.size == 6 + 5 + 6 + 1 for h in hosts), "one host buffer for the bucket"


@pytest.mark.parametrize("path", PATHS)
def test_a_bucket_of_leaves_is_packed_into_one_buffer_per_dtype(
    cpu_as_device: None, world: Backend, rank: int, size: int, path: str
) -> None:
    backend = Handing(world, accepts=path == "handed")
    singles = [torch.full((n,), float(rank + 1)) for n in (3, 5, 7, 11)]
    double = torch.full((4,), float(rank + 1), dtype=torch.float64)
    with dp.CoalescingReducer(scale=0.5, backend=backend) as reducer:
        for leaf in [*singles, double]:
            reducer.add(leaf)
    assert reducer.calls == 2  # one float32 bucket, one float64 bucket
    handed = sorted(int(np.prod(tuple(b.shape))) for b in backend.handed)
    assert handed == [4, 26]
    total = size * (size + 1) / 2 * 0.5
    for leaf in [*singles, double]:
        assert torch.all(leaf == total), leaf


def test_a_single_contiguous_leaf_is_handed_over_in_place(
    cpu_as_device: None, world: Backend, rank: int, size: int
) -> None:
    backend = Handing(world, accepts=True)
    x = torch.full((1000,), float(rank + 1))
    assert dp.allreduce(x, backend=backend) is x
    (handed,) = backend.tensors()
    assert handed.data_ptr() == x.data_ptr(), "no device copy for one contiguous leaf"
    assert torch.all(x == size * (size + 1) / 2)


def test_bfloat16_is_widened_on_the_device_for_an_engine_without_it(
    cpu_as_device: None, world: Backend, rank: int, size: int
) -> None:
    backend = Handing(world, accepts=True)
    x = torch.full((6,), 0.1 * (rank + 1), dtype=torch.bfloat16)
    dp.allreduce(x, op="avg", backend=backend)
    (handed,) = backend.tensors()
    assert handed.dtype == (torch.bfloat16 if "bfloat16" in world.native_dtypes else torch.float32)
    want = torch.tensor([0.1 * (r + 1) for r in range(size)], dtype=torch.bfloat16).float().mean()
    torch.testing.assert_close(x.float(), want.expand(6), rtol=1e-2, atol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "int16", "complex128"])
def test_device_buckets_broadcast_from_every_root(
    cpu_as_device: None, world: Backend, rank: int, size: int, dtype: str, path: str
) -> None:
    for root in range(size):
        backend = Handing(world, accepts=path == "handed")
        tree, shapes = tree_of(TORCH, rank, dtype)
        out = dp.broadcast(tree, root=root, backend=backend)
        for key, shape in shapes.items():
            want = rank_values(root, dtype, shape)
            if dtype == "bfloat16":  # root's values, as rounded to bfloat16
                want = torch.from_numpy(np.array(want)).to(torch.bfloat16).float().numpy()
            check(TORCH, out[key], tree[key], want.T if key == "c" else want, dtype)
        if path == "handed":
            assert all(t.dtype == torch.uint8 for t in backend.tensors()), "broadcast as bytes"


@pytest.mark.parametrize("path", PATHS)
def test_device_buckets_reduce_to_root_only(
    cpu_as_device: None, world: Backend, rank: int, size: int, path: str
) -> None:
    for root in range(size):
        backend = Handing(world, accepts=path == "handed")
        x = torch.full((2, 3), float(rank + 1)).T
        y = torch.full((4,), rank + 1, dtype=torch.int32)
        out = dp.reduce({"x": x, "y": y}, op="sum", root=root, scale=2, backend=backend)
        assert out["x"] is x and out["y"] is y
        total = size * (size + 1) if rank == root else rank + 1  # sum * 2 at root only
        assert torch.all(x == total) and torch.all(y == int(total)), (rank, root, x, y)


@pytest.mark.parametrize("path", PATHS)
def test_device_buckets_in_non_blocking_calls(
    cpu_as_device: None, world: Backend, rank: int, size: int, path: str
) -> None:
    backend = Handing(world, accepts=path == "handed")
    xs = [torch.full((n,), float(rank + 1)) for n in (2, 3)]
    request = dp.iallreduce(xs, op="avg", backend=backend)
    bs = dp.ibroadcast(torch.full((3,), rank, dtype=torch.int64), root=size - 1, backend=backend)
    out = request.wait()
    assert out[0] is xs[0] and out[1] is xs[1]
    for x in xs:
        assert torch.all(x == (size + 1) / 2)
    assert torch.all(bs.wait() == size - 1)


def test_allgather_reads_device_leaves_through_a_host_copy(
    cpu_as_device: None, world: Backend, rank: int, size: int
) -> None:
    x = torch.full((rank + 1, 2), rank, dtype=torch.int16)
    out = dp.allgather(x, backend=Handing(world, accepts=True))
    want = np.concatenate([np.full((r + 1, 2), r, np.int16) for r in range(size)])
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), want)


def test_device_work_stands_for_its_leaf() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    work = DeviceWork(families.family_of(x), x)
    assert (work.size, work.nbytes, work.device) == (6, 24, "cpu")
    np.testing.assert_array_equal(np.asarray(work), x.numpy())
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    assert np.asarray(DeviceWork(families.family_of(bf16), bf16)).dtype == np.uint16  # its bits


def test_host_leaves_never_take_the_device_path(world: Backend, rank: int) -> None:
    x = torch.ones(3)
    work, is_view = families.family_of(x).work(x)
    assert isinstance(work, np.ndarray) and is_view
    conjugate = torch.ones(2, dtype=torch.complex64).conj()  # no host view: a host copy
    work, is_view = families.family_of(conjugate).work(conjugate)
    assert isinstance(work, np.ndarray) and not is_view


# -- real GPUs ---------------------------------------------------------------------------------


def gpu_backend(path: str, world: Backend) -> Backend | None:
    """Return the backend for `path`: the world's own, or one forced to stage, or to hand over."""
    if path == "world":
        return None
    if path == "direct" and not world.accepts_device("cuda:0"):
        pytest.skip(f"the world's {world.name} backend does not take CUDA buffers (not CUDA-aware)")
    return Handing(world, accepts=path == "direct")


@pytest.mark.parametrize("path", ["world", "staged", "direct"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_allreduce_every_dtype(
    family: Family, op: str, path: str, world: Backend, rank: int, size: int
) -> None:
    usable(family)
    backend = gpu_backend(path, world)
    for dtype in family.dtypes:
        run_reduction(family, backend, dtype, op, rank, size)


@pytest.mark.parametrize("path", ["world", "staged", "direct"])
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_broadcast_and_fused_reducer(
    family: Family, path: str, world: Backend, rank: int, size: int
) -> None:
    usable(family)
    backend = gpu_backend(path, world)
    for dtype in ("float32", "bool", "int64"):
        tree, shapes = tree_of(family, rank, dtype)
        out = dp.broadcast(tree, root=size - 1, backend=backend)
        for key, shape in shapes.items():
            want = rank_values(size - 1, dtype, shape)
            check(family, out[key], tree[key], want.T if key == "c" else want, dtype)
    leaves = [make(family, np.full(n, rank + 1.0), "float32") for n in (3, 5, 7)]
    with dp.CoalescingReducer(backend=backend) as reducer:
        for leaf in leaves:
            reducer.add(leaf)
    assert reducer.calls == 1
    for leaf in leaves:
        np.testing.assert_allclose(family.read(leaf), size * (size + 1) / 2)


def test_gpu_values_made_on_a_side_stream_are_complete_before_they_travel(
    world: Backend, rank: int, size: int
) -> None:
    usable(FAMILY["torch-cuda"])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 22, device="cuda")
        for _ in range(50):  # a queue of kernels still running when allreduce is called
            x.add_(rank + 1)
        dp.allreduce(x)
        total = x.sum()
    torch.cuda.synchronize()
    assert total.item() == pytest.approx((1 << 22) * 50 * size * (size + 1) / 2, rel=1e-5)


def test_gpu_assignment_is_round_robin_by_local_rank(world: Backend) -> None:
    if N_GPUS == 0:
        pytest.skip("no CUDA device is visible (the CUDA driver counts none)")
    assert dp.device() == world.local_rank % N_GPUS  # ranks beyond the GPU count share GPUs
    if torch.cuda.is_available():
        assert torch.cuda.current_device() == dp.device()


# -- GPU assignment logic ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_rank", "n_gpus", "gpu_devices", "want"),
    [
        (0, 4, None, 0),
        (5, 4, None, 1),  # round robin: ranks share GPUs
        (1, 2, None, 1),
        (1, 4, [3, 2], 2),
        (0, 0, None, None),
        (1, 0, [0, 1], None),  # no GPU visible: gpu_devices does not matter
    ],
)
def test_choose_device(local_rank: int, n_gpus: int, gpu_devices: Any, want: Any) -> None:
    assert world.choose_device(local_rank, n_gpus, gpu_devices) == want


def test_choose_device_rejects_a_short_list_or_an_invisible_gpu() -> None:
    with pytest.raises(ValueError, match=r"names 1 GPUs, but this node runs local rank 1"):
        world.choose_device(1, 2, [0])
    with pytest.raises(ValueError, match=r"gpu_devices\[0\]=2, but this process sees 2 GPU"):
        world.choose_device(0, 2, [2, 0])


def test_cuda_device_count_agrees_with_torch() -> None:
    assert N_GPUS >= 0
    if torch.cuda.is_available():
        assert torch.cuda.device_count() == N_GPUS
    elif "+cpu" in torch.__version__:
        assert torch.cuda.device_count() == 0


def test_frameworks_are_pointed_at_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def use(self) -> None:
            used.append(self.index)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    set_to: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    gpus.point_frameworks_at(1)
    assert used == [1]
    assert set_to == ([1] if torch.cuda.is_available() else [])  # a CPU torch is left alone


@pytest.mark.spawns
def test_initialize_with_gpu_devices_in_a_fresh_process() -> None:
    code = (
        "import dataparallel as dp\n"
        "dp.initialize('single', gpu_devices=[0])\n"
        "print('device', dp.device())\n"
    )
    done = run_job(["-c", code], launcher="python")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"device {0 if N_GPUS else None}"


# -- CUDA-aware MPI ----------------------------------------------------------------------------


@pytest.fixture
def mpi() -> Any:
    from dataparallel.backends.mpi import import_mpi

    return import_mpi()


def test_detection_asks_the_mpi_library_itself(mpi: Any) -> None:
    from dataparallel.backends.mpi_library import detect_cuda_aware, mpix_query

    query = mpix_query(mpi)
    version = mpi.Get_library_version()
    if "MPICH" in version or "Open MPI" in version:
        assert query is not None, "MPICH 4+ and Open MPI export MPIX_Query_cuda_support"
    detected = detect_cuda_aware(mpi)
    assert isinstance(detected, bool)
    if query is not None:
        assert detected == bool(query())
    if N_GPUS == 0:
        assert detected is False  # no GPU here, so no library can be CUDA-aware


def test_detection_prefers_mpi4py_then_version_hints() -> None:
    from dataparallel.backends.mpi import detect_cuda_aware

    # A future mpi4py with MPI.Query_cuda_support: asked first.
    assert detect_cuda_aware(types.SimpleNamespace(Query_cuda_support=lambda: 1)) is True
    assert detect_cuda_aware(types.SimpleNamespace(Query_cuda_support=lambda: 0)) is False
    # No query at all (no __file__ to look the MPIX function up in): the version string decides.
    gdr = types.SimpleNamespace(Get_library_version=lambda: "MVAPICH2-GDR Version 2.3.7")
    plain = types.SimpleNamespace(Get_library_version=lambda: "MPICH Version: 5.0.2")
    assert detect_cuda_aware(gdr) is True
    assert detect_cuda_aware(plain) is False


@pytest.mark.parametrize(("value", "want"), [("1", True), ("0", False), ("yes", True)])
def test_the_environment_overrides_detection(
    monkeypatch: pytest.MonkeyPatch, value: str, want: bool
) -> None:
    from dataparallel.backends.mpi import MPIBackend

    monkeypatch.setenv("DATAPARALLEL_CUDA_AWARE_MPI", value)
    assert Settings.from_env().cuda_aware_mpi is want
    backend = MPIBackend()
    try:
        assert backend.cuda_aware is want
        assert backend.accepts_device("cuda:0") is want
        assert backend.accepts_device("cuda:3") is want
        assert backend.accepts_device("cpu") is True
    finally:
        backend.close()


def test_without_override_the_detection_decides(monkeypatch: pytest.MonkeyPatch, mpi: Any) -> None:
    from dataparallel.backends.mpi import MPIBackend, detect_cuda_aware

    monkeypatch.delenv("DATAPARALLEL_CUDA_AWARE_MPI", raising=False)
    for settings in (None, Settings(cuda_aware_mpi=None)):
        backend = MPIBackend.create(settings=settings)
        try:
            assert backend.cuda_aware is detect_cuda_aware(mpi)
        finally:
            backend.close()
    backend = MPIBackend.create(settings=Settings(cuda_aware_mpi=True))
    try:
        assert backend.accepts_device("cuda:1") is True
    finally:
        backend.close()


def test_a_bad_override_names_the_valid_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPARALLEL_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(
        ValueError, match=r"DATAPARALLEL_CUDA_AWARE_MPI='maybe' is not a valid flag"
    ):
        Settings.from_env()


def test_a_world_of_one_takes_any_device() -> None:
    assert SingleBackend().accepts_device("cuda:0") is True
