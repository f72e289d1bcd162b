"""Sharded checkpoints: every rank writes its own shards, in torch DCP's format, loadable at any
world size. Its rooms:

- `_shards`: `Shards`, this rank's pieces of a tensor with their places, whatever shards it;
- `_optax`: `OptaxShards`, optax's sharded state (`shard_state=True`) written as every rank's
  slices of each parameter's state;
- `_states`: what is written for each thing in a state (modules, optimizers, ZeRO's shards,
  samplers, arrays, values), in torch's own layout, and how each is put back;
- `_dcp`: the steps of a save and a load over this world, through torch DCP's planners and file
  storage; `async_save`'s thread; what makes an unfinished save unmistakable.

Loaded on first access to `dp.checkpoint` (it needs PyTorch). Usage and guarantees:
docs/checkpoint.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

try:
    import torch as _torch  # noqa: F401 - fail here, with what to install, not deep in a submodule
except ImportError as exc:
    raise ModuleNotFoundError(
        "dp.checkpoint writes torch DCP's format and needs PyTorch, which is not installed "
        "here: pip install 'dataparallel[torch]' (or pip install torch).",
        name="torch",
    ) from exc

from dataparallel.checkpoint._optax import OptaxShards
from dataparallel.checkpoint._shards import Shards

if TYPE_CHECKING:
    from dataparallel.checkpoint._dcp import SaveFuture

__all__ = ["OptaxShards", "SaveFuture", "Shards", "async_save", "load", "save"]


def save(state: Mapping[str, object], path: str | os.PathLike[str]) -> None:
    """Write `state` into the folder `path`, each rank its own shards (collective).

    `state` is a dict (nested dicts allowed) of torch modules, optimizers (plain,
    `dp.DistributedOptimizer`, `dp.torch.ZeroRedundancyOptimizer`, whose sharded state is written
    by the rank that holds it), optax's sharded state as `OptaxShards(state, params)`, objects
    with `state_dict()` and `load_state_dict()` (samplers, learning-rate schedulers), `Shards`,
    tensors, NumPy and JAX arrays, and picklable values (the step). Whatever is not `Shards`
    must be the same on every rank: it is written once.

    The folder is torch DCP's (`torch.distributed.checkpoint`): one file per rank and a
    `.metadata` written last, atomically, once every rank's file is on disk, so that a save cut
    short is never taken for a checkpoint. A checkpoint already in the folder is replaced (its
    `.metadata` removed before anything is written). Returns when the checkpoint is complete on
    every rank.

    >>> import torch, dataparallel as dp, tempfile
    >>> _ = dp.initialize()
    >>> model = torch.nn.Linear(2, 2)
    >>> folder = tempfile.mkdtemp()
    >>> dp.checkpoint.save({"model": model, "step": 3}, folder)
    >>> dp.checkpoint.load({"model": model, "step": 0}, folder)["step"]
    3

    Note: torch's `dcp.save` takes `get_state_dict(model, optimizer)`'s dicts; this takes the
    objects, and writes the same layout (the optimizer's state keyed by parameter names).
    """
    from dataparallel.checkpoint import _dcp

    _dcp.save(state, path)


def async_save(state: Mapping[str, object], path: str | os.PathLike[str]) -> SaveFuture:
    """Start `save(state, path)`; return once the state is copied into host memory.

    The files are written on a thread while the program goes on (it may change the state at
    once); the returned future's `result()` waits until the checkpoint is complete and raises
    what the save raised. The next `save`, `async_save` or `load`, `dp.wait_all()` and
    `dp.finalize()` wait for it first. Collective, as `save` is.
    """
    from dataparallel.checkpoint import _dcp

    return _dcp.async_save(state, path)


def load(state: Mapping[str, object], path: str | os.PathLike[str]) -> Mapping[str, object]:
    """Load the checkpoint in `path` into `state` (collective); return `state`.

    `state` holds the same keys as the saved one, its objects laid out for this world, whatever
    its size: each rank reads the parts of the saved shards that fall in its own. Modules,
    optimizers, samplers, tensors and writable NumPy arrays are loaded in place; values that
    cannot be (numbers, JAX arrays) are replaced in `state` and in the returned dict. It also
    loads checkpoints written by torch's `dcp.save` of `get_state_dict(model, optimizer)`.

    Raises:
        FileNotFoundError: `path` holds no complete checkpoint (a save that did not finish, or
            shard files missing); the message names what is there and what is missing.
        KeyError, ValueError: the state asks for what the checkpoint does not hold, or holds
            with other shapes or parameters.
    """
    from dataparallel.checkpoint import _dcp

    return _dcp.load(state, path)


def __getattr__(name: str) -> object:
    # torch DCP (`_dcp`) takes most of this package's import time: it loads at the first save or
    # load, or when `SaveFuture` is first asked for, not in every process that imports the package.
    if name == "SaveFuture":
        from dataparallel.checkpoint._dcp import SaveFuture

        return SaveFuture
    raise AttributeError(f"module 'dataparallel.checkpoint' has no attribute {name!r}")
