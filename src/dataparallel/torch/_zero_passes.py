"""Whether every rank ran as many backward passes before `step()` (stage 2, `_zero_grads.py`).

Each rank's slot in the exchange of a step's flags (or of a later pass's check) says what that
rank is doing: `PASS` (it began another backward pass) or `STEP` (it called `step()`). Every rank
exchanged the same slots, so every rank reaches the same verdict.
"""

from __future__ import annotations

import numpy as np

from dataparallel.errors import CollectiveMismatchError

__all__ = ["PASS", "STEP", "pass_mismatch"]

PASS, STEP = 1.0, 2.0


def pass_mismatch(kinds: np.ndarray, doing: float) -> CollectiveMismatchError | None:
    """The error to raise unless every rank's slot in `kinds` says `doing`."""
    if (kinds == doing).all():
        return None
    passing = [r for r, kind in enumerate(kinds) if kind == PASS]
    stepping = [r for r, kind in enumerate(kinds) if kind == STEP]
    return CollectiveMismatchError(
        "ZeroRedundancyOptimizer(stage=2): the ranks ran different numbers of backward "
        f"passes before step(): {_ranks(passing)} began another pass where "
        f"{_ranks(stepping)} called step(). Every rank must run as many backward passes "
        "(and as many steps); this step's gradients are discarded: call zero_grad() on "
        "every rank to go on."
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
