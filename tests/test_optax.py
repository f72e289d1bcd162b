"""Tests of `dataparallel.jax` (optax), passing at any world size.

`pytest tests/test_optax.py` runs them in a world of one; under
`mpiexec -n 3 python -m pytest tests/test_optax.py` every rank runs them in lockstep. Results are
compared across ranks by gathering plain NumPy values first and asserting afterwards, so a failure
on one rank cannot leave the others waiting in a collective.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy
import jax.extend.core  # noqa: E402
from _engine_calls import count_engine_calls  # noqa: E402
from _jobs import run_job  # noqa: E402

import dataparallel as dp  # noqa: E402
from dataparallel.backends.base import Backend  # noqa: E402
from dataparallel.errors import CollectiveMismatchError, LinkLostError, library_error  # noqa: E402
from dataparallel.jax import DistributedState, distributed_optax  # noqa: E402
from dataparallel.jax._bridges import mpi4jax_reason  # noqa: E402
from dataparallel.jax._optax import callback_backend  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks: every share has the same size
STEPS = 6
SCRIPTS = Path(__file__).parent / "scripts"


def gather(tree: Any) -> list[Any]:
    """Return every rank's `tree`, as NumPy leaves, in rank order."""
    return dp.allgather_object(jax.tree.map(np.asarray, tree))


def assert_same_on_every_rank(tree: Any) -> None:
    every = gather(tree)
    for other in every[1:]:
        jax.tree.map(np.testing.assert_array_equal, every[0], other)


# --- A small regression problem: the same global batch on every rank. -----------------------------


def problem() -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    params = {
        "hidden": {
            "w": rng.normal(size=(4, 8)).astype(np.float32),
            "b": np.zeros(8, np.float32),
        },
        "out": [rng.normal(size=(8,)).astype(np.float32), np.zeros((), np.float32)],
    }
    params = jax.device_put(params)  # by NumPy: an eager JAX operation is a program to compile
    x = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH,)).astype(np.float32)
    return params, x, y


def loss(params: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    w, b = params["out"]
    return jnp.mean((h @ w + b - y) ** 2)


def share(a: np.ndarray, rank: int, size: int) -> np.ndarray:
    return np.array_split(a, size)[rank]


def train(
    opt: Any, params: Any, x: np.ndarray, y: np.ndarray, steps: int, jit: bool
) -> tuple[Any, Any]:
    """Run `steps` steps of `opt` on (x, y): with a jitted train step, or with `opt.update` eager.

    (The eager variant still jits the gradient: JAX compiles every primitive it runs eagerly, which
    would make the test slow without testing anything more.)
    """
    grad = jax.jit(jax.grad(loss))

    def step(params: Any, state: Any) -> tuple[Any, Any]:
        grads = grad(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    run = jax.jit(step) if jit else step
    state = opt.init(params)
    for _ in range(steps):
        params, state = run(params, state)
    return params, state


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adam": lambda: optax.adam(1e-2),
    "sgd-momentum": lambda: optax.sgd(5e-2, momentum=0.9),
}


@pytest.mark.spread
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shares_averaged_match_one_process_on_the_whole_batch(
    name: str, jit: bool, rank: int, size: int
) -> None:
    params, x, y = problem()
    reference, ref_state = train(OPTIMIZERS[name](), params, x, y, STEPS, jit=True)
    opt = dp.DistributedOptimizer(OPTIMIZERS[name]())
    mine, state = train(opt, params, share(x, rank, size), share(y, rank, size), STEPS, jit=jit)

    assert isinstance(state, DistributedState)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), mine, reference
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
        state.inner_state,
        ref_state,
    )
    assert_same_on_every_rank((mine, state))


# --- The optax interface. -------------------------------------------------------------------------


def test_state_is_a_namedtuple_carrying_the_inner_state() -> None:
    params = {"w": jnp.ones(3)}
    inner = optax.adam(1e-3)
    opt = dp.DistributedOptimizer(inner)
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    state = opt.init(params)
    assert type(state) is DistributedState and state._fields == ("inner_state",)
    assert jax.tree.structure(state.inner_state) == jax.tree.structure(inner.init(params))


