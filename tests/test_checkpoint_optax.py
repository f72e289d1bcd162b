"""`dp.checkpoint` with optax's sharded state (`dp.DistributedOptimizer(tx, shard_state=True)`).

The tests without `spawns` run in whatever world pytest runs in (1, 2, 3 ranks; MPI, Gloo): every
rank writes its own slices of each parameter's state (`dp.checkpoint.OptaxShards`), and a fresh
state loads them bit for bit and trains on alike; the saved tensors are the whole states of the
parameters, of their shapes; a bare `ShardedState` is refused. The `spawns` test runs jobs of
other sizes (tests/scripts/optax_checkpoint_job.py) and takes their steps in its own world of one:
saved at 1 and loaded at 3, saved at 3 and loaded at 2 and 1, saved at 2 and loaded at 1, each
loaded state, consolidated, equal bit for bit to the saving world's; a job loads checkpoints and
saves the next, so two jobs do it all. The same steps carry a chain of sharded runs that each
resume what a world of another size consolidated (tests/scripts/optax_sharded_resume.py): a job's
start costs seconds.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("optax") is None:
    pytest.skip("needs torch (dp.checkpoint) and optax", allow_module_level=True)

import jax
import jax.numpy as jnp
import optax
from _jobs import outer_world_size, run_job
from test_optax_sharded import assert_resumed_like_one_process

import dataparallel as dp
from dataparallel.backends.base import Backend

JOB = Path(__file__).parent / "scripts" / "optax_checkpoint_job.py"


@pytest.fixture
def folder(world: Backend) -> Iterator[Path]:
    """A folder every rank sees (rank 0 makes it), removed after the test."""
    made = tempfile.mkdtemp(prefix="dp-ckpt-optax-") if dp.rank() == 0 else None
    path = Path(dp.broadcast_object(made))
    yield path / "ckpt"
    dp.barrier()
    if dp.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def make_params() -> dict[str, Any]:
    host = {
        "w": np.arange(35.0, dtype=np.float32).reshape(5, 7) / 10,  # odd: slices cut rows
        "b": np.linspace(-1, 1, 7, dtype=np.float32),
        "h": np.ones((3, 3), jnp.bfloat16),
        "e": np.ones((0, 2), np.float32),  # no item: its empty state, written whole
    }
    return jax.device_put(host)  # by NumPy: an eager JAX operation is a program to compile


def gradient(shape: tuple[int, ...], dtype: Any, step: int) -> jax.Array:
    """A leaf's gradient at `step`, differing per rank. Made by NumPy and put on the device:
    each eager JAX operation would be a program to compile."""
    x = (np.arange(math.prod(shape)) + step + dp.rank()).astype(np.float32)
    return jax.device_put((np.cos(x) * 3).reshape(shape).astype(dtype))


def train(opt: Any, params: Any, state: Any, steps: range) -> tuple[Any, Any]:
    for step in steps:
        grads = jax.tree.map(lambda p, s=step: gradient(p.shape, p.dtype, s), params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_same(a: Any, b: Any, where: str) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), where
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{where} leaf {i}"
        assert x.tobytes() == y.tobytes(), f"{where} leaf {i}: {x} != {y}"


@pytest.mark.heavy
def test_a_sharded_optax_state_round_trips_bit_for_bit(folder: Path) -> None:
    opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    params, state = train(opt, make_params(), opt.init(make_params()), range(2))
    dp.checkpoint.save(
        {"params": params, "opt": dp.checkpoint.OptaxShards(state, params), "step": 2}, folder
    )
    fresh = {
        "params": make_params(),
        "opt": dp.checkpoint.OptaxShards(opt.init(make_params()), make_params()),
        "step": 0,
    }
    loaded = dp.checkpoint.load(fresh, folder)
    assert loaded is fresh and loaded["step"] == 2
    assert isinstance(loaded["opt"], dp.jax.ShardedState)
    assert_same(loaded["opt"], state, "the state")
    assert_same(loaded["params"], params, "the parameters")
    # and both go on alike
    a = train(opt, params, state, range(2, 4))
    b = train(opt, loaded["params"], loaded["opt"], range(2, 4))
    assert_same(b, a, "two more steps")


@pytest.mark.heavy
def test_each_slice_is_written_into_its_parameters_whole_state(folder: Path) -> None:
    """The checkpoint holds `mu/w` of `w`'s shape, as the ranks' slices together make it: no
    rank's slice missing, none written twice."""
    from torch.distributed.checkpoint import FileSystemReader

    opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    params, state = train(opt, make_params(), opt.init(make_params()), range(1))
    dp.checkpoint.save({"opt": dp.checkpoint.OptaxShards(state, params)}, folder)
    whole = dp.jax.consolidate_state(state, params, to=0)
    dp.barrier()
    if dp.rank() != 0:
        return
    md = FileSystemReader(folder).read_metadata().state_dict_metadata
    assert tuple(md["opt.0/mu/w"].size) == (5, 7)
    assert tuple(md["opt.0/nu/h"].size) == (3, 3)
    assert tuple(md["opt.0/mu/e"].size) == (0, 2)
    assert tuple(md["opt.0/count"].size) == ()
    chunks = md["opt.0/mu/w"].chunks  # the slices of every rank tile the tensor once
    assert sum(int(np.prod(c.sizes)) for c in chunks) == 35
    assert whole is not None
    # a plain torch DCP read gives the whole state of `w`, as consolidate_state gathers it
    import torch
    import torch.distributed.checkpoint as dcp

    got = {"opt": {"0/mu/w": torch.zeros(5, 7), "0/nu/b": torch.zeros(7)}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, checkpoint_id=folder, no_dist=True)
    want = whole.inner_state[0]
    assert got["opt"]["0/mu/w"].numpy().tobytes() == np.asarray(want.mu["w"]).tobytes()
    assert got["opt"]["0/nu/b"].numpy().tobytes() == np.asarray(want.nu["b"]).tobytes()


