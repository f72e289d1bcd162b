"""dp's collectives inside `jax.jit` (`dataparallel.jax.traced`), passing at any world size.

`pytest tests/test_jax_jit_collectives.py` runs them in a world of one (nothing is put in the
program there: the values are the result); under `mpiexec -n 3 python -m pytest ...` or
`dataparallel run -n 3 --backend gloo -m pytest ...` every rank runs them in lockstep. Every
jitted result is checked against the eager call on the same values, or against an exact
expectation. The last part is mpi4jax's own examples and tests, with the calls renamed
(`mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)` -> `dp.allreduce(x)`), checked as mpi4jax checks
them; its shallow-water example (point-to-point) is `test_jax_shallow_water.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
from _engine_calls import count_engine_calls  # noqa: E402
from _jobs import outer_world_size, run_job  # noqa: E402
from _readme import blocks  # noqa: E402

import dataparallel as dp  # noqa: E402
from dataparallel import world  # noqa: E402
from dataparallel.errors import CollectiveMismatchError  # noqa: E402
from dataparallel.jax import traced  # noqa: E402


def private() -> Any:
    """The engine the jitted calls run on: a duplicate of the world's private duplicate."""
    privates = world.current().private
    return privates(privates(dp.get_backend()))


@pytest.fixture(scope="module", params=["ffi", "callback"])
def bridge_in_force(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bridge of a run of this module's tests: pytest runs all the tests on one bridge, then
    all on the other. The bridge is chosen as a call is traced, and JAX keeps a traced program
    (by function, shapes and dtypes) across tests: its caches are cleared as a bridge's run
    begins and as the callback's ends, so that no program traced on one bridge runs on the
    other's. Clearing them for each test would also throw away every eager operation's program,
    to be compiled again."""
    jax.clear_caches()
    yield str(request.param)
    if request.param == "callback":
        jax.clear_caches()


@pytest.fixture
def bridge(bridge_in_force: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test on both bridges: the XLA FFI call, and the ordered io_callback used where it
    cannot run (JAX off the CPU, several devices per process). Only the tests that ask for a
    bridge are forced on the callback (the others in the module may run between them)."""
    if bridge_in_force == "callback":
        monkeypatch.setattr(traced, "ffi_reason", lambda: "forced by the test")
    return bridge_in_force


def on_device(value: Any) -> jax.Array:
    """`value` (NumPy) put on the device: an eager JAX operation would be a program to compile."""
    return jax.device_put(np.asarray(value))


def values(rank: int) -> dict[str, Any]:
    """A tree whose leaves differ per rank, in every dtype the jitted allreduce takes. Made by
    NumPy and put on the device (`on_device`)."""
    base = np.arange(6, dtype=np.float64).reshape(2, 3) + rank
    host = {
        "f32": (base / 4).astype(np.float32),
        "f64": base if jax.config.jax_enable_x64 else None,
        "f16": (base / 8).astype(np.float16),
        "bf16": base.astype(jnp.bfloat16),
        "i32": base.astype(np.int32) - 2,
        "u8": base.astype(np.uint8),
        "bool": base % 2 == 0,
        "scalar": np.float32(rank + 0.5),
    }
    return {key: None if v is None else jax.device_put(v) for key, v in host.items()}


def eager(tree: Any) -> Any:
    """`tree` as writable NumPy arrays (what the eager path is given to compare with)."""
    return jax.tree.map(lambda x: np.array(x), tree)


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_jitted_allreduce_equals_the_eager_one(op: str, rank: int, bridge: str) -> None:
    x = values(rank)
    if op == "prod":
        x = {k: v for k, v in x.items() if k not in ("u8", "bool", "bf16", "f16")}  # overflow
    got = jax.jit(lambda t: dp.allreduce(t, op))(x)
    want = dp.allreduce(eager(x), op)
    assert jax.tree.structure(got) == jax.tree.structure(x)
    for key, leaf in got.items():
        if leaf is None:
            continue
        assert leaf.dtype == x[key].dtype, key
        np.testing.assert_array_equal(np.asarray(leaf), want[key].astype(leaf.dtype), err_msg=key)


def test_avg_and_scale_follow_the_eager_rules(size: int, rank: int, bridge: str) -> None:
    x = on_device(np.arange(4, dtype=np.float32) * (rank + 1))
    got = jax.jit(lambda v: (dp.allreduce(v, "avg"), dp.allreduce(v, scale=0.5)))(x)
    total = np.arange(4.0) * sum(range(1, size + 1))
    np.testing.assert_allclose(np.asarray(got[0]), total / size, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), total * 0.5, rtol=1e-6)
    with pytest.raises(TypeError, match="op='avg' on int32 values would truncate"):
        jax.jit(lambda v: dp.allreduce(v, "avg"))(on_device(np.arange(3, dtype=np.int32)))


