"""What an elastic run keeps in memory and rolls back: `State`, `ObjectState`, `TorchState`,
`TreeState` (Horovod's `hvd.elastic` names).

`commit()` saves a copy of every attribute and then asks whether the launcher re-formed the
run (`check_host_updates`); `restore()` puts the last saved copy back; `sync()` gives every rank
rank 0's values. An attribute with `state_dict`/`load_state_dict` (a model, an optimizer, an
`ElasticSampler`) is saved and restored through them and changes in place; any other value is
copied (`copy.deepcopy`) and rebound.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import numpy as np

from dataparallel import world
from dataparallel.collectives.broadcasts import broadcast
from dataparallel.collectives.objects import allgather_object, broadcast_object
from dataparallel.collectives.reductions import allreduce
from dataparallel.config import Settings
from dataparallel.elastic import rounds
from dataparallel.errors import DataParallelError

if TYPE_CHECKING:
    import torch

    from dataparallel.torch import FullyShardedModule, ZeroRedundancyOptimizer

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "TreeState"]


class _Reducer(Protocol):
    """What a commit reads of a model's gradient reducer (`gradient_sync`): its residuals."""

    def feedback_state(self) -> Mapping[str, object] | None: ...

    def load_feedback_state(
        self, state: Mapping[str, object] | None, *, own: bool = False
    ) -> None: ...

    def feedback_kept_out(self) -> contextlib.AbstractContextManager[object]: ...


class HostsUpdatedInterrupt(DataParallelError, RuntimeError):
    """The launcher re-formed the run (workers added): raised by `commit()` on every rank alike.

    `elastic.run` then re-forms the world without rolling back; `skip_sync` is Horovod's flag
    (False here: a newcomer needs the state, so the state is always synchronized).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the launcher re-formed the run: new workers join at this commit")
        self.skip_sync = skip_sync


class State:
    """The base of elastic states: what `elastic.run` saves, restores and synchronizes."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], object]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], object]]) -> None:
        """Call each of `callbacks` (no arguments) after every re-formed world, before `sync`."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called by `elastic.run` once the world is re-formed)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (what a failure rolls back to), then `check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank when the launcher opened a newer round.

        The ranks agree (the newest round any of them saw, a max-allreduce), so all raise or none
        does. Outside an elastic run (no launcher's store), nothing happens.
        """
        joined = rounds.current()
        if joined is None:
            return
        seen = rounds.newest(rounds.connect(Settings.from_env()))
        agreed = int(allreduce(np.array([seen], np.int64), op="max")[0])
        if agreed > joined.generation:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class _Stateful(Protocol):
    """What is saved and restored through its own methods: a model, an optimizer, a sampler."""

    def state_dict(self) -> object: ...

    def load_state_dict(self, state: object, /) -> object: ...


