"""Which optax transformations can run on a rank's slice of the parameters (`refuse_unshardable`).

`dp.DistributedOptimizer(tx, shard_state=True)` runs `tx` on each rank's slice of every leaf
(`dataparallel.jax._sharded`): the leaves keep their places in the tree, but not their shapes or
their other items. A transformation that looks at a whole leaf or across leaves (a global norm, a
per-leaf norm, a factored second moment, a callable mask or label function that reads shapes)
would compute, without an error, something else than the unsharded optimizer. So the wrapped
transformation is taken apart before it runs: optax builds its transformations as closures, and
every function reachable through their cells (the parts of a chain, a mask's callable, the factory
of `inject_hyperparams` and its hyperparameters) is looked at.

The rule is an allowlist for optax's own parts: a part built by optax is accepted only when it is
known to be element-wise (`ELEMENTWISE`) or only to combine others (`COMBINATORS`); any other
optax part (a new one included) is refused with a message that names it. Parts that are not
optax's (a user's own transformation) are the caller's to vouch for, as documented.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["COMBINATORS", "ELEMENTWISE", "refuse_unshardable"]

# optax parts that compute each item of the update from the same item of the gradients, state
# and parameters (and scalars such as the step count): the same on slices as on whole leaves.
ELEMENTWISE = frozenset(
    {
        # transformations
        "add_decayed_weights",  # without a mask (with one it is `masked`, below)
        "apply_every",
        "clip",
        "ema",
        "identity",
        "keep_params_nonnegative",
        "scale",
        "scale_by_adadelta",
        "scale_by_adam",
        "scale_by_adamax",
        "scale_by_adan",
        "scale_by_amsgrad",
        "scale_by_belief",
        "scale_by_learning_rate",
        "scale_by_lion",
        "scale_by_optimistic_gradient",
        "scale_by_radam",
        "scale_by_rms",
        "scale_by_rprop",
        "scale_by_rss",
        "scale_by_schedule",
        "scale_by_sign",
        "scale_by_stddev",
        "scale_by_yogi",
        "set_to_zero",
        "trace",
        "zero_nans",
        # aliases (reached as `inject_hyperparams`' factory)
        "adabelief",
        "adadelta",
        "adagrad",
        "adam",
        "adamax",
        "adamaxw",
        "adamw",
        "adan",
        "amsgrad",
        "lion",
        "nadam",
        "nadamw",
        "optimistic_gradient_descent",
        "radam",
        "rmsprop",
        "rprop",
        "sgd",
        "sign_sgd",
        "yogi",
    }
)
# optax parts that only run others (checked in turn) or feed them scalars.
COMBINATORS = frozenset(
    {
        "chain",
        "named_chain",
        "with_extra_args_support",
        "inject_hyperparams",
        "inject_stateful_hyperparams",
        "stateless_with_tree_map",  # its function is the caller's, applied leaf by leaf
    }
)
# What to say about the commonest refusals (others: not known to be element-wise).
_WHY = {
    "masked": "masks pick whole leaves by a callable of the parameters",
    "partition": "labels pick whole leaves by a callable of the parameters",
    "multi_transform": "labels pick whole leaves by a callable of the parameters",
    "clip_by_global_norm": "its norm is over all the gradients, not one rank's slice",
    "clip_by_block_rms": "its norm is over whole leaves",
    "adaptive_grad_clip": "its norms are over whole leaves",
    "scale_by_trust_ratio": "its norms are over whole leaves (lamb, lars, fromage)",
    "scale_by_factored_rms": "it factors whole leaves by their shape (adafactor)",
    "apply_if_finite": "it checks all the gradients, not one rank's slice",
}


def _builder(fn: object) -> str | None:
    """The optax function that built `fn` (`clip_by_global_norm` for its `update_fn`), the class
    of an optax method (`MultiSteps`), or None: not optax's, or a plain module-level function
    (a helper such as `init_empty_state`, or a factory, which builds nothing until called)."""
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", "")
    if not (module == "optax" or module.startswith("optax.")) or "." not in qualname:
        return None
    if module.startswith("optax.schedules.") and not module.endswith("_inject"):
        return "schedule"  # a schedule gives a scalar from the step count
    return qualname.split(".")[0]


def _parts(tx: object) -> list[tuple[str, dict[str, object]]]:
    """Every optax builder reachable from `tx`, with its closure's variables, outermost first."""
    found: list[tuple[str, dict[str, object]]] = []
    seen: dict[int, object] = {}  # by id, holding each object so that no id is reused meanwhile

    def visit(obj: object) -> None:
        if id(obj) in seen:
            return
        seen[id(obj)] = obj
        if isinstance(obj, functools.partial):
            visit(obj.func)
            for arg in (*obj.args, *obj.keywords.values()):
                visit(arg)
        elif isinstance(obj, types.MethodType):
            visit(obj.__func__)
        elif isinstance(obj, types.FunctionType):
            cells = _cells(obj)
            name = _builder(obj)
            if name is not None:
                found.append((name, cells))
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped)
            for value in cells.values():
                visit(value)
            if name == "inject_hyperparams" and "other_hps" in cells:
                visit(_sample(cells))
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)

    visit(tx)
    return found