def test_update_signature_matches_optax(size: int) -> None:
    params = {"w": jnp.ones(3)}
    opt = distributed_optax(optax.sgd(0.5))
    state = opt.init(params)
    grads = {"w": jnp.full(3, 2.0)}
    no_params, _ = opt.update(grads, state)  # params defaults to None
    positional, _ = opt.update(grads, state, params)
    keyword, _ = opt.update(updates=grads, state=state, params=params)
    for updates in (no_params, positional, keyword):
        np.testing.assert_allclose(updates["w"], [-1.0, -1.0, -1.0])


def test_extra_args_reach_the_inner_transformation() -> None:
    seen: list[dict[str, Any]] = []

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        seen.append(extra)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    opt = distributed_optax(inner)
    opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}), None, value=jnp.asarray(3.0))
    assert len(seen) == 1 and float(seen[0]["value"]) == 3.0


def test_plain_transformations_ignore_extra_args() -> None:
    opt = distributed_optax(optax.sgd(1.0))
    params = {"w": jnp.ones(2)}
    updates, _ = opt.update({"w": jnp.ones(2)}, opt.init(params), params, value=jnp.asarray(1.0))
    np.testing.assert_allclose(updates["w"], [-1.0, -1.0])


def test_the_inner_state_is_refused_with_a_clear_message() -> None:
    params = {"w": jnp.ones(2)}
    inner = optax.sgd(0.1)
    opt = distributed_optax(inner)
    with pytest.raises(TypeError, match="expected the DistributedState made by this"):
        opt.update({"w": jnp.ones(2)}, inner.init(params), params)


def test_unknown_op_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"op='mean' is not a reduction"):
        dp.DistributedOptimizer(optax.sgd(0.1), op="mean")


def test_empty_gradient_tree_is_passed_through() -> None:
    opt = distributed_optax(optax.sgd(0.1))
    updates, state = opt.update({}, opt.init({}))
    assert updates == {} and isinstance(state, DistributedState)


# --- Reductions: op, dtypes, errors. --------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sum_and_avg_over_mixed_dtypes(jit: bool, rank: int, size: int) -> None:
    grads = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3) + rank,
        "f16": np.full(4, rank + 1, np.float16),
        "bf16": np.full((), rank + 1, jnp.bfloat16),
        "i32": np.asarray([rank, 2 * rank], np.int32),
    }
    grads = jax.device_put(grads)  # JAX arrays, made by NumPy (no program to compile)
    total = sum(range(size))
    for op in ("sum", "avg"):
        tree = grads if op == "sum" else {k: v for k, v in grads.items() if k != "i32"}
        opt = distributed_optax(optax.identity(), op=op)
        update = jax.jit(opt.update) if jit else opt.update
        out, _ = update(tree, opt.init(tree))
        div = 1 if op == "sum" else size
        for key, value in out.items():
            assert value.dtype == tree[key].dtype and value.shape == tree[key].shape, key
        np.testing.assert_allclose(
            out["f32"], (size * np.arange(6).reshape(2, 3) + total) / div, rtol=1e-6
        )
        np.testing.assert_allclose(out["f16"].astype(np.float32), (size + total) / div, rtol=1e-3)
        np.testing.assert_allclose(float(out["bf16"]), (size + total) / div, rtol=1e-2)
        if op == "sum":
            np.testing.assert_array_equal(out["i32"], [total, 2 * total])


def test_numpy_gradients_are_not_written_in_place(rank: int, size: int) -> None:
    grads = {"w": np.full(3, rank + 1.0, np.float32)}
    opt = distributed_optax(optax.identity(), op="sum")
    out, _ = opt.update(grads, opt.init(grads))
    np.testing.assert_array_equal(grads["w"], np.full(3, rank + 1.0))
    np.testing.assert_allclose(out["w"], np.full(3, size * (size + 1) / 2))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_avg_on_integer_gradients_names_the_leaf(jit: bool) -> None:
    params = {"layer": {"w": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}}
    opt = distributed_optax(optax.identity())
    update = jax.jit(opt.update) if jit else opt.update
    message = re.escape("grads['layer']['i']: op='avg' on int32 values would truncate")
    with pytest.raises(TypeError, match=message):
        update(params, opt.init(params))


def test_mismatched_gradients_fail_on_every_rank_and_the_world_survives(
    rank: int, size: int
) -> None:
    if size == 1:
        pytest.skip("needs peers")
    opt = distributed_optax(optax.identity())
    grads = {"w": jnp.ones(3 + rank)}
    with pytest.raises(CollectiveMismatchError, match=r"float32\[3\] on rank 0"):
        opt.update(grads, opt.init(grads))
    # Under jit the ranks agree on the traced signature once, when tracing: a plain error.
    with pytest.raises(CollectiveMismatchError, match=r"(?s)jit allreduce.*float32\[3\] on rank 0"):
        jax.jit(opt.update)(grads, opt.init(grads))
    same = {"w": jnp.ones(3)}
    out, _ = jax.jit(opt.update)(same, opt.init(same))
    np.testing.assert_allclose(out["w"], np.ones(3))


