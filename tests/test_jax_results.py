"""Where the results of an eager reduction of JAX arrays live (issue 20): in host buffers lent by
the world's pool (`BufferPool.lend`), adopted by JAX without a copy, and lent again only once no
array uses them: a loop that drops its results writes into the same memory call after call, a
result that is kept is never written again, and `dp.finalize()` drops the pool with the world.

Every test runs at any world size: "whole" plans on several ranks, `Fusion` on one.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

import dataparallel as dp
from dataparallel import world as world_module
from dataparallel.backends.base import Backend

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def grads(rank: int, step: int) -> dict[str, Any]:
    """Two leaves over the "packed" limit (one buffer of their own on several ranks), one small."""
    v = float(rank + 1 + step)
    host = {"w": np.full((300, 1000), v), "v": np.full((1000, 300), -v), "b": np.full(16, v)}
    return jax.device_put({k: x.astype(np.float32) for k, x in host.items()})  # no program


def summed(size: int, step: int) -> float:
    return sum(float(r + 1 + step) for r in range(size))


def check(out: Any, size: int, step: int) -> None:
    want = summed(size, step)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full((300, 1000), want, np.float32))
    np.testing.assert_array_equal(np.asarray(out["v"]), np.full((1000, 300), -want, np.float32))
    np.testing.assert_array_equal(np.asarray(out["b"]), np.full(16, want, np.float32))


@pytest.mark.parametrize("reduce", ["allreduce", "allreduce_gradients"])
def test_results_dropped_before_the_next_call_come_back_in_the_same_memory(
    world: Backend, rank: int, size: int, reduce: str
) -> None:
    """The steady state of a training loop: each call's results are dropped before the next
    call, so every call writes into the memory of the one before. JAX releases the memory of an
    array it adopted only at its next garbage collection, which the reduction runs first: here
    nothing else calls JAX between the calls (the same tree each time), so without that the
    results would alternate between two buffers. Gloo's worker thread lets go of a call's
    tensors (over the buffer) a moment after the call returns: two buffers in turn there."""
    lent = ("w", "v", "b") if size > 1 else ("w", "v")  # one rank: `Fusion` packs "b", copied
    tree = grads(rank, 0)
    where: set[tuple[int, ...]] = set()
    for _ in range(4):
        if reduce == "allreduce":
            out = dp.allreduce(tree)
        else:
            out = dp.allreduce_gradients(tree, op="sum")
        check(out, size, 0)
        where.add(tuple(out[k].unsafe_buffer_pointer() for k in lent))
        del out
    assert len(where) <= (2 if world.name == "gloo" else 1), where


def test_results_that_are_kept_are_never_written_again(rank: int, size: int) -> None:
    """Kept results (the JAX arrays, or only NumPy views of them) keep their memory: later calls
    of the same tree write elsewhere, and every kept value is still right at the end."""
    kept: list[Any] = []
    views: list[np.ndarray] = []
    for step in range(4):
        kept.append(dp.allreduce(grads(rank, step)))
        views.append(np.asarray(dp.allreduce(grads(rank, 100 + step))["w"]))  # the array dropped
    for step, out in enumerate(kept):
        check(out, size, step)
    for step, view in enumerate(views):
        np.testing.assert_array_equal(view, np.full((300, 1000), summed(size, 100 + step)))
    pointers = [out["w"].unsafe_buffer_pointer() for out in kept]
    pointers += [view.ctypes.data for view in views]
    assert len(set(pointers)) == len(pointers)


def test_a_result_still_read_by_a_jax_computation_is_not_written(rank: int, size: int) -> None:
    """A computation dispatched on a result (JAX runs it asynchronously) holds its memory: the
    result dropped right after, the next call writes elsewhere until the computation is done."""
    tree = grads(rank, 0)
    other = grads(rank, 50)

    @jax.jit
    def reads(w: Any) -> Any:
        for _ in range(8):
            w = jnp.tanh(w @ w.T @ w * 1e-6)
        return w

    out = dp.allreduce(tree)
    want = np.asarray(reads(jnp.array(np.asarray(out["w"]))))  # a copy of its own, computed
    pending = reads(out["w"])
    del out
    again = dp.allreduce(other)  # the same tree's shapes: the pool's buffer is asked for
    check(again, size, 50)
    np.testing.assert_array_equal(np.asarray(pending), want)


@pytest.fixture
def no_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the session's world for the test (restored afterwards)."""
    monkeypatch.setattr(world_module, "_world", None)


def test_finalize_drops_the_pool_and_kept_results_stay(no_world: None) -> None:
    """The lent buffers hang on the world: `dp.finalize()` lets them go, except the memory of a
    result still in use, which lives as long as its array."""
    dp.initialize("single")
    try:
        kept = dp.allreduce(grads(0, 0))
        dropped = dp.allreduce(grads(0, 1))
        pool = world_module.current().buffers
        assert any(pool._lent.values())  # the results' memory came from the pool
        gone = weakref.ref(pool)
        del pool, dropped
    finally:
        dp.finalize()
    gc.collect()
    assert gone() is None
    check(kept, 1, 0)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_values_of_a_large_tree_of_any_values(rank: int, size: int, op: str) -> None:
    """Random values, each rank's own: the results match the sum (or mean) of every rank's
    values in float64, the average's shares scaled as they are written into place (2, 4, ...
    ranks) or the result scaled (other sizes)."""

    def values(r: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(r)
        shapes = {"w": (400, 700), "v": (700, 400), "b": (33,)}
        return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}

    out = dp.allreduce({k: jnp.asarray(v) for k, v in values(rank).items()}, op=op)
    every = [values(r) for r in range(size)]
    for key, got in out.items():
        want = np.sum([v[key].astype(np.float64) for v in every], axis=0)
        if op == "avg":
            want /= size
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
