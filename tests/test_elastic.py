"""dp.elastic's pieces that need no launcher: the sampler's exactly-once split, the states'
save/restore/sync, and `elastic.run` outside an elastic run. Runs at any world size (sync
and the errors go through real collectives); the runs with a launcher are in test_elastic_runs.py.
The pieces in which no rank takes part (the sampler's arithmetic, the liveness watch on a store
of its own) run in the world of one only (`alone`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from _jobs import outer_world_size
from hypothesis import given
from hypothesis import strategies as st

import dataparallel as dp

if TYPE_CHECKING:
    import torch

from dataparallel.elastic import (
    ElasticSampler,
    HostsUpdatedInterrupt,
    ObjectState,
    TorchState,
    TreeState,
)


@pytest.fixture(autouse=True)
def _world() -> None:
    dp.initialize()


# Each rank of a multi-rank pass would run these alike and alone, the watch's waits included.
alone = pytest.mark.skipif(
    outer_world_size() > 1, reason="no rank takes part: runs in the world of one"
)


@alone
@given(
    samples=st.integers(1, 40),
    batch=st.integers(1, 5),
    plan=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 4)), min_size=1, max_size=6),
    shuffle=st.booleans(),
)
def test_every_sample_once_per_epoch_across_resplits(
    samples: int, batch: int, plan: list[tuple[int, int]], shuffle: bool
) -> None:
    """Worlds of sizes `plan[i][0]` each commit `plan[i][1]` global steps, then the world changes
    (uncommitted steps are lost with it); the last world finishes the epoch. Every sample is in
    exactly one committed step, and each step's batches are the ranks' `get_indices`."""
    committed: list[int] = []
    saved = ElasticSampler(range(samples), shuffle=shuffle, seed=3).state_dict()
    for number, (size, steps) in enumerate(plan):
        last = number == len(plan) - 1
        ranks = [ElasticSampler(range(samples), shuffle=shuffle, seed=3) for _ in range(size)]
        for r, sampler in enumerate(ranks):
            sampler.load_state_dict(saved)
            sampler.resplit(size, r)
        todo = ranks[0].steps(batch)
        assert all(s.steps(batch) == todo for s in ranks)
        for b in range(todo if last else min(steps, todo)):
            shares = [s.get_indices(b, batch) for s in ranks]
            assert sorted(itertools.chain(*shares)) == sorted(ranks[0].global_indices(b, batch))
            committed += itertools.chain(*shares)
            for sampler in ranks:
                sampler.record_batch(b, batch)
            assert len({frozenset(s.processed_indices) for s in ranks}) == 1
        saved = ranks[0].state_dict()
        # a step taken after the commit and lost with the world changes nothing saved
    assert sorted(committed) == list(range(samples))


@alone
def test_sampler_shares_differ_by_one_at_most_and_never_repeat() -> None:
    sampler = ElasticSampler(range(10), shuffle=False)
    shares = []
    for r in range(4):
        sampler.resplit(4, r)
        shares.append(list(sampler))
    assert [len(s) for s in shares] == [3, 3, 2, 2]
    assert sorted(itertools.chain(*shares)) == list(range(10))
    sampler.resplit(4, 3)
    assert sampler.steps(2) == 2 and sampler.get_indices(1, 2) == []  # no last batch there
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and not sampler.processed_indices


@alone
@pytest.mark.parametrize("habit", ["start", "end"])
def test_set_epoch_of_the_epoch_in_progress_keeps_its_record(habit: str) -> None:
    """Both habits of the epoch loop, in one process: a re-entry after a roll-back (the record
    restored from the commit) calls `set_epoch` with the epoch in progress (start) or not at all
    (end); each epoch's samples are then taken exactly once."""
    sampler = ElasticSampler(range(11), seed=2)
    epoch, taken, failed = 0, [], False
    saved = (epoch, sampler.state_dict())
    while epoch < 2:
        if habit == "start":
            sampler.set_epoch(epoch)
        for b in range(sampler.steps(2)):
            if epoch == 1 and b == 1 and not failed:  # a worker lost: roll back, enter again
                failed = True
                epoch, state = saved
                sampler.load_state_dict(state)
                taken = [t for t in taken if t[2]]  # the steps since the commit are undone
                break
            taken += [(epoch, i, False) for i in sampler.global_indices(b, 2)]
            sampler.record_batch(b, 2)
            if b == 0:  # commit
                saved = (epoch, sampler.state_dict())
                taken = [(e, i, True) for e, i, _ in taken]
        else:
            epoch += 1
            if habit == "end":
                sampler.set_epoch(epoch)
            saved = (epoch, sampler.state_dict())
            taken = [(e, i, True) for e, i, _ in taken]
    assert failed
    for e in (0, 1):
        assert sorted(i for t, i, _ in taken if t == e) == list(range(11)), e