def test_jitted_reduce_gives_root_the_sum_and_the_others_their_own(
    size: int, rank: int, bridge: str
) -> None:
    root = size - 1
    x = on_device(np.full(3, rank + 1.0, np.float32))
    got = np.asarray(jax.jit(lambda v: dp.reduce(v, root=root))(x))
    want = np.full(3, size * (size + 1) / 2) if rank == root else np.full(3, rank + 1.0)
    np.testing.assert_array_equal(got, want)


def test_jitted_broadcast_gives_every_rank_roots_values(size: int, rank: int, bridge: str) -> None:
    root = size - 1
    x = values(rank)
    x["c64"] = on_device(np.asarray([1 + 2j, rank * 1j], np.complex64))
    got = jax.jit(lambda t: dp.broadcast(t, root=root))(x)
    want = values(root)
    want["c64"] = on_device(np.asarray([1 + 2j, root * 1j], np.complex64))
    for key, leaf in got.items():
        if leaf is not None:
            assert leaf.dtype == want[key].dtype
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[key]), err_msg=key)


def test_jitted_allgather_concatenates_in_rank_order(size: int, rank: int, bridge: str) -> None:
    x = {
        "rows": on_device(np.full((2, 3), rank, np.int32)),
        "n": on_device(np.float32(rank)),
        "b": on_device(np.asarray(1, jnp.bfloat16)),
    }
    got = jax.jit(dp.allgather)(x)
    want = dp.allgather(eager(x))
    assert got["rows"].shape == (2 * size, 3) and got["n"].shape == (size,)
    for key in x:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_jitted_reducescatter_splits_rows_as_the_eager_one(
    size: int, rank: int, bridge: str
) -> None:
    """Uneven rows (7 at any size, `size + 1` of ints): each rank keeps the rows the eager call
    gives it, reduced alike, for sum, avg, max and a scale; under vmap the batch rides along."""
    x = {
        "odd": on_device(np.arange(14, dtype=np.float32).reshape(7, 2) * (rank + 1)),
        "ints": on_device(np.full(size + 1, rank + 1, np.int32)),
    }
    got, want = jax.jit(dp.reducescatter)(x), dp.reducescatter(eager(x))
    for key in x:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)
    floats = {"odd": x["odd"]}
    for options in ({"op": "avg"}, {"op": "max"}, {"scale": 0.5}):
        got = jax.jit(lambda v, o=options: dp.reducescatter(v, **o))(floats)
        want = dp.reducescatter(eager(floats), **options)
        np.testing.assert_allclose(np.asarray(got["odd"]), want["odd"], err_msg=str(options))
    if bridge == "ffi" or size == 1:  # ordered io_callbacks do not batch
        batched = jax.jit(jax.vmap(dp.reducescatter, in_axes=1, out_axes=1))(x["odd"])
        columns = [dp.reducescatter(np.array(x["odd"])[:, j]) for j in range(2)]
        np.testing.assert_array_equal(np.asarray(batched), np.stack(columns, axis=1))
    with pytest.raises(ValueError, match="splits the first axis"):
        jax.jit(dp.reducescatter)(on_device(np.float32(1.0)))


def test_jitted_alltoall_sends_equal_parts(size: int, rank: int, bridge: str) -> None:
    x = on_device(np.arange(2 * size, dtype=np.float32).reshape(size, 2) + 100 * rank)
    got, splits = jax.jit(dp.alltoall)(x)
    want, want_splits = dp.alltoall(np.array(x))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert splits == want_splits == [1] * size
    with pytest.raises(ValueError, match="equal parts only"):
        jax.jit(lambda v: dp.alltoall(v, splits=[size] + [0] * (size - 1)))(x)


def test_calls_run_once_per_execution_in_program_order_unused_ones_too(
    monkeypatch: pytest.MonkeyPatch, size: int, rank: int, bridge: str
) -> None:
    if size == 1:
        pytest.skip("a world of one puts nothing in the program")
    calls = count_engine_calls(monkeypatch, private())

    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        dp.allreduce(x[:1])  # result unused: XLA must still run it, first
        y = dp.allreduce(x)
        return dp.allreduce(y[:2]) + 0 * dp.allreduce(x[:3]).sum()

    for _ in range(3):
        out = step(on_device(np.full(5, rank + 1.0, np.float32)))
    assert calls.calls == [1, 5, 2, 3] * 3
    total = size * (size + 1) / 2
    np.testing.assert_allclose(np.asarray(out), np.full(2, total * size))