# --- Under jit: one engine call per step, ranks in step. ------------------------------------------


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the engine calls the callback and FFI routes make (one per dtype buffer and step):
    their sizes, in items. A world of one reduces nothing, so nothing is counted there."""
    return count_engine_calls(monkeypatch, callback_backend(None)).calls


ROUTES = ["callback", "ffi", "mpi4jax"]
HOST = ("callback", "ffi")  # the routes whose engine calls `engine_calls` counts
STAGED = {"callback": "io_callback", "ffi": "dataparallel_allreduce"}


def route_or_skip(route: str, size: int) -> str:
    if route == "mpi4jax":
        reason = mpi4jax_reason(callback_backend(None))
        if size == 1 or reason is not None:
            pytest.skip(f"the mpi4jax route: {reason or 'a world of one reduces nothing'}")
    return route


def primitives(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The names of the primitives `fn` stages out, nested jaxprs included."""
    names: list[str] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize("route", ROUTES)
def test_one_engine_call_per_jitted_step_and_ranks_stay_in_step(
    route: str, engine_calls: list[int], rank: int, size: int
) -> None:
    route = route_or_skip(route, size)
    lr, steps = 0.01, 100
    opt = dp.DistributedOptimizer(optax.sgd(lr), route=route)  # type: ignore[arg-type]
    key = jax.random.key(rank)

    def step(params: Any, state: Any, key: Any) -> tuple[Any, Any, Any]:
        # Gradient (rank + 1) * params: the average over ranks is (size + 1) / 2 * params.
        grads = jax.tree.map(lambda p: (rank + 1) * p, params)
        updates, state = opt.update(grads, state, params)
        noise = jax.random.normal(key, ())  # rank-local work that must not leak into the result
        return optax.apply_updates(params, updates), state, noise

    params = {"a": jnp.ones((3, 2)), "b": [jnp.full(5, 2.0)]}
    state = opt.init(params)
    staged = primitives(step, params, state, key)
    jitted = jax.jit(step)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        params, state, _ = jitted(params, state, sub)
    jax.block_until_ready((params, state))  # the last step's call has run (dispatch is async)
    if size > 1:  # both leaves in one buffer, with the two items of the order check
        if route in HOST:
            assert engine_calls == [6 + 5 + 2] * steps
            assert staged.count(STAGED[route]) == 1
        else:
            assert engine_calls == [] and staged.count("allreduce_mpi") == 1
            assert "io_callback" in staged  # only inside the order check's failing branch
    factor = (1 - lr * (size + 1) / 2) ** steps
    np.testing.assert_allclose(params["a"], np.full((3, 2), factor), rtol=1e-4)
    np.testing.assert_allclose(params["b"][0], np.full(5, 2 * factor), rtol=1e-4)
    assert_same_on_every_rank(params)


@pytest.mark.parametrize("route", ROUTES)
def test_engine_call_runs_once_per_iteration_inside_a_loop(
    route: str, engine_calls: list[int], rank: int, size: int
) -> None:
    route = route_or_skip(route, size)
    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]

    @jax.jit
    def loop(x: Any) -> Any:
        state = opt.init(x)

        def body(_: Any, acc: Any) -> Any:
            out, _ = opt.update(jnp.full_like(acc, rank + 1.0), state)
            return acc + out

        return jax.lax.fori_loop(0, 7, body, x)

    out = jax.block_until_ready(loop(jnp.zeros(2)))
    if size > 1 and route in HOST:
        assert engine_calls == [2 + 2] * 7
    np.testing.assert_allclose(out, np.full(2, 7 * size * (size + 1) / 2))


@pytest.mark.parametrize("route", HOST)
def test_results_of_earlier_steps_stay_as_they_were(route: str, rank: int, size: int) -> None:
    """The callback hands JAX the same receive buffers every step (JAX must copy them out); the
    FFI call reduces in place in XLA's memory (XLA must not hand it a live result)."""
    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]
    update = jax.jit(opt.update)
    state = opt.init({"w": jnp.zeros(4)})
    first, _ = update({"w": jnp.full(4, rank + 1.0)}, state)
    second, _ = update({"w": jnp.full(4, 10.0 * (rank + 1))}, state)
    total = size * (size + 1) / 2
    np.testing.assert_allclose(first["w"], np.full(4, total))
    np.testing.assert_allclose(second["w"], np.full(4, 10 * total))


