"""`dp.checkpoint`: sharded checkpoints in torch DCP's format, at any world size.

The tests without `spawns` run in whatever world pytest runs in (1, 2, 3 ranks; MPI, Gloo): a
round trip of a model, a plain or ZeRO optimizer, a sampler and values, bit for bit; `async_save`
writing the state as it was at the call; a checkpoint without its metadata or a shard file
refused with a message that names what is missing. The `spawns` test runs jobs of other sizes
(tests/scripts/checkpoint_job.py) and takes their steps in its own world of one: saved at 1 rank,
loaded at 2, saved at 2, loaded at 3, saved at 3, loaded at 1; a rank killed while it writes; and
a plain torch program (tests/scripts/plain_dcp.py) reading a checkpoint written here, and writing
one that loads here. The same jobs carry a chain of ZeRO runs that each resume what a world of
another size saved (tests/scripts/zero_resume.py), and optax's sharded state across the same
sizes (`test_checkpoint_optax.CrossSizes`): a job's start costs seconds, so each check rides on
jobs that start anyway.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("dp.checkpoint needs torch", allow_module_level=True)

import _torch_common
import torch
from _jobs import outer_world_size, run_job
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend
from dataparallel.checkpoint import Shards
from dataparallel.checkpoint._shards import flat_boxes

SCRIPTS = Path(__file__).parent / "scripts"
JOB = SCRIPTS / "checkpoint_job.py"
PLAIN = SCRIPTS / "plain_dcp.py"


@pytest.fixture
def folder(world: Backend) -> Iterator[Path]:
    """A folder every rank sees (rank 0 makes it), removed after the test."""
    made = tempfile.mkdtemp(prefix="dp-ckpt-") if dp.rank() == 0 else None
    path = Path(dp.broadcast_object(made))
    yield path / "ckpt"
    dp.barrier()
    if dp.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    stage: Literal[1, 2] = 1 if kind == "zero1" else 2
    return dp.torch.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=stage, bucket_bytes=64, lr=0.01
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dp.rank())
        model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        if not isinstance(opt, dp.torch.ZeroRedundancyOptimizer):
            for p in model.parameters():  # the plain optimizer: every rank the same gradients
                assert p.grad is not None
                p.grad.copy_(dp.allreduce(p.grad, op="avg"))
        opt.step()
        opt.zero_grad()


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    if isinstance(opt, dp.torch.ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=None)
    return opt.state_dict()


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Equal bit for bit, tensors and all."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = [x.reshape(-1).view(torch.uint8) for x in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# -- Shards --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (4, 3), (2, 3, 4), (3, 1, 2, 5)])
def test_flat_boxes_tile_every_range_once_in_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    whole = torch.arange(n).reshape(shape)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            boxes = flat_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            got, at = [], 0
            for (offsets, sizes), first in boxes:
                assert first == at
                box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                got += box.reshape(-1).tolist()
                at += box.numel()
            assert got == list(range(start, stop)), (start, stop)


def test_shards_from_a_flat_slice_are_views_of_it() -> None:
    flat = torch.zeros(5)
    s = Shards.from_flat((4, 3), 3, flat)
    for _, piece in s.pieces:
        piece.fill_(1.0)
    assert flat.tolist() == [1.0] * 5
    with pytest.raises(KeyError, match=r"no piece at offsets \[0, 0\]"):
        s.piece((0, 0))


class ShardedThing:
    """An object of its own whose `state_dict()` holds `Shards`: rank r's rows of a 6 x 2."""

    def __init__(self, fill: float) -> None:
        rows = [r for r in range(6) if r % dp.size() == dp.rank()]
        self.rows = {r: torch.full((1, 2), fill + r) for r in rows}

    def state_dict(self) -> dict[str, Any]:
        pieces = tuple(((r, 0), t) for r, t in self.rows.items())
        return {"table": Shards((6, 2), torch.float32, pieces), "note": "kept"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert isinstance(sd["table"], Shards), type(sd["table"])  # its own boxes, not the whole
        assert sd["note"] == "kept"


def test_an_object_with_shards_in_its_state_dict_loads_its_own_boxes(world: Backend) -> None:
    made = tempfile.mkdtemp(prefix="dp-ckpt-thing-") if dp.rank() == 0 else None
    folder = Path(dp.broadcast_object(made)) / "ckpt"
    dp.checkpoint.save({"thing": ShardedThing(10.0)}, folder)
    fresh = ShardedThing(0.0)
    dp.checkpoint.load({"thing": fresh}, folder)
    for r, t in fresh.rows.items():
        assert t.tolist() == [[10.0 + r] * 2], r
    dp.barrier()
    if dp.rank() == 0:
        shutil.rmtree(folder.parent, ignore_errors=True)


# -- in this world -------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["plain", "zero1", "zero2"])
def test_a_round_trip_is_bit_for_bit(kind: str, folder: Path) -> None:
    model = make_model()
    opt = make_optimizer(model, kind)
    train(model, opt, range(2))
    sampler = dp.elastic.ElasticSampler(list(range(10)), seed=1)
    sampler.record_batch(0, 2)
    extra = np.arange(6.0).reshape(2, 3)
    dp.checkpoint.save(
        {"model": model, "optim": opt, "step": 2, "sampler": sampler, "extra": {"a": extra}},
        folder,
    )
    fresh = make_model(seed=1)
    fresh_opt = make_optimizer(fresh, kind)
    fresh_sampler = dp.elastic.ElasticSampler(list(range(10)), seed=1)
    target = np.zeros((2, 3))
    state: dict[str, Any] = {
        "model": fresh,
        "optim": fresh_opt,
        "step": 0,
        "sampler": fresh_sampler,
        "extra": {"a": target},
    }
    out = dp.checkpoint.load(state, folder)
    assert out is state and state["step"] == 2
    assert_same(fresh.state_dict(), model.state_dict(), "model")
    assert_same(optimizer_state(fresh_opt), optimizer_state(opt), "optim")
    assert fresh_sampler.state_dict() == sampler.state_dict()
    assert target.tolist() == extra.tolist()
    train(model, opt, range(2, 4))  # and both go on alike
    train(fresh, fresh_opt, range(2, 4))
    assert_same(fresh.state_dict(), model.state_dict(), "model after two more steps")


def test_a_zero_checkpoint_loads_into_a_plain_optimizer(folder: Path) -> None:
    model = make_model()
    opt = make_optimizer(model, "zero2")
    train(model, opt, range(2))
    dp.checkpoint.save({"model": model, "optim": opt}, folder)
    plain = make_model(seed=3)
    plain_opt = make_optimizer(plain, "plain")
    dp.checkpoint.load({"model": plain, "optim": plain_opt}, folder)
    assert_same(plain_opt.state_dict(), optimizer_state(opt), "optim")


def fully_sharded(seed: int) -> nn.Module:
    model = make_model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            dp.torch.fully_shard(layer)
    return dp.torch.fully_shard(model)


def test_a_fully_sharded_model_and_its_optimizer_round_trip(folder: Path) -> None:
    """ZeRO-3: each rank writes its rows of the parameters and of their Adam state; loaded
    into a fresh sharded model bit for bit, and whole into a plain model and Adam."""
    if not hasattr(dp.torch, "fully_shard"):
        pytest.skip("dp.torch.fully_shard (ZeRO-3) is not in this tree yet")
    model = fully_sharded(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + dp.rank())
        model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    dp.checkpoint.save({"model": model, "optim": opt, "step": 2}, folder)
    fresh = fully_sharded(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    dp.checkpoint.load({"model": fresh, "optim": fresh_opt, "step": 0}, folder)
    mine = model.parameter_shards()  # type: ignore[operator]
    theirs = fresh.parameter_shards()  # type: ignore[operator]
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert_same(theirs[name].param.detach(), mine[name].param.detach(), name)
    assert_same(fresh_opt.state_dict(), opt.state_dict(), "optim")
    plain = make_model(seed=2)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.5)
    dp.checkpoint.load({"model": plain, "optim": plain_opt}, folder)
    whole = dict(plain.named_parameters())
    plain_state = plain_opt.state_dict()["state"]
    index = {name: i for i, (name, _) in enumerate(plain.named_parameters())}
    sharded_state = opt.state_dict()["state"]
    for k, (name, info) in enumerate(mine.items()):
        rows = tuple(slice(o, o + n) for o, n in zip(info.offsets, info.param.shape, strict=False))
        assert_same(whole[name].detach()[rows], info.param.detach(), name)
        for key, value in sharded_state.get(k, {}).items():
            if value.dim():
                assert_same(plain_state[index[name]][key][rows], value, f"{name} {key}")


def test_async_save_writes_the_state_as_it_was_at_the_call(folder: Path) -> None:
    model = make_model()
    opt = make_optimizer(model, "zero2")
    train(model, opt, range(2))
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = optimizer_state(opt)
    future = dp.checkpoint.async_save({"model": model, "optim": opt, "step": 2}, folder)
    train(model, opt, range(2, 4))  # the state changes while the files are written
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    future.result()
    assert future.done()
    fresh = make_model(seed=1)
    fresh_opt = make_optimizer(fresh, "zero2")
    state = dp.checkpoint.load({"model": fresh, "optim": fresh_opt, "step": 0}, folder)
    assert state["step"] == 2
    assert_same(fresh.state_dict(), want_model, "model")
    assert_same(optimizer_state(fresh_opt), want_optim, "optim")


def test_async_saves_one_after_another_each_write_their_own_state(folder: Path) -> None:
    """The second `async_save` copies into the first's host buffers, after its write."""
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = dp.checkpoint.async_save({"model": model}, folder / "a")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    second = dp.checkpoint.async_save({"model": model}, folder / "b")
    assert first.done()
    second.result()
    fresh = make_model(seed=1)
    dp.checkpoint.load({"model": fresh}, folder / "a")
    assert_same(fresh.state_dict(), before, "first")
    dp.checkpoint.load({"model": fresh}, folder / "b")
    assert_same(fresh.state_dict(), model.state_dict(), "second")


def test_the_next_save_waits_for_an_async_save_in_flight(folder: Path) -> None:
    model = make_model()
    first = dp.checkpoint.async_save({"model": model, "step": 1}, folder)
    dp.checkpoint.save({"model": model, "step": 2}, folder)  # waits for `first` first
    assert first.done()
    assert dp.checkpoint.load({"model": model, "step": 0}, folder)["step"] == 2


class GatedStaging:
    """`async_save`'s copy on its thread held until `release()`: `entered` once it is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from dataparallel.checkpoint import _dcp

        self.entered, self.go = threading.Event(), threading.Event()
        stage = _dcp._SavePlanner.stage

        def gated(planner: Any) -> None:
            self.entered.set()
            assert self.go.wait(60), "the test never released the copy"
            stage(planner)

        monkeypatch.setattr(_dcp._SavePlanner, "stage", gated)

    def release(self) -> None:
        self.go.set()


def test_a_step_after_async_save_waits_for_the_copy(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parameters and the optimizer's state are copied on the save's thread; a step taken
    at once waits for the copy, so the checkpoint holds the state as it was at the call."""
    model = make_model()
    opt = make_optimizer(model, "plain")
    train(model, opt, range(2))
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = copy.deepcopy(optimizer_state(opt))
    gate = GatedStaging(monkeypatch)
    future = dp.checkpoint.async_save({"model": model, "optim": opt}, folder)
    assert gate.entered.wait(60)
    model(torch.ones(4, 5)).pow(2).sum().backward()
    waiting, stepped = threading.Event(), threading.Event()
    staged = future.staged

    def noted(timeout: float | None = None) -> None:
        waiting.set()
        staged(timeout)

    monkeypatch.setattr(future, "staged", noted)

    def step() -> None:
        opt.step()
        stepped.set()

    thread = threading.Thread(target=step)
    thread.start()
    while not (waiting.wait(0.01) or stepped.is_set()):  # the step waits, or it went through
        pass
    gate.release()
    thread.join()
    future.result()
    fresh = make_model(seed=1)
    fresh_opt = make_optimizer(fresh, "plain")
    dp.checkpoint.load({"model": fresh, "optim": fresh_opt}, folder)
    assert_same(fresh.state_dict(), want_model, "model")
    assert_same(optimizer_state(fresh_opt), want_optim, "optim")


def test_a_change_outside_a_step_before_the_copy_fails_the_save(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changed in place before its copy, outside a step: torch's version counter shows it, and
    the save fails on every rank, leaving no checkpoint, rather than write a mixed state."""
    model = make_model()
    opt = make_optimizer(model, "plain")
    train(model, opt, range(1))
    gate = GatedStaging(monkeypatch)
    future = dp.checkpoint.async_save({"model": model, "optim": opt}, folder)
    assert gate.entered.wait(60)
    with torch.no_grad():  # on every rank: one rank writes it (DCP writes a replica once)
        model[0].weight.add_(1.0)
    gate.release()
    with pytest.raises(RuntimeError, match=r"(0\.weight changed in place|rank \d+ failed)"):
        future.result()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        dp.checkpoint.load({"model": model}, folder)


def test_a_copy_failing_on_the_saves_thread_fails_the_save_on_every_rank(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last rank's copy on the save's thread raises: every rank's `result()` raises (the
    others do not wait for it in the write's exchange), and no checkpoint is left."""
    from dataparallel.checkpoint import _dcp

    copy_ = _dcp._SavePlanner._copy

    def failing(planner: Any, item: Any, data: Any) -> Any:
        on_thread = threading.current_thread().name == "dp-checkpoint"
        if on_thread and dp.rank() == dp.size() - 1:
            raise RuntimeError("no host memory left (test)")
        return copy_(planner, item, data)

    monkeypatch.setattr(_dcp._SavePlanner, "_copy", failing)
    model = make_model()
    opt = make_optimizer(model, "plain")
    train(model, opt, range(1))
    future = dp.checkpoint.async_save({"model": model, "optim": opt}, folder)
    with pytest.raises(RuntimeError, match=r"no host memory left \(test\)"):
        future.result()
    with pytest.raises(FileNotFoundError, match=r"did not finish|no such folder|no shard files"):
        dp.checkpoint.load({"model": model}, folder)


def test_a_checkpoint_without_its_metadata_is_refused(folder: Path) -> None:
    model = make_model()
    dp.checkpoint.save({"model": model}, folder)
    dp.barrier()
    if dp.rank() == 0:
        (folder / ".metadata").unlink()
    dp.barrier()
    files = ", ".join(f"__{r}_0\\.distcp" for r in range(min(dp.size(), 4)))
    with pytest.raises(
        FileNotFoundError,
        match=r"\.metadata, which a save writes last.*"
        rf"is missing; it holds {dp.size()} shard file\(s\) \({files}.*\) of a save "
        r"that did not finish",
    ):
        dp.checkpoint.load({"model": model}, folder)


def test_a_checkpoint_missing_a_shard_file_is_refused(folder: Path) -> None:
    model = make_model()
    opt = make_optimizer(model, "zero1")
    train(model, opt, range(1))
    dp.checkpoint.save({"model": model, "optim": opt}, folder)
    dp.barrier()
    last = dp.size() - 1
    if dp.rank() == 0:
        (folder / f"__{last}_0.distcp").unlink()
    dp.barrier()
    with pytest.raises(FileNotFoundError, match=rf"__{last}_0\.distcp \(missing\)"):
        dp.checkpoint.load({"model": model, "optim": opt}, folder)


def test_loading_what_the_checkpoint_lacks_names_it(folder: Path) -> None:
    model = make_model()
    dp.checkpoint.save({"model": model}, folder)
    with pytest.raises(KeyError, match=r"nothing under 'optim'.*holds \['model'\]"):
        dp.checkpoint.load({"model": model, "optim": make_optimizer(model, "plain")}, folder)


def test_no_folder_is_named(world: Backend) -> None:
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*: no such folder"):
        dp.checkpoint.load({}, "/nonexistent/dp-ckpt")


# -- jobs of other sizes -------------------------------------------------------------------------


def job(args: list[Any], ranks: int, backend: str, ok: bool = True) -> str:
    launcher: Literal["python", "run"] = "python" if backend == "plain" else "run"
    done = run_job(
        [JOB if backend != "plain" else PLAIN, *args],
        launcher=launcher,
        ranks=ranks,
        backend=None if backend == "plain" else backend,
        job_timeout=None if backend == "plain" else 200,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, output
    return output


@pytest.mark.spawns
def test_checkpoints_cross_sizes_engines_and_plain_torch(tmp_path: Path) -> None:
    """Each engine saving and loading, to more ranks and to fewer, plain torch's DCP both ways,
    and a save killed midway, in three jobs and this process (a world of one) before and after
    them: a job's start costs seconds, so each checkpoint is checked where a job runs anyway.

    - here (the single engine, one rank) saves S under ZeRO stage 2;
    - Gloo 2 loads S (one saved shard cut in two), saves B, saves K, and saves into K again
      with rank 1 killed while it writes its shards: that job fails, as it must;
    - a plain torch program (no dataparallel, one process) saves P, and loads B (DCP alone:
      the model, the optimizer, the step);
    - MPI 3 loads B (Gloo -> MPI, 2 -> 3: each rank's slices cut across the saved ones) and P
      (plain -> ZeRO), saves A, then loads K, which it must refuse: a folder a job died writing
      is neither the old checkpoint nor the new one;
    - here loads A (MPI -> single, 3 -> 1) and refuses K too.

    Every load gets bit for bit what the saving world consolidated. Along the way, ZeRO runs
    resume one another (`zero-resume`, plain `torch.save` of the consolidated state): Gloo 2
    (stage 1 under DataParallelModel) starts, MPI 3 (stage 2) goes on with more and uneven
    shards, then this process (one shard); the end matches one process's Adam on the whole
    batches throughout. The Gloo 2 and MPI 3 jobs, and this process, carry optax's sharded state
    across the same sizes too (`test_checkpoint_optax.CrossSizes`), where optax is installed.
    """
    if outer_world_size() > 1:
        pytest.skip("launches its own jobs: run this file in a world of one")
    here = import_script("checkpoint_job")
    s, a, b, k, p = (tmp_path / name for name in ("s", "a", "b", "k", "p"))
    ref = {name: tmp_path / f"{name}.pt" for name in ("s", "a", "b", "k", "p")}
    got = tmp_path / "got"
    got.mkdir()
    z = {name: tmp_path / f"zero-{name}.pt" for name in ("gloo-2", "mpi-3", "1")}
    optax = optax_cross_sizes(tmp_path)
    here.step("save", s, ref["s"], 2, None)
    if optax:
        optax.before()
    gloo_2 = ["load", s, got / "s-gloo-2.pt", "zero-resume", "-", z["gloo-2"]]
    gloo_2 += optax.steps(2) if optax else []
    died = job(
        [*gloo_2, "save", b, ref["b"], "save", k, ref["k"], "--die-rank", "1"], 2, "gloo", ok=False
    )
    assert (got / "s-gloo-2.pt").exists() and ref["k"].exists(), died  # all before the kill
    assert (k / "__0_0.distcp").exists()  # the first save into K was complete
    job(["save", p, ref["p"], "load", b, got / "b-plain.pt"], 1, "plain")
    mpi_3 = ["load", b, got / "b-mpi-3.pt", "load-plain", p, got / "p-mpi-3.pt"]
    mpi_3 += ["zero-resume", z["gloo-2"], z["mpi-3"], "save", a, ref["a"]]
    mpi_3 += optax.steps(3) if optax else []
    refused = job([*mpi_3, "load", k, got / "k.pt"], 3, "mpi", ok=False)
    assert "did not finish" in refused
    assert ref["a"].exists() and not (got / "k.pt").exists(), refused
    here.step("load", a, got / "a-1.pt", 2, None)
    with pytest.raises(FileNotFoundError, match="did not finish"):
        dp.checkpoint.load({"model": make_model()}, k)
    assert_zero_resumed_like_one_process(z["mpi-3"], z["1"])

    def load(path: Path) -> Any:
        return torch.load(path, weights_only=False)

    want = {name: load(path) for name, path in ref.items()}
    for name, saved in (("s-gloo-2", "s"), ("b-mpi-3", "b"), ("a-1", "a")):
        assert_same(load(got / f"{name}.pt"), want[saved], f"{saved} loaded as {name}")
    for name, saved in (("b-plain", "b"), ("p-mpi-3", "p")):  # the model, the optimizer, the step
        plain = load(got / f"{name}.pt")
        assert_same(plain["model"], want[saved]["model"], f"model ({name})")
        assert_same(plain["optim"], want[saved]["optim"], f"optim ({name})")
        assert plain["step"] == want[saved]["step"]
    if not optax:
        pytest.skip("torch's checkpoints crossed; optax's sharded state left out: no optax")
    optax.after()


def optax_cross_sizes(folder: Path) -> Any:
    """`test_checkpoint_optax.CrossSizes` in `folder`, or None where JAX or optax is missing."""
    if any(importlib.util.find_spec(name) is None for name in ("jax", "optax")):
        return None
    from test_checkpoint_optax import CrossSizes

    return CrossSizes(folder)


def import_script(name: str) -> Any:
    """Import `tests/scripts/NAME.py`, to take its steps in this process (a world of one)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_zero_resumed_like_one_process(previous: Path, last: Path) -> None:
    """Resume `previous` here (a world of one), then check the chain of `zero-resume` steps
    against one process's Adam on the whole batches, every step."""
    import_script("zero_resume").resume(str(previous), last)
    final = torch.load(last, weights_only=False)
    sizes = json.loads(final["sizes"])
    assert sizes == [2, 3, 1], f"ZeRO resume chain: the world sizes were {sizes}"
    assert final["steps"] == 2 * len(sizes), f"ZeRO resume chain: {final['steps']} steps"
    model = _torch_common.make_model()
    ref_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(final["steps"]):
        x, y = _torch_common.global_batch(step)
        ref_opt.zero_grad()
        _torch_common.loss_of(model, x, y).backward()
        ref_opt.step()
    where = "ZeRO resumed through Gloo 2, MPI 3, one rank"
    for name, value in model.state_dict().items():
        torch.testing.assert_close(
            final["model"][name],
            value,
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, n=name: f"{where}: parameter {n}: {m}",
        )
    for k, entry in ref_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                final["optimizer"]["state"][k][key],
                value,
                atol=1e-5,
                rtol=1e-4,
                msg=lambda m, k=k, key=key: f"{where}: optimizer state {k}.{key}: {m}",
            )
