"""`dp.checkpoint` with optax's sharded state (`dp.DistributedOptimizer(tx, shard_state=True)`).

The tests run in whatever world pytest runs in (1, 2, 3 ranks; MPI, Gloo): every rank writes its
own slices of each parameter's state (`dp.checkpoint.OptaxShards`), and a fresh state loads them
bit for bit and trains on alike; the saved tensors are the whole states of the parameters, of
their shapes; a bare `ShardedState` is refused. Across world sizes and engines (`CrossSizes`),
the state rides on the jobs that `test_checkpoint.py` runs for torch's: a job's start costs
seconds, and torch's DCP, which both write through, is the most of it.
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
from test_optax_sharded import assert_resumed_like_one_process

import dataparallel as dp
from dataparallel.backends.base import Backend

SCRIPTS = Path(__file__).parent / "scripts"


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


# -- jobs of other sizes: test_checkpoint.py's -------------------------------------------------


def script(name: str) -> Any:
    """Import `tests/scripts/NAME.py`, to take its steps in this process (a world of one)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CrossSizes:
    """Optax's part of the jobs of other sizes that `test_checkpoint.py` runs for torch's state
    (`checkpoint_job.py`'s `optax-*` steps): saved here (a world of one) and loaded at Gloo 2
    (to more: one saved slice cut in two); saved at Gloo 2 and loaded at MPI 3 (each rank's
    slice cut across the saved ones) and here (to fewer: one slice made of two); saved at MPI 3
    and loaded here (one slice made of three, uneven); each loaded state, consolidated, equal bit
    for bit to the saving world's. The same steps carry the sharded resume chain
    (`optax_sharded_resume.resume`): Gloo 2 starts it (eager), MPI 3 goes on with more and uneven
    shards (jitted), this process with one (jitted), and the end matches one process throughout
    (`test_optax_sharded.assert_resumed_like_one_process`)."""

    LOADS = ((1, 2), (2, 3), (2, 1), (3, 1))  # (saved at, loaded at)

    def __init__(self, folder: Path) -> None:
        self.saved = {n: folder / f"optax-saved-at-{n}" for n in (1, 2, 3)}
        self.ref = {n: folder / f"optax-saved-at-{n}.pkl" for n in (1, 2, 3)}
        self.got = {load: folder / "optax-{}-loaded-at-{}.pkl".format(*load) for load in self.LOADS}
        self.chain = [folder / f"optax-resumed-{n}.pkl" for n in range(3)]
        self.here = script("optax_checkpoint")

    def before(self) -> None:
        """This process's steps before the jobs."""
        self.here.act("save", self.saved[1], self.ref[1])

    def steps(self, size: int) -> list[Any]:
        """The `checkpoint_job.py` steps of the job of `size` ranks (Gloo 2, then MPI 3)."""
        previous = {2: "-", 3: self.chain[0]}[size]
        return [
            *("optax-load", self.saved[size - 1], self.got[size - 1, size]),
            *("optax-save", self.saved[size], self.ref[size]),
            *("optax-resume", previous, self.chain[size - 2]),
        ]

    def after(self) -> None:
        """This process's steps after the jobs, then every check."""
        for saved in (2, 3):
            self.here.act("load", self.saved[saved], self.got[saved, 1])
        script("optax_sharded_resume").resume(self.chain[1], self.chain[2])
        for (saved, at), path in self.got.items():
            got = pickle.loads(path.read_bytes())
            want = pickle.loads(self.ref[saved].read_bytes())
            where = f"optax's sharded state saved at {saved} ranks, loaded at {at}"
            assert (want["size"], got["size"]) == (saved, at), where
            assert_same(got["params"], want["params"], f"parameters {where}")
            assert_same(got["state"], want["state"], f"state {where}")
        final = pickle.loads(self.chain[2].read_bytes())
        assert_resumed_like_one_process(final, [2, 3, 1])