def test_mismatch_is_found_when_traced_and_the_world_survives(
    monkeypatch: pytest.MonkeyPatch, size: int, rank: int, bridge: str
) -> None:
    if size == 1:
        pytest.skip("needs peers")
    with pytest.raises(
        CollectiveMismatchError, match=r"(?s)inside jax\.jit.*float32\[3\] on rank 0"
    ):
        jax.jit(dp.allreduce)(on_device(np.ones(3 + rank, np.float32)))
    with pytest.raises(CollectiveMismatchError, match="root"):
        jax.jit(lambda v: dp.broadcast(v, root=rank % 2))(on_device(np.ones(2, np.float32)))
    # The agreement is made once per traced program: its later runs make no handshake.
    step = jax.jit(lambda v: dp.allreduce(v) * 2)
    ones = on_device(np.ones(2, np.float32))
    np.testing.assert_array_equal(np.asarray(step(ones)), np.full(2, 2.0 * size))
    handshakes = count_engine_calls(monkeypatch, dp.get_backend())
    for _ in range(3):
        step(ones)
    assert handshakes.calls == []
    assert dp.allreduce(1.0) == size  # the world is usable


def test_sum_differentiates_as_mpi4jax(size: int, rank: int, bridge: str) -> None:
    if bridge == "callback" and size > 1:
        pytest.skip("the io_callback bridge has no derivative rules (only the FFI call's)")
    x = on_device(np.arange(3, dtype=np.float32) + rank)
    w = on_device(np.asarray([1.0, 2.0, 3.0], np.float32) * (rank + 1))
    # mpi4jax's rules: the transpose of a sum is the identity; an average divides by the size.
    grad = jax.jit(jax.grad(lambda v: (dp.allreduce(v) * w).sum()))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(w))
    grad = jax.jit(jax.grad(lambda v: (dp.allreduce(v, "avg") * w).sum()))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(w) / size, rtol=1e-6)
    _, tangent = jax.jvp(lambda v: dp.allreduce(v), (x,), (w,))
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(dp.allreduce(np.asarray(w))))
    if size > 1:
        with pytest.raises(TypeError, match=r"no derivative .*op='sum' or 'avg'"):
            jax.grad(lambda v: dp.allreduce(v, "max").sum())(x)
        with pytest.raises(TypeError, match=r"dp\.broadcast inside jax\.jit has no derivative"):
            jax.grad(lambda v: dp.broadcast(v).sum())(x)


def test_vmap_is_the_stack_of_the_calls(size: int, rank: int, bridge: str) -> None:
    if bridge == "callback" and size > 1:
        pytest.skip("the io_callback bridge cannot be vmapped (ordered effects do not batch)")
    x = on_device(np.arange(6, dtype=np.float32).reshape(2, 3) + rank)
    got = jax.jit(jax.vmap(dp.allreduce))(x)
    np.testing.assert_array_equal(np.asarray(got), dp.allreduce(np.array(x)))
    gathered = jax.jit(jax.vmap(dp.allgather, in_axes=1, out_axes=1))(x)
    want = np.stack([dp.allgather(np.array(x)[:, j]) for j in range(3)], axis=1)
    np.testing.assert_array_equal(np.asarray(gathered), want)


def test_other_collectives_say_what_works_inside_jit(size: int) -> None:
    with pytest.raises(TypeError, match=r"inside jax.jit use dp.allreduce, dp.reduce"):
        jax.jit(lambda v: dp.iallreduce(v).wait())(jnp.ones(size))
    with pytest.raises(TypeError, match="does not compress"):
        jax.jit(lambda v: dp.allreduce(v, compression=dp.Compression.fp16))(jnp.ones(2))


# --- mpi4jax's own examples, the calls renamed --------------------------------------------------


def test_mpi4jax_readme_global_sum(size: int, rank: int) -> None:
    # mpi4jax's README and docs/usage.rst "Global sum", as written there but for the call
    # (`arr_sum, _ = mpi4jax.allreduce(arr, op=MPI.SUM, comm=comm)`; recent mpi4jax returns the
    # array alone, as dp does).
    @jax.jit
    def foo(arr: jax.Array) -> jax.Array:
        arr = arr + rank
        arr_sum = dp.allreduce(arr, op="sum")
        return arr_sum

    a = jnp.zeros((3, 3))
    result = foo(a)
    # "The result is an array full of the value 6 [on 4 processes]": sum of the ranks.
    np.testing.assert_array_equal(np.asarray(result), np.full((3, 3), size * (size - 1) / 2))


