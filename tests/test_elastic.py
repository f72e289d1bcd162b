"""dp.elastic's pieces that need no launcher: the sampler's exactly-once split, the states'
save/restore/sync, and `elastic.run` outside an elastic run. Runs at any world size (sync
and the errors go through real collectives); the runs with a launcher are in test_elastic_runs.py.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dataparallel as dp
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