@alone
def test_set_epoch_of_another_epoch_starts_it_afresh() -> None:
    sampler = ElasticSampler(range(6), shuffle=False)
    sampler.record_indices([0, 1])
    sampler.set_epoch(0)  # the epoch in progress: its record is kept
    assert sampler.processed_indices == {0, 1} and sampler.remaining_indices == [2, 3, 4, 5]
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and not sampler.processed_indices
    assert sampler.remaining_indices == list(range(6))
    sampler.record_indices([5])
    sampler.set_epoch(0)  # an epoch number again: a new pass over it
    assert sampler.epoch == 0 and sampler.remaining_indices == list(range(6))


def test_object_state_restores_the_last_commit() -> None:
    state = ObjectState(epoch=0, history=[], w=np.zeros(2))
    state.epoch, state.w = 1, state.w + 1
    state.history.append("step 1")
    state.commit()
    state.epoch, state.w = 2, state.w + 1
    state.history.append("step 2")  # mutated in place: the saved copy must not see it
    state.restore()
    assert state.epoch == 1 and state.history == ["step 1"]
    np.testing.assert_array_equal(state.w, [1.0, 1.0])


def test_torch_state_restores_model_optimizer_and_sampler() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(8), shuffle=False)
    state = TorchState(model, optimizer, sampler=sampler, epoch=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    sampler.record_batch(0, 2)
    state.restore()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert optimizer.state_dict()["state"] == {} and not sampler.processed_indices
    assert state.model is model and state.optimizer is optimizer


def test_sync_gives_every_rank_rank_0s_state() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(dp.rank())  # a different model on each rank
    model = torch.nn.Linear(3, 2)
    state = TorchState(model, epoch=dp.rank() + 10)
    tree = TreeState(params={"w": np.full(3, float(dp.rank()))}, step=dp.rank())
    state.sync()
    tree.sync()
    weights = dp.allgather_object(model.weight.detach().numpy().copy())
    assert all(np.array_equal(w, weights[0]) for w in weights)
    assert state.epoch == 10 and tree.step == 0
    np.testing.assert_array_equal(tree.params["w"], np.zeros(3))


def test_an_attribute_that_cannot_be_saved_or_sent_is_named() -> None:
    with pytest.raises(TypeError, match="'lock'"):
        ObjectState(lock=threading.Lock())
    state = ObjectState(epoch=0)
    state.epoch = threading.Lock()  # type: ignore[assignment]  # rank 0 cannot pickle it
    with pytest.raises(TypeError, match="'epoch' cannot be sent"):
        state.sync()


def test_run_outside_an_elastic_run_lets_errors_through() -> None:
    calls = []

    @dp.elastic.run
    def train(state: ObjectState, error: type[BaseException]) -> None:
        calls.append(state.epoch)
        raise error("boom") if error is not HostsUpdatedInterrupt else error()

    state = ObjectState(epoch=0)
    with pytest.raises(dp.RankFailedError):
        train(state, dp.RankFailedError)
    with pytest.raises(HostsUpdatedInterrupt):
        train(state, HostsUpdatedInterrupt)
    assert calls == [0, 0]
    state.commit()  # no launcher: no host updates to check


def test_a_worker_that_can_join_no_world_leaves_the_elastic_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`elastic.run` rolls back and re-forms on a lost rank; when re-forming finds no round
    (`NoWorldError`: none opened within the timeout) the error goes through. It used to be a
    `RankFailedError`, caught again: the worker waited for a round for ever."""
    from dataparallel.elastic import rounds
    from dataparallel.elastic.retry import run_fn

    monkeypatch.setattr(rounds, "_current", rounds.Round(0, ("w0",), "w0"))
    calls: list[int] = []

    def train(state: ObjectState) -> None:
        calls.append(state.epoch)
        state.epoch += 1
        raise dp.RankFailedError("a peer was lost")

    def reset() -> None:
        raise rounds.NoWorldError("no new world formed")

    state = ObjectState(epoch=0)
    with pytest.raises(rounds.NoWorldError, match="no new world formed"):
        run_fn(train, reset)(state)
    assert calls == [0] and state.epoch == 0  # rolled back once, then out


class _Reports:
    """The launcher's store as `rounds.report_split` uses it: the values pushed, by queue."""

    def __init__(self) -> None:
        self.queues: dict[str, list[str]] = {}

    def queue_push(self, key: str, value: str) -> None:
        self.queues.setdefault(key, []).append(value)


@pytest.mark.parametrize("route", ["callback", "ffi"])
def test_a_link_lost_inside_a_jitted_step_is_reported_as_a_split(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's `LinkLostError` raised inside XLA (a jitted step's host callback or FFI
    call) comes out of JAX as its own `JaxRuntimeError`, with the text only: `elastic.run`
    still tells the launcher the lost peer's address (a possible split), or the launcher would
    wait for the elastic timeout."""
    import json

    jax = pytest.importorskip("jax")
    from jax.experimental import io_callback

    from dataparallel.elastic import liveness, rounds
    from dataparallel.elastic.retry import run_fn
    from dataparallel.jax._ffi import ffi_reason, reduce_ffi

    if route == "ffi" and ffi_reason() is not None:
        pytest.skip(str(ffi_reason()))
    address = "192.0.2.7"  # TEST-NET-1: no host of the test's

    def lose(*_: object) -> None:
        raise dp.LinkLostError(f"Gloo allreduce lost its link to {address} ({route})", address)

    if route == "ffi":
        step = jax.jit(lambda x: reduce_ffi([x * 1.0], lose, [True], key="lose")[0])
    else:
        shape = jax.ShapeDtypeStruct((3,), jax.numpy.float32)
        step = jax.jit(lambda x: io_callback(lose, shape, x, ordered=True))
    reports = _Reports()
    monkeypatch.setattr(rounds, "_current", rounds.Round(4, ("w0", "w1"), "w0"))
    monkeypatch.setattr(rounds, "_client", reports)

    def train(state: ObjectState) -> None:
        jax.block_until_ready(step(jax.numpy.ones(3)))

    def reset() -> None:
        raise rounds.NoWorldError("no new world formed")

    with pytest.raises(rounds.NoWorldError):
        run_fn(train, reset)(ObjectState(epoch=0))
    said = [json.loads(report) for report in reports.queues.get(liveness.SPLITS, [])]
    assert said == [{"round": 4, "worker": "w0", "address": address}], reports.queues


def test_check_host_updates_outside_an_elastic_run_does_nothing() -> None:
    ObjectState(epoch=0).check_host_updates()


def test_import_dataparallel_does_not_load_elastic() -> None:
    import subprocess
    import sys

    code = "import sys, dataparallel; print('dataparallel.elastic' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_tree_state_carries_an_optax_state() -> None:
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    params = {"w": jnp.full(3, float(dp.rank())), "b": jnp.zeros(())}
    optimizer = optax.adam(0.1)
    state = TreeState(params=params, opt_state=optimizer.init(params), step=0)
    state.sync()  # rank 0's everywhere
    updates, state.opt_state = optimizer.update(
        {"w": jnp.ones(3), "b": jnp.ones(())}, state.opt_state
    )
    state.params = optax.apply_updates(state.params, updates)
    state.commit()
    committed = (np.asarray(state.params["w"]), int(state.opt_state[0].count))
    state.params = {"w": state.params["w"] + 5, "b": state.params["b"]}
    state.restore()
    np.testing.assert_array_equal(np.asarray(state.params["w"]), committed[0])
    assert committed[1] == 1 and int(state.opt_state[0].count) == 1
    np.testing.assert_allclose(committed[0], np.full(3, -0.1), rtol=1e-4)  # adam: lr * sign


def _zero_run(stage: int) -> tuple[torch.nn.Module, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    zero = dp.torch.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=stage, lr=0.05, bucket_bytes=16
    )
    return model, zero


def _zero_steps(model: torch.nn.Module, zero: Any, steps: range) -> None:
    import torch

    net = dp.torch.DataParallelModel(model) if zero.stage == 1 else model
    for step in steps:
        g = torch.Generator().manual_seed(10 * step + dp.rank())
        zero.zero_grad()
        net(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        zero.step()


def _whole(zero: Any) -> dict[str, Any]:
    zero.consolidate_state_dict(to=None)
    return copy.deepcopy(zero.state_dict())


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_state_commits_restores_and_rebinds_a_zero_optimizer(stage: int) -> None:
    """`TorchState(model, ZeroRedundancyOptimizer)`: a commit consolidates the state on every
    rank, `restore()` puts each rank's slice of it back, and after the optimizer is laid out
    again (`rebind_world`, what a re-form does) `sync()` loads rank 0's commit into the new
    slices; the run then steps as the uninterrupted one does."""
    torch = pytest.importorskip("torch")
    model, zero = _zero_run(stage)
    state = TorchState(model, zero)
    _zero_steps(model, zero, range(2))
    state.commit()
    committed = _whole(zero)
    params = [p.detach().clone() for p in model.parameters()]
    _zero_steps(model, zero, range(2, 4))
    assert not _same(_whole(zero)["state"], committed["state"])
    state.restore()
    assert _same(_whole(zero)["state"], committed["state"])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    zero.rebind_world()
    assert not zero.optim.state  # laid out again: empty until the commit is loaded
    state.sync()
    assert _same(_whole(zero)["state"], committed["state"])
    _zero_steps(model, zero, range(2, 4))
    after = [p.detach().clone() for p in model.parameters()]

    model, zero = _zero_run(stage)  # the same run, never rolled back
    _zero_steps(model, zero, range(4))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after, strict=True))


def test_a_zero_state_never_committed_cannot_be_carried_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ZeRO optimizer with state before the first commit keeps only its slice: a re-form
    then (another round) says so on every rank, instead of loading part of a state."""
    pytest.importorskip("torch")
    from dataparallel.elastic import state as state_module

    model, zero = _zero_run(2)
    _zero_steps(model, zero, range(1))
    state = TorchState(model, zero)
    monkeypatch.setattr(state_module, "_generation", lambda: 1)
    with pytest.raises(RuntimeError, match=r"before the ZeroRedundancyOptimizer's state was ever"):
        state.sync()
    state.commit()  # a commit makes it whole: the same re-form now carries it
    state.sync()


def _sharded_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fully sharded MLP of odd widths (padded chunks, ranks with no rows) and a scalar
    parameter (held by rank 0 alone), with Adam over its shards."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model.register_parameter("gain", torch.nn.Parameter(torch.tensor(1.5)))
    for block in (model[0], model[2]):
        dp.torch.fully_shard(block)
    dp.torch.fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _sharded_steps(model: Any, opt: Any, steps: range) -> None:
    import torch

    for step in steps:
        g = torch.Generator().manual_seed(10 * step + dp.rank())
        opt.zero_grad()
        (model(torch.randn(3, 4, generator=g)).pow(2).mean() * model.gain).backward()
        opt.step()


def _rows(model: Any, opt: Any) -> list[Any]:
    """This rank's shards and their Adam state, copied."""
    out = []
    for shard in model.parameter_shards().values():
        state = {k: v.clone() for k, v in opt.state.get(shard.param, {}).items()}
        out.append([shard.param.detach().clone(), list(shard.offsets), state])
    return out


def test_torch_state_carries_a_fully_sharded_model_and_its_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`TorchState(fully_shard model, Adam)`: `restore()` puts each rank's committed rows and
    their Adam state back; after a re-form (here another round of the same size) `sync()` lays
    every shard out again and fills it from the ranks' commits; the run then steps as the
    uninterrupted one does, bit for bit."""
    torch = pytest.importorskip("torch")
    from dataparallel.elastic import state as state_module

    model, opt = _sharded_run()
    state = TorchState(model, opt, step=0)
    _sharded_steps(model, opt, range(2))
    state.commit()
    committed = _rows(model, opt)
    _sharded_steps(model, opt, range(2, 4))
    assert not _same(_rows(model, opt), committed)
    state.restore()
    assert _same(_rows(model, opt), committed)
    monkeypatch.setattr(state_module, "_generation", lambda: 1)
    state.sync()
    assert _same(_rows(model, opt), committed)
    _sharded_steps(model, opt, range(2, 4))
    after = _rows(model, opt)

    model, opt = _sharded_run()  # the same run, never rolled back
    _sharded_steps(model, opt, range(4))
    assert _same(_rows(model, opt), after)
    assert all(isinstance(p, torch.Tensor) for p, _, _ in after)


@alone
def test_the_holders_of_a_lost_ranks_rows() -> None:
    """Each commit copies a rank's rows to the rank before it: a lost rank's rows are found
    there, and two neighbours lost at once (or copies never made) are said, not loaded in
    part."""
    pytest.importorskip("torch")
    from dataparallel.torch._zero.carry import holders

    # old ranks 0 and 2 of 3 survive as new ranks 0 and 1: old 1's rows are old 0's copy
    assert holders([(0, 3, True), (2, 3, True)]) == {0: (0, "own"), 1: (0, "next"), 2: (1, "own")}
    # a newcomer (None) holds nothing; old 0's rows come from old 2 (the rank before it)
    assert holders([(1, 3, True), (2, 3, True), None]) == {
        0: (1, "next"),
        1: (0, "own"),
        2: (1, "own"),
    }
    with pytest.raises(RuntimeError, match="rank 1 of 3 held are on no surviving worker"):
        holders([(0, 3, False), (2, 3, False)])  # never committed: no copies
    with pytest.raises(RuntimeError, match="rank 2 of 4 held are on no surviving worker"):
        holders([(0, 4, True), (3, 4, True)])  # 1 and 2 lost together


_SERVE = """
import socket, sys
servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
print(*(s.getsockname()[1] for s in servers), flush=True)
peers = [s.accept()[0] for s in servers]
for peer in peers:
    print(repr(peer.recv(1)), flush=True)
"""


_CUT = """
import json, socket, sys, threading
from dataparallel.backends.connections import cut_connections
peer_port, store_port = map(int, sys.argv[1:3])
peer = socket.create_connection(("127.0.0.1", peer_port), timeout=60)
store = socket.create_connection(("127.0.0.1", store_port), timeout=60)
got = []
reader = threading.Thread(target=lambda: got.append(peer.recv(1)))
reader.start()
nowhere = cut_connections({"10.255.255.1"})
cut = cut_connections({"127.0.0.1"}, keep=("127.0.0.1", store_port))
reader.join(timeout=60)
store.sendall(b"s")
print(json.dumps({"nowhere": nowhere, "cut": cut, "got": [g.decode() for g in got]}))
"""


@alone
def test_cut_connections_wakes_a_reader_and_keeps_the_store() -> None:
    """The cut of a peer behind a dead link (`elastic.liveness`): a thread blocked reading a
    connection to the address wakes with the stream's end, at once; the store's stays open.

    The cut runs in a process of its own: it cuts every connection of its process to the
    address, and a rank of a multi-rank test pass holds its engine's connections to 127.0.0.1."""
    import json
    import subprocess
    import sys

    with subprocess.Popen(
        [sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None
        peer_port, store_port = server.stdout.readline().split()
        cutter = subprocess.run(
            [sys.executable, "-c", _CUT, peer_port, store_port],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cutter.returncode == 0, cutter.stderr
        said = json.loads(cutter.stdout.splitlines()[-1])
        assert said["nowhere"] == 0  # no connection there
        assert said["cut"] == 1  # the peer's; the store's is kept
        assert said["got"] == [""]  # the end of the stream, as if the peer had closed it
        assert server.stdout.readline() == "b''\n"  # the peer's end saw the cut too
        assert server.stdout.readline() == "b's'\n"  # the store's connection still carries
    assert server.returncode == 0


_WATCHED_EXIT = """
import datetime, os, sys, time
from dataparallel.backends.gloo.group import import_torch_distributed
from dataparallel.backends.connections import tcp_sockets
from dataparallel.config import Settings
from dataparallel.backends.connections import tcp_sockets
from dataparallel.elastic import liveness, rounds

dist = import_torch_distributed()
server = dist.TCPStore(
    sys.argv[1], 0, is_master=True, wait_for_workers=False,
    timeout=datetime.timedelta(seconds=60),
)
port = server.port
settings = Settings(elastic_store=(sys.argv[1], port), elastic_worker="w0")
def connections():
    return sum(remote[1] == port for _, remote in tcp_sockets())


client = dist.TCPStore(
    sys.argv[1], port, is_master=False, wait_for_workers=False,
    timeout=datetime.timedelta(seconds=60),
)
before = connections()  # the server's own client and the worker's
liveness.watch(settings, 0, lambda: (0, ("w0",)), client)
# The watch's own connection to the store shows in this process's sockets once it is made.
deadline = time.monotonic() + 60
while connections() == before and time.monotonic() < deadline:
    time.sleep(0.01)
names = [t.name for t in __import__("threading").enumerate()]
print(",".join(names), flush=True)


class Waker:
    # Opens rounds while the interpreter finalizes, as the launcher may at the end of a run:
    # a thread of the watch still inside the store's C++ then wakes after Python has gone.
    def __init__(self, store, sleep, publish):
        self.store, self.sleep, self.publish = store, sleep, publish

    def __del__(self):
        for generation in range(1, 6):
            self.publish(self.store, generation, ["w0"], ["w9"], True)  # a notice to w0
            self.sleep(0.2)


module = type(sys)("waker")
module.waker = Waker(dist.TCPStore(
    sys.argv[1], port, is_master=False, wait_for_workers=False,
    timeout=datetime.timedelta(seconds=60),
), time.sleep, rounds.publish)
sys.modules["waker"] = module  # the last module in: its globals go first as Python finalizes
"""


@pytest.mark.spawns
def test_a_worker_whose_watch_runs_exits_cleanly_while_rounds_open() -> None:
    """A worker's watch over the hosts (`elastic.liveness`) runs a thread beside the script: it
    must be out of the store's C++ before the interpreter finalizes, or a round opened then
    (the launcher goes on while a worker ends) wakes it into a finalized Python, and the worker
    dies of SIGABRT after a run that went well. Several workers, each one's exit raced by
    rounds opening."""
    import socket
    import subprocess
    import sys

    from dataparallel.backends.rendezvous import interface_address

    addresses = [interface_address(name) for _, name in socket.if_nameindex()]
    outside = [a for a in addresses if a is not None and not a.startswith("127.")]
    if not outside:
        pytest.skip("no network interface but loopback: the watch runs across hosts only")
    for _ in range(3):
        worker = subprocess.run(
            [sys.executable, "-c", _WATCHED_EXIT, outside[0]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert worker.returncode == 0, worker.stderr
        assert "dataparallel-rounds" in worker.stdout, worker.stdout  # the watch did run


@alone
def test_heartbeats_find_a_worker_silent_for_the_link_timeout() -> None:
    """The launcher's ear (`elastic.liveness.Heartbeats`) on a real store: a worker that beats is
    heard, one whose counter stands still for the limit is said silent (once, with how long),
    one that never beat or that left (its watch stopped at exit) never is."""
    import datetime
    import time

    from dataparallel.backends.gloo.group import import_torch_distributed
    from dataparallel.elastic.liveness import LEFT, Heartbeats, heartbeat_key

    dist = import_torch_distributed()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    ear = Heartbeats(0.3)
    workers = ["w0", "w1", "w2", "w3"]  # w0 beats on, w1 falls silent, w2 never beats, w3 leaves
    for worker in ("w0", "w1", "w3"):
        store.add(heartbeat_key(worker), 1)
    assert ear.silent(store, workers) == {}
    store.set(heartbeat_key("w3"), LEFT)
    begun = time.monotonic()
    said: dict[str, float] = {}
    while not said and time.monotonic() - begun < 30:  # a guard: w1 is said silent soon
        store.add(heartbeat_key("w0"), 1)
        said = ear.silent(store, workers)
        time.sleep(0.02)
    assert list(said) == ["w1"], said
    assert 0.3 <= said["w1"] <= time.monotonic() - begun + 0.3
    store.add(heartbeat_key("w1"), 1)  # beats again (a stalled worker): said once only
    assert ear.silent(store, workers) == {}
    # One round trip reads every counter heard before; one not yet heard is checked first.
    counted = _Counted(store)
    store.add(heartbeat_key("w2"), 1)  # w2 begins to beat
    assert ear.silent(counted, workers) == {}
    assert counted.calls == ["check", "multi_get"], counted.calls
    counted.calls.clear()
    assert ear.silent(counted, workers) == {}
    assert counted.calls == ["multi_get"], counted.calls


class _Counted:
    """A store that notes the name of each call made through it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.store, name)


@alone  # seconds of waiting on a store of its own
def test_a_worker_outlasts_a_store_stalled_past_the_link_timeout_but_not_past_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store probe of a worker on another host (`elastic.liveness._probe`) under a short
    link timeout S = 0.5 s: a store that stops accepting connections (stalled: its backlog full,
    each probe's connect times out) for more than 2 S, then answers again, does not make the
    worker leave; one that stays stalled does, after `silence_limit(S)` (5 s) and not before.
    The launcher's heartbeats decide a loss within S; the worker leaving at S took a busy
    machine's late replies for a cut link."""
    import socket
    import time

    from dataparallel.config import silence_limit
    from dataparallel.elastic import liveness

    link_timeout = 0.5
    limit = silence_limit(link_timeout)
    assert limit >= 4 * link_timeout
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # one connection waits to be accepted; the next connects time out
    listener.settimeout(0.05)
    store_at = listener.getsockname()
    answering, idle, stop = threading.Event(), threading.Event(), threading.Event()
    answering.set()

    def serve() -> None:  # the store: accepts while answering, stalls otherwise
        while not stop.is_set():
            if not answering.is_set():
                idle.set()
                time.sleep(0.01)
                continue
            idle.clear()
            with contextlib.suppress(TimeoutError):
                listener.accept()[0].close()

    probes: list[tuple[float, bool]] = []  # each probe's end and whether it connected
    connect = socket.create_connection

    def probing(*args: Any, **kwargs: Any) -> socket.socket:
        try:
            made = connect(*args, **kwargs)
        except OSError:
            probes.append((time.monotonic(), False))
            raise
        probes.append((time.monotonic(), True))
        return made

    left: list[float] = []
    monkeypatch.setattr(liveness, "_stop", threading.Event())
    monkeypatch.setattr(liveness.socket, "create_connection", probing)
    monkeypatch.setattr(liveness, "_leave", lambda _at, silent, _worker: left.append(silent))

    def wait_for(done: Any, what: str) -> None:
        guard = time.monotonic() + 60  # a hang guard, far past every step
        while not done():
            assert time.monotonic() < guard, f"never: {what} (probes {probes}, left {left})"
            time.sleep(0.01)

    def answered_after(moment: float) -> bool:
        return any(ok and at > moment for at, ok in probes)

    def stall() -> tuple[float, socket.socket]:
        answering.clear()
        wait_for(idle.is_set, "the store stalled")
        return time.monotonic(), connect(store_at)  # fills the backlog: probes time out

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    probe = threading.Thread(target=liveness._probe, args=(store_at, link_timeout, "w1"))
    probe.start()
    try:
        wait_for(lambda: answered_after(0.0), "a first answer")
        stalled, filler = stall()
        wait_for(
            lambda: any(not ok and at - stalled > 2 * link_timeout for at, ok in probes),
            "a probe unanswered more than 2 S into the stall",
        )
        assert not answered_after(stalled)  # the stall held: no probe got through meanwhile
        filler.close()
        answering.set()
        wait_for(lambda: answered_after(stalled), "an answer after the stall")
        assert left == [], f"left after a {time.monotonic() - stalled:.1f} s stall: {left}"
        stalled, filler = stall()
        wait_for(lambda: left, "leaving once the store stays stalled")
        filler.close()
        assert limit <= left[0] <= time.monotonic() - stalled + 1.0, left
    finally:
        liveness._stop.set()
        stop.set()
        probe.join(timeout=30)
        server.join(timeout=30)
        listener.close()


_FOLLOWER = """
import datetime, json, socket, sys, threading
from dataparallel.backends.gloo.group import import_torch_distributed
from dataparallel.elastic import liveness

dist = import_torch_distributed()
at = ("127.0.0.1", int(sys.argv[1]))
listener = socket.create_server(("127.0.0.1", 0))
peer = socket.create_connection(listener.getsockname())  # as a Gloo connection to w1
accepted, _ = listener.accept()
got = []
reader = threading.Thread(target=lambda: got.append(peer.recv(1).decode()))
reader.start()
world = lambda: (0, ("w0", "w1"))  # this worker's world: round 0, with w1
follower = threading.Thread(target=liveness._follow, args=(at, 0, world, "w0"))
follower.start()
print("following", flush=True)
reader.join(timeout=60)
liveness._stop.set()
client = dist.TCPStore(*at, is_master=False, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=60))
client.queue_push(liveness.notice_key("w0"), b"")  # as at exit: the follower's wait ends
follower.join(timeout=60)
print(json.dumps({"got": got, "followed": follower.is_alive()}), flush=True)
"""


@alone
def test_a_round_listing_a_member_lost_by_its_link_wakes_the_follower_to_cut_it() -> None:
    """A worker's round follower (`elastic.liveness._follow`) waits on its notice queue, which
    the launcher's publication of a round that lists workers lost by their link fills
    (`rounds.publish`): such a round makes it cut its connections to the address of the member
    of its world it lists (a reader blocked on one wakes with the stream's end); the worker's
    own empty notice ends the wait.

    The cut runs in a process of its own: it cuts every connection of its process to the
    address, and a rank of a multi-rank test pass holds its engine's connections to 127.0.0.1;
    the store stays here, so that the cut cannot reach the store's own side."""
    import datetime
    import json
    import subprocess
    import sys

    from dataparallel.backends.gloo.group import import_torch_distributed
    from dataparallel.elastic import liveness, rounds

    dist = import_torch_distributed()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    store.set(liveness.address_key("w1"), "127.0.0.1")
    with subprocess.Popen(
        [sys.executable, "-c", _FOLLOWER, str(store.port)], stdout=subprocess.PIPE, text=True
    ) as worker:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "following\n"
        rounds.publish(store, 1, ["w0", "w1", "w2"], [], notify=True)  # w2 joins: no notice
        rounds.publish(store, 2, ["w0"], ["w1"], notify=True)  # w1 lost by its link
        said = json.loads(worker.stdout.readline())
    assert worker.returncode == 0
    assert said == {"got": [""], "followed": False}, said


class _Check:
    """The launcher's store as `rounds._unconnected` asks it: which keys are there."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def check(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)


@alone
def test_a_group_missing_its_connect_limit_while_every_member_answers_names_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Gloo group of an elastic round that did not connect within the round's limit, while
    every member's host answers (`forming.unreached` finds none out of reach) and the launcher
    opened no next round, ends the worker at once with `NoWorldError` naming the group: no
    round would ever form otherwise. Where the launcher opened the next round (a member was
    lost), the worker goes on to it (`RankFailedError`)."""
    from dataparallel.config import Settings
    from dataparallel.elastic import rounds

    chosen = rounds.Round(3, ("w0", "w1"), "w0")
    settings = Settings(link_timeout=0.5)
    refused = RuntimeError("Connect timeout [10.0.0.2]:40001\nmore of torch's text")
    monkeypatch.setattr(rounds, "_watched", _Check(set()))  # read no address: none unreached

    error = rounds._unconnected(_Check(set()), chosen, settings, refused, "the group of ranks [0]")
    assert isinstance(error, rounds.NoWorldError), error
    said = str(error)
    assert said.startswith("the group of ranks [0] (Gloo, round 3, members w0, w1)"), said
    assert "Connect timeout [10.0.0.2]:40001" in said and "every member answers" in said

    opened = _Check({"round/4"})
    error = rounds._unconnected(opened, chosen, settings, refused, "the round's own group")
    assert type(error) is dp.RankFailedError, error
    assert "the launcher opened the next round" in str(error)


_CONNECTS = """
import datetime, json
from dataparallel.backends.gloo.group import Connects, gloo_group, import_torch_distributed

dist = import_torch_distributed()
said = []

def unconnected(error, name):
    said.append(name)
    return ValueError(name)

def fail(connecting):
    said.append(connecting.total_seconds())
    raise RuntimeError("Connect timeout")

def round_group(connecting):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=connecting)

def outcome(name):
    try:
        gloo_group(fail, None, datetime.timedelta(seconds=60), name)
    except ValueError as exc:
        return f"limited: {exc}"
    except RuntimeError as exc:
        return f"torch's: {exc}"

gloo_group(round_group, None, datetime.timedelta(seconds=60), "round", Connects(10.0, unconnected))
over_round = outcome("over the round's")
dist.destroy_process_group()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # not a round's
over_other = outcome("over another")
dist.destroy_process_group()
print(json.dumps({"over_round": over_round, "over_other": over_other, "said": said}))
"""


@alone
def test_the_connect_limit_is_the_round_groups_and_ends_with_it() -> None:
    """An elastic round's group keeps its connect limit (`gloo.group.Connects`) while it is
    torch's default group: a group made over it connects within the limit (Gloo waits five
    times the timeout it is given) and one that does not raises the limit's error, told the
    group's name; once the round's group is gone, a group over another default group takes
    no limit and raises torch's own error. The process's own default group: a process of its
    own."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CONNECTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["over_round"] == "limited: over the round's", said
    assert said["over_other"] == "torch's: Connect timeout", said
    assert said["said"] == [2.0, "over the round's", 60.0], said


_LATE_MEMBER = """
import datetime, json, sys, time
import dataparallel as dp
from dataparallel.config import Settings
from dataparallel.elastic import rounds

joined = rounds.join(-1)  # round 0, torch's default group made over it
store = rounds.connect(Settings.from_env())
others = [f"gave-up/{m}" for m in joined.members if m != joined.me]
guard = datetime.timedelta(seconds=60)
if joined.me == sys.argv[1]:  # answers the store, but makes the group only once the rest gave up
    store.wait(others, guard)
begun = time.monotonic()
try:
    dp.initialize("gloo")  # the world's group over the round's: the limit is the round's
except rounds.NoWorldError as exc:
    said = {"error": str(exc)}
else:
    said = {"error": None}
said.update(me=joined.me, seconds=time.monotonic() - begun)
print(json.dumps(said), flush=True)
store.set(f"gave-up/{joined.me}", "1")
store.wait(others, guard)  # every member alive until each one made its try
"""


@alone
@pytest.mark.spawns
def test_a_real_group_missing_its_connect_limit_ends_every_member_naming_it() -> None:
    """A Gloo group made over an elastic round's group (`dp.initialize()` in a worker), which one
    member joins only once the others gave up on it: the member's process and host answer all
    along, the launcher opens no next round, so no round would help. Every member raises
    `NoWorldError` naming the group, the round and its members: those that waited for the late
    member's address after their store's wait (the elastic timeout), the late one after the
    round's connect limit (the others' connections refused or unanswered). None hangs.

    The test is the launcher: its store, round 0 published as `dataparallel run` does."""
    import datetime
    import json
    import os
    import subprocess
    import sys

    from dataparallel.backends.gloo.group import import_torch_distributed
    from dataparallel.config import connect_limit
    from dataparallel.elastic import rounds

    dist = import_torch_distributed()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    members = ["w0", "w1", "w2"]
    elastic_timeout, link_timeout = 6.0, 0.5
    limit = connect_limit(link_timeout)
    workers = []
    for me in members:
        env = dict(os.environ)
        for name in [n for n in env if n.startswith(("DATAPARALLEL_", "MASTER_", "WORLD_"))]:
            del env[name]  # this test's own world: none of a pass's
        env.update(
            DATAPARALLEL_ELASTIC_STORE=f"127.0.0.1:{store.port}",
            DATAPARALLEL_ELASTIC_WORKER=me,
            DATAPARALLEL_ELASTIC_TIMEOUT=f"{elastic_timeout:g}",
            DATAPARALLEL_LINK_TIMEOUT=f"{link_timeout:g}",
            TORCH_CPP_LOG_LEVEL="ERROR",
        )
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", _LATE_MEMBER, "w2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    rounds.publish(store, 0, members, [], notify=False)
    said = {}
    try:
        for me, worker in zip(members, workers, strict=True):
            out, err = worker.communicate(timeout=120)  # the guard: each ends within seconds
            assert worker.returncode == 0, f"{me}: {err}"
            said[me] = json.loads(out.splitlines()[-1])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    name = "the world's group over torch's default group (Gloo, round 0, members w0, w1, w2)"
    for me in members:
        error = said[me]["error"]
        assert error is not None and error.startswith(name), said[me]
        assert "the host of every member answers" in error, error
    for me in ("w0", "w1"):  # the late member's address never came: the store's wait
        assert elastic_timeout <= said[me]["seconds"] < elastic_timeout + limit, said[me]
    assert said["w2"]["seconds"] < limit + 2.0, said["w2"]  # the others' connections: the limit