@pytest.mark.parametrize("route", HOST)
def test_a_large_leaf_passed_to_the_step_is_not_written(route: str, rank: int, size: int) -> None:
    """A leaf over the bucket size is its own buffer (the step's argument, in its own shape): the
    FFI call reduces in place, so XLA must copy the argument first, never write the caller's."""
    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]
    grads = {"w": jnp.full((200, 500), rank + 1.0)}  # 400 kB: alone
    before = np.array(grads["w"])
    out, _ = jax.jit(opt.update)(grads, opt.init(grads))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full((200, 500), size * (size + 1) / 2))
    np.testing.assert_array_equal(np.asarray(grads["w"]), before)


def test_retracing_an_ffi_step_adds_no_table_entry(rank: int, size: int) -> None:
    """Each trace of a step used to add an entry to the FFI call's table for the process's life;
    now a step traced again (a new jax.jit, jax.clear_caches()) reuses its entry."""
    from dataparallel.jax import _ffi

    if size == 1 or _ffi.ffi_reason() is not None:
        pytest.skip(f"the ffi route: {_ffi.ffi_reason() or 'a world of one reduces nothing'}")
    opt = distributed_optax(optax.identity(), op="sum", route="ffi")
    grads = {"retraced": jnp.full(3, rank + 1.0)}  # a tree no other test's step has
    state = opt.init(grads)
    jax.block_until_ready(jax.jit(opt.update)(grads, state))
    entries = len(_ffi._steps)
    for _ in range(3):
        out, _ = jax.jit(opt.update)(grads, state)  # a new jit: traced again
        np.testing.assert_array_equal(out["retraced"], np.full(3, size * (size + 1) / 2))
    jax.clear_caches()
    jax.block_until_ready(jax.jit(opt.update)(grads, state))
    assert len(_ffi._steps) == entries
    longer = {"retraced": jnp.full(4, rank + 1.0)}  # another signature: a step of its own
    jax.block_until_ready(jax.jit(opt.update)(longer, opt.init(longer)))
    assert len(_ffi._steps) == entries + 1


def test_the_ffi_step_reduces_every_buffer_in_place_with_no_copy(rank: int, size: int) -> None:
    """The FFI call's outputs alias its inputs: the packed buffer and a leaf over the bucket size
    in its own shape, straight from backward's matrix product. (A reshaped leaf made XLA copy it
    before the call, a whole gradient's worth of memory per step.)"""
    from dataparallel.jax import _ffi

    if size == 1 or _ffi.ffi_reason() is not None:
        pytest.skip(f"the ffi route: {_ffi.ffi_reason() or 'a world of one reduces nothing'}")
    opt = distributed_optax(optax.sgd(1.0), op="sum", route="ffi")
    params = {"w": jnp.zeros((160, 512)), "b": jnp.zeros(512)}  # w: 320 KiB, over 256 KiB
    x = jnp.full((4, 160), rank + 1.0)

    def step(p: Any, s: Any) -> Any:
        grads = jax.grad(lambda q: jnp.sum(x @ q["w"] + q["b"]))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    compiled = jax.jit(step).lower(params, opt.init(params)).compile()
    call = next(line for line in compiled.as_text().splitlines() if "custom-call(" in line)
    operands = re.search(r"custom-call\(([^)]*)\)", call)
    assert operands is not None and "dataparallel_allreduce" in call, call
    names = [name.strip() for name in operands.group(1).split(",")][:-1]  # the token last
    assert len(names) == 2 and "dot" in names[1] and "copy" not in names[1], call
    aliased = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(,|$)", call)
    assert aliased is not None and all(f"({i}, {{}})" in aliased.group(1) for i in (0, 1)), call
    new, _ = jax.jit(step)(params, opt.init(params))
    ones = size * (size + 1) / 2  # each row of x sums to 160 * (rank + 1); 4 rows
    np.testing.assert_allclose(new["w"], np.full((160, 512), -4.0 * ones))
    np.testing.assert_allclose(new["b"], np.full(512, -4.0 * size))


