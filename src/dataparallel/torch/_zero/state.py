"""Checkpoints of `ZeroRedundancyOptimizer` that move between world sizes.

`consolidate` brings every rank's slices of the state to one rank in a plain optimizer's format
(torch's `Optimizer.state_dict()`: `state` keyed by parameter index, each parameter's tensors
in its shape), so that it loads into the wrapped class in one process. It goes bucket by
bucket: the receiving rank holds the state it builds (one full copy) and one bucket's gather,
never every rank's whole shard at once. Element-wise state (a tensor of the piece's shape:
`exp_avg`, `momentum_buffer`) is gathered; anything else (`step`) is taken from the first rank
that holds a piece of the parameter (every piece of a parameter steps together). With parameters
on a device, each bucket's slices are packed there and cross to the host in one copy; the
consolidated state is on the host (torch's `load_state_dict` moves it to the parameters' device).
`with_options` gives it each param group's options as they are at `state_dict()`, by the rule
`copy_options` copies them into the inner optimizer's with (`_options`).

`load` takes such a dict (from this optimizer at any world size, or from a plain optimizer) and
keeps this rank's slices; a dict whose parameters do not match raises `ValueError`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Protocol

import torch

from dataparallel.backends.base import Backend
from dataparallel.torch._zero.layout import Bucket, Piece, Slab


class ZeroRedundancyOptimizer(Protocol):
    """What checkpoints read of `optimizer.ZeroRedundancyOptimizer` (without the import)."""

    backend: Backend
    optim: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
    _slabs: list[Slab]
    _buckets: list[Bucket]
    _params: list[torch.Tensor]
    _names: list[str]

    @property
    def pieces(self) -> list[Piece]: ...


__all__ = ["consolidate", "consolidated_groups", "copy_options", "load", "with_options"]

# What a rank knows of a parameter's state: key -> ("slice", dtype) or ("value", the value).
Schema = dict[str, tuple[str, Any]]


def _sliced(value: object, piece: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.shape


def _slab_range(zero: ZeroRedundancyOptimizer, piece: Piece) -> tuple[int, int]:
    at = zero._slabs[piece.slab].offsets[piece.param]
    return at + piece.start, at + piece.stop


def consolidate(zero: ZeroRedundancyOptimizer, to: int | None) -> dict[str, Any] | None:
    """Gather the whole state on rank `to` (None: on every rank; collective); return it there,
    None elsewhere."""
    backend = zero.backend
    if to is not None and (
        isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < backend.size
    ):
        raise ValueError(
            f"consolidate_state_dict(to={to!r}): give a rank, an int from 0 to {backend.size - 1} "
            "(or None: every rank)."
        )
    local: dict[int, Schema] = {}
    for piece in zero.pieces:
        state = zero.optim.state.get(piece.tensor)
        if not state:
            continue
        entry = local.setdefault(piece.param, {})
        for key, value in state.items():
            if _sliced(value, piece.tensor):
                entry[key] = ("slice", value.dtype)
            else:
                entry.setdefault(key, ("value", value))
    everyone = backend.allgather_object(local) if backend.size > 1 else [local]
    schema: dict[int, Schema] = {}
    for schemas in everyone:
        for k, entry in schemas.items():
            for key, how in entry.items():
                schema.setdefault(k, {}).setdefault(key, how)
    receives = to is None or backend.rank == to
    out: dict[int, dict[str, Any]] = {}
    if receives:
        for k in sorted(schema):
            p = zero._params[k]
            out[k] = {
                key: torch.empty(p.shape, dtype=how[1])
                if how[0] == "slice"
                else (how[1].clone() if isinstance(how[1], torch.Tensor) else copy.deepcopy(how[1]))
                for key, how in schema[k].items()
            }
    for bucket in zero._buckets:
        slab = zero._slabs[bucket.slab]
        keys: dict[str, torch.dtype] = {}
        for k in bucket.params:
            for key, how in schema.get(k, {}).items():
                if how[0] == "slice":
                    keys.setdefault(key, how[1])
        mine = [p for p in zero.pieces if p.slab == bucket.slab]
        lo, hi = bucket.mine
        for key, dtype in keys.items():
            send = torch.zeros(hi - lo, dtype=dtype, device=slab.data.device)
            for piece in mine:
                a, z = _slab_range(zero, piece)
                start, stop = max(a, lo), min(z, hi)
                state = zero.optim.state.get(piece.tensor, {})
                if start < stop and key in state:
                    send[start - lo : stop - lo] = state[key][start - a : stop - a]
            send = send.cpu()  # one device-to-host copy (blocking: the packing is done)
            if backend.size > 1:
                whole = torch.empty(bucket.stop - bucket.start, dtype=dtype)
                backend.allgather(send.view(torch.uint8).numpy(), whole.view(torch.uint8).numpy())
            else:
                whole = send
            if not receives:
                continue
            for k in bucket.params:
                if schema.get(k, {}).get(key, ("",))[0] != "slice":
                    continue
                a, n = slab.offsets[k], zero._params[k].numel()
                start, stop = max(a, bucket.start), min(a + n, bucket.stop)
                target = out[k][key].view(-1)
                target[start - a : stop - a] = whole[start - bucket.start : stop - bucket.start]
    if not receives:
        return None
    return {"state": out, "param_groups": consolidated_groups(zero.param_groups)}


def consolidated_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, list[int]]]:
    """The param groups as a consolidated state has them: `params` as indices, in order."""
    out, first = [], 0
    for group in groups:
        n = len(group["params"])
        out.append({"params": list(range(first, first + n))})
        first += n
    return out


def _options(group: Mapping[str, object]) -> dict[str, object]:
    """A param group's options: every entry but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def copy_options(
    source: Sequence[Mapping[str, object]], target: Sequence[MutableMapping[str, object]]
) -> None:
    """Copy every option but the parameters, group by group (torch's `_sync_param_groups`):
    between the optimizer's param groups and its inner optimizer's."""
    for src, dst in zip(source, target, strict=True):
        dst.update(_options(src))