def _stateful(value: object) -> TypeGuard[_Stateful]:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _root_pickled(name: str, value: object) -> object:
    """Give every rank rank 0's `value`; a value rank 0 cannot pickle fails on every rank."""
    payload: tuple[bool, object]
    if world.rank() == 0:
        try:
            payload = (True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # pickling raises anything the object's __reduce__ raises
            payload = (False, f"{type(exc).__name__}: {exc}")
    else:
        payload = (True, b"")
    received: tuple[bool, object] = broadcast_object(payload)
    ok, data = received
    if not ok:
        raise TypeError(
            f"state attribute {name!r} cannot be sent to the other ranks ({data}): elastic "
            "state holds picklable values, models, optimizers and samplers."
        )
    assert isinstance(data, bytes)
    return pickle.loads(data)


class ObjectState(State):
    """Any attributes, given as keywords: `state = ObjectState(epoch=0, batch=0, history=[])`.

    Read and assign them as attributes (`state.epoch += 1`); `commit()` saves them all.
    """

    def __init__(self, **attrs: object) -> None:
        super().__init__()
        self._names = list(attrs)
        self._saved: dict[str, object] = {}
        for name, value in attrs.items():
            setattr(self, name, value)
        self.save()

    def save(self) -> None:
        saved = {}
        for name in self._names:
            value = getattr(self, name)
            try:
                saved[name] = copy.deepcopy(self._saved_of(value))
            except Exception as exc:
                raise TypeError(
                    f"state attribute {name!r} ({type(value).__name__}) cannot be saved: "
                    f"{type(exc).__name__}: {exc}. Elastic state holds values that copy.deepcopy "
                    "can copy, or objects with state_dict()/load_state_dict()."
                ) from exc
        self._saved = saved

    def _saved_of(self, value: object) -> object:
        """What `save` keeps of `value` (before it is copied)."""
        return value.state_dict() if _stateful(value) else value

    def restore(self) -> None:
        for name in self._names:
            self._restore_one(name, getattr(self, name), copy.deepcopy(self._saved[name]))

    def _restore_one(self, name: str, value: object, saved: object) -> None:
        if _stateful(value):
            value.load_state_dict(saved)
        else:
            setattr(self, name, saved)

    def sync(self) -> None:
        for name in self._names:
            self._sync_one(name, getattr(self, name))

    def _sync_one(self, name: str, value: object) -> None:
        if _stateful(value):
            value.load_state_dict(_root_pickled(name, value.state_dict()))
        else:
            setattr(self, name, _root_pickled(name, value))


class TreeState(ObjectState):
    """Pytrees of arrays (an optax run's `params=`, `opt_state=`) and other attributes.

    Attributes that are arrays or pytrees of arrays are synchronized with `dp.broadcast` (their
    bytes, not a pickle); the others as `ObjectState` does.
    """

    def _sync_one(self, name: str, value: object) -> None:
        if _stateful(value) or not _is_array_tree(value):
            super()._sync_one(name, value)
        else:
            setattr(self, name, broadcast(value))


def _is_array_tree(value: object) -> bool:
    from dataparallel.arrays.tree import flatten

    try:
        leaves = flatten(value).leaves
    except (TypeError, ValueError):
        return False
    return bool(leaves) and all(hasattr(leaf, "dtype") for leaf in leaves)


class TorchState(ObjectState):
    """Horovod's `TorchState(model=None, optimizer=None, **attrs)`: a model, its optimizer and
    other attributes (an `ElasticSampler`, the epoch, ...).

    The model's parameters and buffers are synchronized with `dp.broadcast`; the optimizer's
    state and the other attributes through a pickle from rank 0. The error-feedback residuals of
    a `dp.DistributedOptimizer` or `dp.torch.DataParallelModel` (`compression=
    dp.Compression.fp16_feedback`, ...) are each rank's own: committed and rolled back with the
    rest, never sent (a newcomer starts with none, a lost worker's go with it).

    A `dp.torch.ZeroRedundancyOptimizer` holds only its slice of the state, and a lost worker's
    slice goes with it: each `commit()` therefore consolidates the whole state on every rank
    (collective, one full copy per rank in host memory), which a roll-back loads back (each
    rank keeping its slice) and which, after a re-form, rank 0 gives every rank once the
    optimizer is laid out again over the new world (`rebind_world`). Until the first commit a
    rank keeps only its own slice: commit once before the first step if the optimizer already
    has state (a checkpoint loaded), or a re-form before then fails with a message saying so.

    A model under `dp.torch.fully_shard` holds only its rows on each rank, and so does any
    optimizer over its shards: each commit keeps this rank's rows and a copy of the next
    rank's (`FullyShardedModule.commit_rows`), and after a re-form the survivors cut every
    shard, and the optimizers' state of it, again for the new world (`carry_over`), after
    agreeing on one commit (a loss during a commit can leave them one apart: the commit before
    the last is kept for that).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **attrs: object,
    ) -> None:
        extra: dict[str, object] = {"model": model} if model is not None else {}
        if optimizer is not None:
            extra["optimizer"] = optimizer
        self._feedback: dict[
            str, Mapping[str, object] | None
        ] = {}  # each reducer's residuals at the last commit
        self._consolidated = False  # inside `commit()`, after the ZeRO states were consolidated
        # Fully sharded models (`dp.torch.fully_shard`), by attribute: their outermost sharded
        # modules, and the optimizers over their shards (by attribute), whose state of the
        # shards is committed with the model's rows, not through `state_dict()`.
        self._sharded: dict[str, list[FullyShardedModule]] = {}
        self._over_shards: dict[str, Any] = {}  # optimizers, known by their parameters
        self._rows: dict[str, list[Any]] = {}  # each root's rows, last commit
        self._rows_generation = 0  # the round the rows were committed in
        self._commits = 0  # commits made (agreed after a re-form)
        self._previous: tuple[int, dict[str, object], dict[str, list[Any]]] | None = None
        taken: set[int] = set()
        named = {**extra, **attrs}
        for name, value in named.items():
            roots = _sharded_roots(value)
            if roots:
                self._sharded[name] = roots
                taken |= {id(p) for root in roots for p in root.parameters()}
        for name, value in named.items():
            shards = _shard_params(value)
            if shards and name not in self._sharded:
                if any(id(p) not in taken for p in shards):
                    raise ValueError(
                        f"TorchState: optimizer {name!r} steps parameters sharded by "
                        "dp.torch.fully_shard whose model is not in this state: give the model "
                        "to the same TorchState (its rows and this optimizer's state for them "
                        "are committed and laid out again together)."
                    )
                self._over_shards[name] = value
        super().__init__(**extra, **attrs)

    def _reducers(self) -> dict[str, _Reducer]:
        """The `GradientSync` of each attribute that reduces gradients (by attribute name)."""
        found = {}
        for name in self._names:
            gradient_sync = getattr(getattr(self, name), "gradient_sync", None)
            if gradient_sync is not None:
                found[name] = gradient_sync
        return found

    def _residuals_kept_out(self) -> contextlib.ExitStack:
        """A block in which the state dicts carry no residuals and loading keeps them."""
        stack = contextlib.ExitStack()
        for gradient_sync in self._reducers().values():
            stack.enter_context(gradient_sync.feedback_kept_out())
        return stack

    def commit(self) -> None:
        """Consolidate every ZeRO optimizer's state on every rank (collective), then save and
        `check_host_updates` as `State.commit` does."""
        for name in self._names:
            value = getattr(self, name)
            if _is_zero(value):
                value.consolidate_state_dict(to=None)
        self._consolidated = True
        try:
            super().commit()
        finally:
            self._consolidated = False

    def save(self) -> None:
        # The sharded rows first: their exchange (in a commit) is collective, and a failure in
        # it leaves the last commit whole.
        exchange = self._consolidated
        rows = {
            name: [root.commit_rows(self._over_shards, exchange=exchange) for root in roots]
            for name, roots in self._sharded.items()
        }
        before = (self._commits, self._saved, self._rows)
        with self._residuals_kept_out():
            super().save()
        self._feedback = {name: s.feedback_state() for name, s in self._reducers().items()}
        if self._sharded:
            if exchange:  # survivors may differ by one commit: keep the one before
                self._previous = before
                self._commits += 1
            self._rows, self._rows_generation = rows, _generation()

    def _saved_of(self, value: object) -> object:
        if any(value is getattr(self, name) for name in self._sharded):
            return _unsharded_state(value)
        if any(value is opt for opt in self._over_shards.values()):
            return _without_shards(value)
        if not _is_zero(value):
            return super()._saved_of(value)
        if self._consolidated:
            return {"zero": "whole", "state": value.state_dict()}
        # At construction (no collective there: a newcomer makes its state alone): its slice.
        return {"zero": "slice", "generation": _generation(), "state": value.optim.state_dict()}

    def restore(self) -> None:
        with self._residuals_kept_out():
            super().restore()
        for name, gradient_sync in self._reducers().items():  # this process's own, by name
            gradient_sync.load_feedback_state(self._feedback.get(name), own=True)
        for name, roots in self._sharded.items():  # (laid out again since: `sync` fills them)
            for root, saved in zip(roots, self._rows[name], strict=True):
                root.restore_rows(self._over_shards, saved)

    def _restore_one(self, name: str, value: object, saved: object) -> None:
        if name in self._sharded:
            value.load_state_dict(saved, strict=False)  # type: ignore[attr-defined]
            return
        if not _is_zero(value):
            super()._restore_one(name, value, saved)
            return
        assert isinstance(saved, dict)
        if saved["zero"] == "whole":
            value.load_state_dict(saved["state"])  # each rank keeps its slice: no collective
        elif saved["generation"] == _generation():
            value.optim.load_state_dict(saved["state"])  # the same layout: its own slice
        elif not saved["state"]["state"]:
            value.optim.state.clear()
        # else: a slice of another layout, never committed; `sync` says so on every rank

    def sync(self) -> None:
        """Carry distributed optimizers over to a re-formed world (collective, first, where a
        newcomer made its optimizer), then give every rank rank 0's values (each keeps its own
        error-feedback residuals; a ZeRO optimizer gets rank 0's last commit)."""
        survivor = self._agree_on_a_commit() if self._sharded else None
        for name in self._names:
            value = getattr(self, name)
            gradient_sync = getattr(value, "gradient_sync", None)
            outlived = gradient_sync.outlived if gradient_sync is not None else None
            if outlived or (_is_zero(value) and value.outlived):
                value.rebind_world()
        with self._residuals_kept_out():
            super().sync()
        if survivor is None:  # the same world: every rank holds its rows already
            if any(saved["next"] is None for rows in self._rows.values() for saved in rows):
                # Made at construction, which is not collective: each rank copies its
                # committed rows to the rank before it now (every rank syncs).
                self._rows = {
                    name: [
                        root.commit_rows(self._over_shards, of=saved)
                        for root, saved in zip(roots, self._rows[name], strict=True)
                    ]
                    for name, roots in self._sharded.items()
                }
            return
        for name, roots in self._sharded.items():
            for root, saved in zip(roots, self._rows[name], strict=True):
                root.carry_over(self._over_shards, saved if survivor else None)
        # Commit the rows again in the new layout (each copied to the rank before it), so that
        # a loss before the next commit finds them.
        self._rows = {
            name: [root.commit_rows(self._over_shards) for root in roots]
            for name, roots in self._sharded.items()
        }
        self._rows_generation, self._previous = _generation(), None

    def _agree_on_a_commit(self) -> bool | None:
        """After a re-form (collective): go back to the commit before the last where another
        survivor did not finish the last one, so that every rank's rows, and rank 0's other
        values, are of one commit. Returns whether this rank holds rows of the old world
        (False: a newcomer), None where nothing was re-formed."""
        survivor = self._rows_generation < _generation()
        marks = allgather_object((survivor, self._commits))
        if not any(s for s, _ in marks):
            return None
        agreed = min(n for s, n in marks if s)
        if survivor and self._commits != agreed:
            if self._previous is None or self._previous[0] != agreed:
                raise RuntimeError(
                    f"TorchState: this worker's last commit is number {self._commits} and "
                    f"another survivor's {agreed}: more than one apart, which commits made on "
                    "every rank cannot be."
                )
            self._commits, self._saved, self._rows = self._previous
            self.restore()
        self._commits = agreed
        return survivor

    def _sync_one(self, name: str, value: object) -> None:
        import torch

        if _is_zero(value):
            saved = _root_pickled(name, self._saved[name])
            assert isinstance(saved, dict)
            if saved["zero"] == "whole":
                value.load_state_dict(saved["state"])
            elif saved["generation"] != _generation() and saved["state"]["state"]:
                raise RuntimeError(
                    f"state attribute {name!r}: the run re-formed before the "
                    "ZeroRedundancyOptimizer's state was ever committed, and a lost worker's "
                    "slice of it went with the worker. Call state.commit() once before the "
                    "first step when the optimizer already has state (a checkpoint loaded)."
                )
            # else: the same world, where every rank holds its slice of one state, or no state
            return
        if name in self._over_shards:  # its state of the shards: `carry_over`
            opt: Any = value
            received = _root_pickled(name, _without_shards(opt))
            kept = {p: opt.state[p] for p in _shard_params(opt) if p in opt.state}
            opt.load_state_dict(received)
            opt.state.update(kept)
            return
        if isinstance(value, torch.nn.Module):
            tensors = _unsharded_state(value) if name in self._sharded else value.state_dict()
            received = broadcast(dict(tensors))
            with torch.no_grad():
                for key, tensor in tensors.items():
                    tensor.copy_(received[key])
            return
        super()._sync_one(name, value)


def _sharded_roots(value: object) -> list[FullyShardedModule]:
    """The outermost `dp.torch.fully_shard` modules in `value` (a module), in module order."""
    module = sys.modules.get("dataparallel.torch")
    sharded = getattr(module, "FullyShardedModule", None)
    modules = getattr(value, "modules", None)
    if sharded is None or not callable(modules):
        return []
    roots: list[FullyShardedModule] = []
    inside: set[int] = set()
    for m in modules():
        if isinstance(m, sharded) and id(m) not in inside:
            roots.append(m)
            inside |= {id(x) for x in m.modules()}
    return roots


def _is_shard(param: object) -> bool:
    return getattr(param, "_dp_shard", None) is not None


def _shard_params(value: object) -> list[torch.Tensor]:
    """The parameters of an optimizer that `dp.torch.fully_shard` shards (none for another
    value)."""
    groups = getattr(value, "param_groups", None)
    if not isinstance(groups, list):
        return []
    return [p for g in groups if isinstance(g, dict) for p in g.get("params", []) if _is_shard(p)]


def _unsharded_state(model: Any) -> dict[str, torch.Tensor]:
    """A fully sharded model's `state_dict()` but its shards: buffers and the parameters no
    `fully_shard` took, the same on every rank."""
    held = model.state_dict(keep_vars=True)
    return {k: v.detach() for k, v in held.items() if not _is_shard(v)}


def _without_shards(optimizer: Any) -> dict[str, object]:
    """An optimizer's `state_dict()` without its state of sharded parameters (their rows are
    committed, and cut again, with the model's)."""
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sharded = {i for i, p in enumerate(params) if _is_shard(p)}
    return {**sd, "state": {i: v for i, v in sd["state"].items() if i not in sharded}}


def _is_zero(value: object) -> TypeGuard[ZeroRedundancyOptimizer]:
    """Whether `value` is a `dp.torch.ZeroRedundancyOptimizer` (loaded only if one was made)."""
    module = sys.modules.get("dataparallel.torch")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    return zero is not None and isinstance(value, zero)


def _generation() -> int:
    """The elastic round this world is (0 outside an elastic run)."""
    joined = rounds.current()
    return 0 if joined is None else joined.generation