def test_ranks_on_different_routes_are_told_when_tracing(rank: int, size: int) -> None:
    route_or_skip("mpi4jax", size)
    route = "callback" if rank == 0 else "mpi4jax"
    opt = distributed_optax(optax.identity(), route=route)  # type: ignore[arg-type]
    grads = {"w": jnp.ones(3)}
    message = r"route: callback on rank 0; mpi4jax on rank"
    with pytest.raises(CollectiveMismatchError, match=message):
        jax.jit(opt.update)(grads, opt.init(grads))


@pytest.mark.parametrize("route", ROUTES)
def test_ranks_running_different_compiled_steps_raise_instead_of_mixing(
    route: str, rank: int, size: int
) -> None:
    """Both steps were agreed on when traced; run in a different order, the order check fails."""
    route = route_or_skip(route, size)
    if size == 1:
        pytest.skip("needs peers")
    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]
    update = jax.jit(opt.update)
    a, b = {"a": jnp.ones(3)}, {"b": jnp.ones(3)}  # the same sizes: the engine cannot tell
    update(a, opt.init(a))
    update(b, opt.init(b))
    grads = a if rank == 0 else b
    with pytest.raises(jax.errors.JaxRuntimeError, match="different jitted DistributedOptimizer"):
        jax.block_until_ready(update(grads, opt.init(grads)))
    out, _ = update(a, opt.init(a))  # the world goes on
    np.testing.assert_allclose(out["a"], np.full(3, size))


@pytest.mark.parametrize("route", HOST)
def test_a_link_lost_in_a_jitted_step_keeps_its_address(
    route: str, monkeypatch: pytest.MonkeyPatch, rank: int, size: int
) -> None:
    """The engine's `LinkLostError` in the step's reduction (inside XLA) reaches the caller as
    JAX's `JaxRuntimeError`; `library_error` gives it back as the `LinkLostError` it was, with
    the peer's address, which elastic training reports to the launcher (a possible split)."""
    if size == 1:
        pytest.skip("a world of one reduces nothing")
    private = callback_backend(None)
    address = f"192.0.2.{rank + 1}"  # TEST-NET-1: no host of the test's

    def lose(*_: object) -> None:  # on every rank, before anything is sent: the world holds
        raise LinkLostError(f"rank {rank} lost its link to {address} ({route})", address)

    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]
    update = jax.jit(opt.update)
    grads = {"a": jnp.ones(3)}
    with monkeypatch.context() as patched:
        patched.setattr(private, "allreduce", lose)
        patched.setattr(private, "allreduce_into", lose)
        with pytest.raises(jax.errors.JaxRuntimeError) as raised:
            jax.block_until_ready(update(grads, opt.init(grads)))
    found = library_error(raised.value)
    assert isinstance(found, LinkLostError) and found.address == address, repr(found)
    out, _ = update(grads, opt.init(grads))  # the world goes on
    np.testing.assert_allclose(out["a"], np.full(3, size))


@pytest.mark.heavy
def test_value_and_grad_train_step_with_apply_updates(rank: int, size: int) -> None:
    params, x, y = problem()
    opt = dp.DistributedOptimizer(optax.adam(1e-2))

    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    values = []
    for _ in range(30):
        params, state, value = step(params, state, share(x, rank, size), share(y, rank, size))
        values.append(float(value))
    assert values[-1] < values[0]  # this rank's share's loss
    # The global loss went down, and every rank holds the same parameters.
    assert float(loss(params, x, y)) < 0.8 * float(loss(problem()[0], x, y))
    assert_same_on_every_rank(params)


def test_callbacks_use_a_private_communicator(world: Backend, rank: int) -> None:
    """A step reducing on another thread cannot interleave with the main thread's collectives.

    On a GPU a jitted step returns before its callback runs, so the main thread may make its own
    collective (log a loss) while the callback reduces. Rank 0 starts the step first and rank 1
    the main-thread collective first: on one shared communicator the calls would cross.
    """
    if world.name != "mpi" or world.size == 1:
        pytest.skip("needs several MPI ranks")
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("MPI is not initialized with MPI_THREAD_MULTIPLE")
    opt = distributed_optax(optax.identity(), op="sum")
    private = callback_backend(None)
    assert private is not world and private.comm != world.comm  # type: ignore[attr-defined]
    step = jax.jit(opt.update)
    grads = {"w": jnp.full(4, rank + 1.0)}
    state = opt.init(grads)
    step(grads, state)  # compile on the main thread first
    result: dict[str, Any] = {}

    def run_step() -> None:
        result["step"] = step(grads, state)[0]

    thread = threading.Thread(target=run_step)
    if rank == 0:
        thread.start()
    logged = dp.allreduce(np.full(2, float(rank)))
    if rank != 0:
        thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    total = world.size * (world.size + 1) / 2
    np.testing.assert_allclose(result["step"]["w"], np.full(4, total))
    np.testing.assert_allclose(logged, np.full(2, total - world.size))