def test_a_bare_sharded_state_is_refused(folder: Path) -> None:
    opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    state = opt.init(make_params())
    with pytest.raises(TypeError, match=r"put dp\.checkpoint\.OptaxShards\(state, params\)"):
        dp.checkpoint.save({"opt": state}, folder)
    with pytest.raises(TypeError, match="takes the ShardedState"):
        dp.checkpoint.OptaxShards(optax.adam(0.1).init(make_params()), make_params())


def test_a_state_of_other_parameters_is_named(folder: Path) -> None:
    opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    state = opt.init(make_params())
    other = {**make_params(), "w": jnp.ones((9, 9))}
    with pytest.raises(ValueError, match=r"slice_places: state\[0\]\.mu\['w'\] has shape"):
        dp.checkpoint.save({"opt": dp.checkpoint.OptaxShards(state, other)}, folder)


def test_a_state_sharded_over_a_group_of_the_whole_world_round_trips(folder: Path) -> None:
    group = dp.new_group(range(dp.size()))
    try:
        opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True, group=group)
        params, state = train(opt, make_params(), opt.init(make_params()), range(2))
        saved = dp.checkpoint.OptaxShards(state, params, group=group)
        dp.checkpoint.save({"opt": saved}, folder)
        fresh = dp.checkpoint.OptaxShards(opt.init(make_params()), make_params(), group=group)
        loaded = dp.checkpoint.load({"opt": fresh}, folder)
        assert_same(loaded["opt"], state, "the state")
    finally:
        group.free()


def test_a_group_short_of_the_world_is_refused(folder: Path) -> None:
    if dp.size() == 1:
        pytest.skip("a group short of the world needs two ranks")
    group = dp.new_group([0])
    try:
        opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
        state = opt.init(make_params())
        shards = dp.checkpoint.OptaxShards(state, make_params(), group=group)
        with pytest.raises(ValueError, match=r"a group of 1 ranks, the world has \d: every rank"):
            dp.checkpoint.save({"opt": shards}, folder)
    finally:
        group.free()


# -- jobs of other sizes -------------------------------------------------------------------------


def script(name: str) -> Any:
    """Import `tests/scripts/NAME.py`, to take its steps in this process (a world of one)."""
    spec = importlib.util.spec_from_file_location(name, JOB.with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job(actions: list[tuple[str, Path, Path]], ranks: int, backend: str) -> None:
    """Run `actions` (`save`/`load`/`resume`, folder or previous, pickle) in turn in one job."""
    done = run_job(
        [JOB, *(part for action in actions for part in action)],
        ranks=ranks,
        backend=backend,
        job_timeout=200,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# The checkpoints (saved at 1, 3, 2 ranks, in turn) and where each is loaded.
SIZES = {"one": 1, "three": 3, "two": 2}
LOADS = [("one", 3), ("three", 2), ("three", 1), ("two", 1)]


@pytest.mark.spawns
def test_saved_at_one_size_loads_bit_for_bit_at_others(tmp_path: Path) -> None:
    """Saved at 1 and loaded at 3 (to more: one saved slice cut in three), saved at 3 and loaded
    at 2 and at 1 (to fewer: a slice made of several saved ones), saved at 2 and loaded at 1;
    each loaded state, consolidated, equal bit for bit to the saving world's. Two jobs (MPI 3,
    then Gloo 2) and this process (a world of one) before and after them: a job's start costs
    seconds. The same steps carry the sharded resume chain (`optax_sharded_resume.resume`):
    this process starts it (jitted), MPI 3 goes on with more and uneven shards (jitted), Gloo 2
    with fewer (eager), and the end matches one process throughout
    (`test_optax_sharded.assert_resumed_like_one_process`)."""
    if outer_world_size() > 1:
        pytest.skip("launches its own jobs: run this file in a world of one")
    here, resume = script("optax_checkpoint_job"), script("optax_sharded_resume").resume
    folder = {name: tmp_path / name for name in SIZES}
    ref = {name: tmp_path / f"ref-{name}.pkl" for name in folder}
    chain = [tmp_path / f"resumed-{n}.pkl" for n in range(3)]
    here.act("save", folder["one"], ref["one"])
    resume("-", chain[0])
    loaded = {(name, at): tmp_path / f"{name}-at-{at}.pkl" for name, at in LOADS}
    job(
        [
            ("load", folder["one"], loaded["one", 3]),
            ("save", folder["three"], ref["three"]),
            ("resume", chain[0], chain[1]),
        ],
        3,
        "mpi",
    )
    job(
        [
            ("load", folder["three"], loaded["three", 2]),
            ("save", folder["two"], ref["two"]),
            ("resume", chain[1], chain[2]),
        ],
        2,
        "gloo",
    )
    for name in ("three", "two"):
        here.act("load", folder[name], loaded[name, 1])
    for (name, at), path in loaded.items():
        got, want = pickle.loads(path.read_bytes()), pickle.loads(ref[name].read_bytes())
        where = f"saved at {SIZES[name]}, loaded at {at}"
        assert (want["size"], got["size"]) == (SIZES[name], at), where
        assert_same(got["params"], want["params"], f"parameters {where}")
        assert_same(got["state"], want["state"], f"state {where}")
    final = pickle.loads(chain[2].read_bytes())
    assert_resumed_like_one_process(final, [1, 3, 2])