def test_mpi4jax_tests_allreduce(size: int) -> None:
    # tests/collective_ops/test_allreduce.py: the jit, scalar, vmap, transpose and grad cases.
    arr = jnp.ones((3, 2))
    _arr = arr.copy()
    res = jax.jit(lambda x: dp.allreduce(x, op="sum"))(arr)
    assert jnp.array_equal(res, arr * size)
    assert jnp.array_equal(_arr, arr)
    res = jax.jit(lambda x: dp.allreduce(x, op="sum"))(1)
    assert jnp.array_equal(res, 1 * size)
    res = jax.jit(jax.vmap(lambda x: dp.allreduce(x, op="sum"), in_axes=0, out_axes=0))(arr)
    assert jnp.array_equal(res, arr * size)
    (res,) = jax.linear_transpose(lambda x: dp.allreduce(x, op="sum"), arr)(_arr)
    assert jnp.array_equal(_arr, res)

    def lt(y: jax.Array) -> jax.Array:
        return jax.linear_transpose(lambda x: dp.allreduce(x, op="sum"), arr)(y)[0]

    (res,) = jax.jit(lambda x: jax.linear_transpose(lt, _arr)(x))(_arr)
    assert jnp.array_equal(dp.allreduce(np.array(_arr), op="sum"), res)
    res, grad = jax.value_and_grad(lambda x: dp.allreduce(x, op="sum").sum())(arr)
    assert jnp.array_equal(res, arr.sum() * size)
    assert jnp.array_equal(_arr, grad)


def test_mpi4jax_tests_bcast_and_allgather(size: int, rank: int) -> None:
    # tests/collective_ops/test_bcast.py and test_allgather.py, jitted. mpi4jax's allgather
    # stacks (`res[p]` is rank p's array); dp's concatenates along the first axis, so the port
    # gives each rank's array a leading axis of one (`arr[None]`), as the docs page says.
    arr = jnp.ones((3, 2))
    _arr = arr.copy()
    if rank != 0:
        _arr = _arr * 0
    res = jax.jit(lambda x: dp.broadcast(x, root=0))(_arr)
    assert jnp.array_equal(res, arr)
    arr = jnp.ones((3, 2)) * rank
    res = jax.jit(lambda x: dp.allgather(x[None]))(arr)
    for p in range(size):
        assert jnp.array_equal(res[p], jnp.ones((3, 2)) * p)


def test_barrier_is_traced_and_runs_each_time(
    monkeypatch: pytest.MonkeyPatch, size: int, bridge: str
) -> None:
    if size == 1:
        pytest.skip("a world of one puts nothing in the program")
    engine = private()
    barriers: list[int] = []
    real = engine.barrier

    def counted() -> None:
        barriers.append(1)
        real()

    monkeypatch.setattr(engine, "barrier", counted)

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        dp.barrier()
        return x + 1

    for _ in range(3):
        f(on_device(np.ones(2, np.float32))).block_until_ready()
    assert len(barriers) == 3


# --- The docs page for mpi4jax's users runs as written ------------------------------------------

PAGE = Path(__file__).parent.parent / "docs" / "migrate" / "mpi4jax.md"


@pytest.mark.spawns
@pytest.mark.skipif(outer_world_size() > 1, reason="launches its own jobs: run in a world of one")
def test_the_mpi4jax_page_runs_as_written_on_gloo() -> None:
    """On Gloo at 2 ranks; in a world of one and on MPI at 3 ranks it runs in the jobs that run
    the README's blocks (`test_readme.py`)."""
    target = [Path(__file__).parent / "_readme.py", PAGE]
    job = run_job(target, ranks=2, backend="gloo", timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    found = blocks(PAGE.read_text(encoding="utf-8"))
    assert len(found) == 4
    # Gloo jobs prefix each line with its rank ("[rank 0] "): the verdicts are read past it.
    lines = job.stdout.splitlines()
    verdicts = [line[line.index("mpi4jax.md ") :] for line in lines if "mpi4jax.md block" in line]
    assert verdicts == [
        f"mpi4jax.md block {k} (line {b.line}): ok" for k, b in enumerate(found, 1)
    ], job.stdout + job.stderr