# --- dp.synchronize on optax states and JAX parameter trees. --------------------------------------


@pytest.mark.parametrize("root", [0, -1], ids=["root0", "last"])
def test_synchronize_gives_every_rank_roots_optax_state(root: int, rank: int, size: int) -> None:
    root = root % size
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2 * (rank + 1)),
    )
    state = inner.init(params)
    update = jax.jit(inner.update)
    for i in range(rank + 1):  # rank-dependent counts, moments and hyper-parameters
        grads = jax.tree.map(lambda p, i=i: p * (rank + 1) + i + 1, params)
        _, state = update(grads, state, params)
    dstate = DistributedState(inner_state=state)
    theirs = gather(dstate)[root]

    synced = dp.synchronize(dstate, root=root)

    assert jax.tree.structure(synced) == jax.tree.structure(dstate)
    assert type(synced) is DistributedState
    assert isinstance(synced.inner_state[0], optax.EmptyState)
    for got, was in zip(jax.tree.leaves(synced), jax.tree.leaves(dstate), strict=True):
        assert isinstance(got, jax.Array) and got.dtype == was.dtype and got.shape == was.shape
    jax.tree.map(np.testing.assert_array_equal, synced, theirs)
    assert int(synced.inner_state[1].count) == root + 1


def test_synchronize_gives_every_rank_roots_parameters(rank: int, size: int) -> None:
    params = {
        "dense": {
            "w": np.full((3, 2), float(rank), np.float32),
            "b": np.arange(2, dtype=np.int32) + rank,
        },
        "scale": np.asarray(rank, jnp.bfloat16),
        "steps": [np.asarray(rank, np.int32)],
    }
    params = jax.device_put(params)  # JAX arrays, made by NumPy (no program to compile)
    synced = dp.synchronize(params)
    assert jax.tree.structure(synced) == jax.tree.structure(params)
    np.testing.assert_array_equal(synced["dense"]["w"], np.zeros((3, 2)))
    np.testing.assert_array_equal(synced["dense"]["b"], np.arange(2))
    assert synced["scale"].dtype == jnp.bfloat16 and float(synced["scale"]) == 0.0
    assert synced["steps"][0].dtype == jnp.int32 and int(synced["steps"][0]) == 0
    assert_same_on_every_rank(synced)


# --- Both routes: parity, dtypes, compositions with optax's wrappers. -----------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_jitted_routes_match_one_process_on_the_whole_batch(
    route: str, rank: int, size: int
) -> None:
    route = route_or_skip(route, size)
    params, x, y = problem()
    reference, _ = train(optax.adam(1e-2), params, x, y, STEPS, jit=True)
    opt = dp.DistributedOptimizer(optax.adam(1e-2), route=route)  # type: ignore[arg-type]
    mine, _ = train(opt, params, share(x, rank, size), share(y, rank, size), STEPS, jit=True)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), mine, reference
    )
    assert_same_on_every_rank(mine)


@pytest.mark.parametrize("route", ROUTES)
def test_jitted_sum_of_bool_small_integers_and_large_leaves(
    route: str, rank: int, size: int
) -> None:
    """Small leaves share a buffer per wire dtype (int8, uint8, bool as int32; float16 as
    float32); a leaf over the bucket size is a buffer of its own."""
    route = route_or_skip(route, size)
    big = 1 << 17  # 512 KiB of float32: over the default bucket size, 256 KiB
    grads = {
        "flag": jnp.asarray([rank == 0, False]),
        "i8": jnp.full(3, rank + 1, jnp.int8),
        "f16": jnp.full(2, rank + 1, jnp.float16),
        "big": jnp.full(big, rank + 1.0, jnp.float32),
    }
    opt = distributed_optax(optax.identity(), op="sum", route=route)  # type: ignore[arg-type]
    out, _ = jax.jit(opt.update)(grads, opt.init(grads))
    total = size * (size + 1) // 2
    for key, value in out.items():
        assert value.dtype == grads[key].dtype and value.shape == grads[key].shape, key
    np.testing.assert_array_equal(out["flag"], [True, False])
    np.testing.assert_array_equal(out["i8"], np.full(3, total, np.int8))
    np.testing.assert_array_equal(out["f16"], np.full(2, total, np.float16))
    np.testing.assert_array_equal(out["big"], np.full(big, float(total), np.float32))


