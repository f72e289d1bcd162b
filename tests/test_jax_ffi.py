"""The XLA FFI call into Python (`dataparallel.jax._ffi`), on its own: buffers, errors, order.

Each rank runs these alone (no engine): what the handler is given and what XLA gets back. The
reductions through it, across ranks, are tests/test_optax.py's (route "ffi"); the last test runs
a jitted step in two jobs in turn, to find its program in JAX's persistent compilation cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _jobs import run_job

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from dataparallel import caches  # noqa: E402
from dataparallel.jax import _ffi  # noqa: E402
from dataparallel.jax._ffi import ffi_reason, reduce_ffi  # noqa: E402

pytestmark = pytest.mark.skipif(ffi_reason() is not None, reason=str(ffi_reason()))
SCRIPTS = Path(__file__).parent / "scripts"


def test_the_handler_reads_and_writes_xlas_buffers() -> None:
    seen: list[tuple[tuple[int, ...], str, bool]] = []

    def double(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        for s, r in zip(sent, received, strict=True):
            seen.append((s.shape, str(s.dtype), s.ctypes.data == r.ctypes.data))
            np.multiply(s, 2, out=r)

    @jax.jit
    def f(x: jax.Array, n: jax.Array) -> list[jax.Array]:
        packed = jnp.concatenate([x, x + 1])  # made here: aliased, reduced in place
        return reduce_ffi([packed, n.reshape(-1)], double, [True, False], key="double")

    x, n = jnp.arange(4.0, dtype=jnp.float32), jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = f(x, n)
    np.testing.assert_array_equal(out[0], 2 * np.concatenate([np.arange(4.0), np.arange(4.0) + 1]))
    np.testing.assert_array_equal(out[1], 2 * np.arange(6))
    assert seen == [((8,), "float32", True), ((6,), "int32", False)]
    np.testing.assert_array_equal(n, np.arange(6).reshape(2, 3))  # the argument is not written


def test_an_exception_in_the_handler_is_raised_by_jax_with_its_message() -> None:
    def refuse(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        if sent[0][0] < 0:
            raise ValueError("a negative first item")
        received[0][...] = sent[0]

    f = jax.jit(lambda x: reduce_ffi([x * 1.0], refuse, [True], key="refuse")[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="ValueError: a negative first item"):
        jax.block_until_ready(f(-jnp.ones(3)))
    np.testing.assert_array_equal(f(jnp.ones(3)), np.ones(3))  # the process goes on


def test_calls_run_once_each_in_program_order() -> None:
    """Steps dispatched without waiting run their calls in the order they were dispatched (the
    ordered effect), once per execution, inside loops too."""
    order: list[float] = []

    def record(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        order.append(float(sent[0][0]))
        received[0][...] = sent[0]

    def make(k: float) -> object:
        @jax.jit
        def step(x: jax.Array) -> jax.Array:
            heavy = jnp.tanh(x @ x.T).sum() * 0  # work before the call, longer for some
            return reduce_ffi([jnp.full(1, k) + heavy], record, [True], key=f"record {k}")[0]

        return step

    small, large = jnp.ones((4, 4)), jnp.ones((300, 300))
    first, second = make(1.0), make(2.0)
    jax.block_until_ready((first(large), second(small)))
    order.clear()
    results = [first(large), second(small), first(large), second(small)]
    jax.block_until_ready(results)
    assert order == [1.0, 2.0, 1.0, 2.0]

    order.clear()

    @jax.jit
    def loop(x: jax.Array) -> jax.Array:
        def body(i: jax.Array, acc: jax.Array) -> jax.Array:
            return acc + reduce_ffi([jnp.full(1, 1.0) * i], record, [True], key="loop")[0]

        return jax.lax.fori_loop(0, 5, body, x)

    np.testing.assert_array_equal(loop(jnp.zeros(1)), np.full(1, 10.0))
    assert order == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_retracing_a_step_reuses_its_slot() -> None:
    """Tracing the same step again (a new jax.jit of it) keeps one table entry per step key, and
    the compiled steps of both traces call the latest reduction."""
    calls: list[str] = []

    def traced(tag: str) -> object:
        def copy(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
            calls.append(tag)
            received[0][...] = sent[0]

        return jax.jit(lambda x: reduce_ffi([x + 0.0], copy, [True], key="retraced")[0])

    first = traced("first")
    np.testing.assert_array_equal(first(jnp.ones(2)), np.ones(2))
    entries = len(_ffi._steps)
    for tag in ("second", "third"):
        np.testing.assert_array_equal(traced(tag)(jnp.ones(2)), np.ones(2))
    assert len(_ffi._steps) == entries
    np.testing.assert_array_equal(first(jnp.ones(2)), np.ones(2))
    assert calls == ["first", "second", "third", "third"]
    other = jax.jit(lambda x: reduce_ffi([x + 0.0], lambda s, r: None, [True], key="another")[0])
    jax.block_until_ready(other(jnp.ones(2)))
    assert len(_ffi._steps) == entries + 1


def test_a_step_whose_reduction_was_dropped_says_to_trace_it_again() -> None:
    """dp.finalize() empties the table (registered with `caches`); a step compiled before
    raises with the fix instead of calling into a world that has ended."""
    assert _ffi._forget_steps in caches.registered()

    def copy(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
        received[0][...] = sent[0]

    f = jax.jit(lambda x: reduce_ffi([x + 0.0], copy, [True], key="dropped")[0])
    np.testing.assert_array_equal(f(jnp.ones(2)), np.ones(2))
    del _ffi._steps[_ffi._slot_of["dropped", None]]  # as finalize() drops every step's
    with pytest.raises(jax.errors.JaxRuntimeError, match="trace the step again in this world"):
        jax.block_until_ready(f(jnp.ones(2)))


def test_steps_that_share_a_key_or_its_hash_keep_their_own_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slot is a hash of the step's key, the same in every process; two steps of one
    process never share one: not two of equal key on two engines (`within`), nor two whose
    keys hash alike (every hash made equal here). Each program calls its own reduction."""
    monkeypatch.setattr(_ffi, "digest", lambda key: 12345)

    def adding(k: float) -> _ffi.Reduce:
        def add(sent: list[np.ndarray], received: list[np.ndarray]) -> None:
            received[0][...] = sent[0] + k

        return add

    steps = [("shared", 1, 1.0), ("shared", 2, 2.0), ("hashed alike", None, 3.0)]
    jitted = [
        jax.jit(
            lambda x, k=k, w=w, a=a: reduce_ffi([x + 0.0], adding(a), [True], key=k, within=w)[0]
        )
        for k, w, a in steps
    ]
    for f, (_, _, a) in zip(jitted, steps, strict=True):
        np.testing.assert_array_equal(f(jnp.zeros(2)), np.full(2, a))
    slots = [_ffi._slot_of[k, w] for k, w, _ in steps]
    assert slots == [12345, 12346, 12347]
    for f, (_, _, a) in zip(jitted, steps, strict=True):  # compiled: the slots still hold
        np.testing.assert_array_equal(f(jnp.ones(2)), np.full(2, 1 + a))


@pytest.mark.spawns
def test_a_jitted_step_is_found_in_the_persistent_cache_by_the_next_job(tmp_path: Path) -> None:
    """A jitted step (a DistributedOptimizer update and a dp.allreduce, both through the FFI
    call) compiled by a job is read from JAX's persistent compilation cache by the next job on
    the same cache folder, on every rank, although the first job traced another step before it
    (a slot counted in tracing order would differ): JAX counts a hit and no miss."""
    env = {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": "1000000000",  # the cache's file lock, for the ranks
    }
    seen = []
    for before in (1, 0):
        out = tmp_path / f"before-{before}"
        out.mkdir()
        job = run_job(
            [SCRIPTS / "jax_cached_step.py", "--before", str(before), "--out", out],
            ranks=2,
            job_timeout=200,
            env=env,
            timeout=240,
        )
        assert job.returncode == 0, job.stdout + job.stderr
        counts = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
        seen.append([(c["hits"], c["misses"]) for c in counts])
    first, second = seen  # one program each: its first call compiles or loads nothing else
    assert all(hits + misses == 1 for hits, misses in first), seen
    assert any(misses for _, misses in first), seen  # (a rank may load what the other wrote)
    assert second == [(1, 0), (1, 0)], seen