def _sample(cells: Mapping[str, Any]) -> object:
    """The transformation `inject_hyperparams` builds at each update, built once to be looked at:
    its static hyperparameters as given, the others 1.0 (which parts it holds does not depend on
    their values)."""
    factory = cells["inner_factory"]
    kwargs = dict(cells.get("other_hps", {}))
    try:
        for name, param in inspect.signature(factory).parameters.items():
            if name not in kwargs and param.default is param.empty and param.kind in _NAMED:
                kwargs[name] = 1.0
        return factory(**kwargs)
    except Exception as exc:  # anything it raises: it cannot be looked at
        name = getattr(factory, "__qualname__", "its factory")
        raise ValueError(
            f"shard_state=True: could not build optax.inject_hyperparams' transformation "
            f"({name}) to check that it can run on slices of the parameters ({exc!r}); use "
            "dp.DistributedOptimizer(tx) without shard_state."
        ) from exc


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _cells(fn: types.FunctionType) -> dict[str, object]:
    """`fn`'s closure variables by name (those not yet assigned left out)."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def _callable_mask(cells: Mapping[str, object], *names: str) -> bool:
    values = [cells[n] for n in names if n in cells and cells[n] is not None]
    return any(
        callable(v) or any(callable(leaf) for leaf in jax.tree_util.tree_leaves(v)) for v in values
    )


def refuse_unshardable(tx: object) -> None:
    """Raise ValueError if `tx` holds an optax part that cannot run on slices of the leaves.

    `masked` and `partition` are accepted with their mask or labels given as a tree (the tree
    picks leaves, and a leaf's slice stays at its place); a callable one is refused, since it
    would be called with the slices. Parts that are not optax's are accepted.
    """
    for name, cells in _parts(tx):
        if name in ELEMENTWISE or name in COMBINATORS or name == "schedule":
            continue
        if name in ("masked", "partition", "multi_transform"):
            if _callable_mask(cells, "mask", "param_labels"):
                _refuse(name, _WHY[name])
            continue
        _refuse(name, _WHY.get(name, "it is not known to be element-wise"))


def _refuse(name: str, why: str) -> None:
    if name == "masked" or name in ("partition", "multi_transform"):
        fix = (
            "give the mask (or labels) as a tree of the parameters' structure instead, e.g. "
            "mask=jax.tree.map(lambda p: p.ndim > 1, params), or shard_state=False"
        )
    else:
        fix = "use dp.DistributedOptimizer(tx) without shard_state (the state unsharded)"
    raise ValueError(
        f"shard_state=True runs the optax transformation on each rank's slice of every "
        f"parameter, and optax.{name} cannot run on slices: {why}. To train with it, {fix}."
    )