def with_options(
    consolidated: Mapping[str, Any], groups: Sequence[Mapping[str, object]]
) -> dict[str, Any]:
    """A consolidated state with each param group's options as they are now (`state_dict()`),
    the parameters last, as in torch's."""
    out = [
        {**_options(group), "params": indices["params"]}
        for group, indices in zip(groups, consolidated["param_groups"], strict=True)
    ]
    return {"state": consolidated["state"], "param_groups": out}


def _mismatch(zero: ZeroRedundancyOptimizer, what: str) -> ValueError:
    counts = [len(g["params"]) for g in zero.param_groups]
    return ValueError(
        f"ZeroRedundancyOptimizer.load_state_dict: {what}. This optimizer has "
        f"{len(counts)} param group(s) of {counts} parameter(s); load a state dict saved from "
        "an optimizer over the same model (consolidate_state_dict() + state_dict(), or a "
        "plain optimizer's state_dict())."
    )


def load(zero: ZeroRedundancyOptimizer, state_dict: dict[str, Any]) -> None:
    """Keep this rank's slices of a consolidated state dict (see the module's notes)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise _mismatch(zero, "the state dict has no 'state' and 'param_groups'")
    saved = state_dict["param_groups"]
    if len(saved) != len(zero.param_groups):
        raise _mismatch(zero, f"the state dict has {len(saved)} param group(s)")
    index: dict[object, int] = {}
    for g, (group, current) in enumerate(zip(saved, zero.param_groups, strict=True)):
        if len(group["params"]) != len(current["params"]):
            raise _mismatch(
                zero,
                f"its param group {g} has {len(group['params'])} parameter(s), this one "
                f"{len(current['params'])}",
            )
        first = sum(len(x["params"]) for x in zero.param_groups[:g])
        index.update({saved_id: first + i for i, saved_id in enumerate(group["params"])})
    states: dict[int, Mapping[str, object]] = {}
    for saved_id, state in state_dict["state"].items():
        if saved_id not in index:
            raise _mismatch(zero, f"it has state for parameter {saved_id!r}, in no param group")
        k = index[saved_id]
        p = zero._params[k]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise _mismatch(
                    zero,
                    f"its state {key!r} of {zero._names[k]} has shape {list(value.shape)}, "
                    f"but that parameter has shape {list(p.shape)}",
                )
        states[k] = state
    zero.optim.state.clear()
    for piece in zero.pieces:
        state = states.get(piece.param)
        if state is None:
            continue
        p = zero._params[piece.param]
        mine: dict[str, object] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if value.dim() > 0:
                    value = value.reshape(-1)[piece.start : piece.stop].to(piece.tensor.device)
                if key != "step" and value.is_floating_point():
                    value = value.to(dtype=p.dtype)
                mine[key] = value.detach().clone()
            else:
                mine[key] = copy.deepcopy(value)
        zero.optim.state[piece.tensor] = mine
    for group, target in zip(saved, zero.param_groups, strict=True):
        for key, value in group.items():
            if key != "params":
                target[key] = value
    for src, dst in zip(zero.param_groups, zero.optim.param_groups, strict=True):
        for key, value in src.items():
            if key != "params":
                dst[key] = value
