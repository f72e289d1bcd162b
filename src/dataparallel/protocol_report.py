"""The handshake's reports: what every rank is told when the ranks' calls differ or never meet.

When the digests of a handshake (`protocol.py`) differ, every rank saw it: the ranks exchange
their calls' descriptions (only now, `mismatch`) and every rank raises the same
`CollectiveMismatchError`, its message made field by field (`explain`). When the exchange of
records times out, the timeout names the collective the user called (`timed_out`), not the
engine's exchange that carried the handshake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn

from dataparallel.backends.base import Backend
from dataparallel.errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["Describe", "explain", "mismatch", "timed_out"]

# The call field by field (or a function that makes it), to explain a mismatch.
Describe = Mapping[str, object] | Callable[[], Mapping[str, object]]

_MAX_DIFFERENCES = 8  # the fields of a mismatch named; the rest are counted


def timed_out(backend: Backend, call: Describe) -> CollectiveTimeoutError:
    """Name the call the user made, not the engine's exchange that carried the handshake."""
    name = (call if isinstance(call, Mapping) else call()).get("collective", "a collective")
    limit = getattr(backend, "timeout", None)
    within = f" (did not complete within {limit:g} s)" if isinstance(limit, int | float) else ""
    return CollectiveTimeoutError(
        f"rank {backend.rank}: {name} timed out{within}: the other ranks did not make "
        "the same call (one is stuck, has died, or called another collective). Every rank "
        "must make the same collective calls in the same order; raise the limit with "
        "dp.initialize(timeout=...) or DATAPARALLEL_TIMEOUT if it is just slow."
    )


def mismatch(backend: Backend, call: Describe) -> NoReturn:
    """Exchange the calls' descriptions (every rank saw the mismatch) and raise on every rank.

    Ranks that have joined take part with None (`dp.join`), and are left out of the report.
    """
    calls = backend.allgather_object(call if isinstance(call, Mapping) else call())
    raise CollectiveMismatchError(explain(calls))


def _ranks(ranks: list[int]) -> str:
    """Name `ranks` (ascending), three or more in a row as a range: `ranks 0-63, 65`, so that a
    mismatch in a world of thousands of ranks stays a line long."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def explain(every: list[Mapping[str, object] | None]) -> str:
    """Describe, field by field, how the ranks' calls differ (None: a rank that has joined)."""
    calls = {rank: call for rank, call in enumerate(every) if call is not None}
    failed: dict[str, list[int]] = {}
    for rank, call in calls.items():
        if "failed" in call:
            failed.setdefault(str(call["failed"]), []).append(rank)
    if failed:
        collective = calls[min(min(ranks) for ranks in failed.values())].get("collective")
        return (
            f"{collective} failed on some ranks before the ranks communicated, so it fails on "
            "every rank:\n"
            + "\n".join(f"  {_ranks(ranks)}: {reason}" for reason, ranks in failed.items())
            + "\nFix the call on the ranks named (their own traceback shows where); the next "
            "collective works as usual."
        )
    keys = sorted({k for c in calls.values() for k in c}, key=lambda k: (k != "collective", k))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, call in calls.items():
            value = call.get(key, "<absent>")
            groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())
            lines.append(f"  {key}: {parts}")
    shown = lines[:_MAX_DIFFERENCES]
    if len(lines) > len(shown):
        shown.append(f"  ... and {len(lines) - len(shown)} more differences")
    collectives = sorted({str(c.get("collective")) for c in calls.values()})
    head = (
        f"Ranks called different collectives ({', '.join(collectives)})"
        if len(collectives) > 1
        else f"Ranks called {collectives[0]} with different arguments"
    )
    return (
        head
        + ":\n"
        + "\n".join(shown)
        + (
            "\nEvery rank must make the same collective calls, in the same order, with the same "
            "tree structure, shapes (first axis excepted for allgather), dtypes, ops and roots."
        )
    )