@pytest.mark.heavy
@pytest.mark.parametrize("route", ROUTES)
def test_multi_steps_communicates_once_per_real_update(
    route: str, engine_calls: list[int], rank: int, size: int
) -> None:
    """dp.jax.multi_steps: k micro-batches accumulated locally, one reduction per real update,
    the same result as one process on the whole batch with optax.MultiSteps."""
    route = route_or_skip(route, size)
    params, x, y = problem()
    k = 3
    reference, _ = train(optax.MultiSteps(optax.adam(1e-2), k), params, x, y, 2 * k, jit=True)
    opt = dp.jax.multi_steps(optax.adam(1e-2), k, route=route)
    mine, state = train(opt, params, share(x, rank, size), share(y, rank, size), 2 * k, jit=True)
    jax.block_until_ready((mine, state))  # the last step's call has run (dispatch is async)
    if size > 1 and route in HOST:
        assert len(engine_calls) == 2  # two real updates in 2k micro-steps
    assert int(state.gradient_step) == 2
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), mine, reference
    )
    assert_same_on_every_rank(mine)


@pytest.mark.heavy
def test_multisteps_around_the_distributed_optimizer_is_right_but_reduces_every_micro_step(
    engine_calls: list[int], rank: int, size: int
) -> None:
    """optax's MultiSteps calls the inner update on every micro-step (keeping its result on the
    k-th only), so the plain composition reduces k times per real update: dp.jax.multi_steps
    is the one that communicates once (above)."""
    params, x, y = problem()
    k = 3
    reference, _ = train(optax.MultiSteps(optax.adam(1e-2), k), params, x, y, 2 * k, jit=True)
    opt = optax.MultiSteps(dp.DistributedOptimizer(optax.adam(1e-2), route="callback"), k)
    mine, state = train(opt, params, share(x, rank, size), share(y, rank, size), 2 * k, jit=True)
    jax.block_until_ready((mine, state))  # the last step's call has run (dispatch is async)
    if size > 1:
        assert len(engine_calls) == 2 * k
    assert int(state.gradient_step) == 2
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), mine, reference
    )
    assert_same_on_every_rank(mine)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_chain_and_apply_if_finite_inside_the_distributed_optimizer(
    jit: bool, rank: int, size: int
) -> None:
    """DistributedOptimizer(apply_if_finite(chain(clip, adam))): the averaged gradient is tested,
    so every rank skips the same steps; one rank's NaN poisons the average, and every rank skips."""
    params = {"w": jnp.ones(3)}
    inner = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), 5)
    opt = dp.DistributedOptimizer(inner)
    update = jax.jit(opt.update) if jit else opt.update
    state = opt.init(params)
    finite = {"w": jnp.full(3, float(rank + 1))}
    updates, state = update(finite, state, params)
    np.testing.assert_allclose(updates["w"], np.full(3, -0.1 / np.sqrt(3)), rtol=1e-6)
    poisoned = {"w": jnp.full(3, np.nan if rank == size - 1 else 1.0)}
    updates, state = update(poisoned, state, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(3))
    assert int(state.inner_state.notfinite_count) == 1
    assert_same_on_every_rank(state)


@pytest.mark.spawns
def test_a_process_with_several_devices_reduces_through_the_callback() -> None:
    """Two JAX devices per rank: a gradient on one of them or sharded over both is reduced (the
    callback route); route='mpi4jax' is refused when traced, with the fix."""
    job = run_job(
        [SCRIPTS / "jax_devices.py"],
        ranks=2,
        job_timeout=300,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in (0, 1):
        assert f"rank {rank}: one device ok" in job.stdout, job.stdout + job.stderr
        assert f"rank {rank}: sharded ok" in job.stdout, job.stdout + job.stderr
        assert f"rank {rank}: refused: route='mpi4jax' cannot be used: " in job.stdout
        assert f"rank {rank}: refused: route='ffi' cannot be used: " in job.stdout
    assert "one rank per device" in job.stdout or "not installed" in job.stdout
