"""A non-blocking Gloo collective in flight (`GlooHandle`): its work object, the buffers Gloo
reads and writes kept alive until it completes, and what finishes it (unpacking, a copy out).
When its engine closes it lets go of the work object (`forget`), which holds the group's
connections: a later `wait()` then fails with `RankFailedError`."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dataparallel.backends.gloo_errors import translate_error
from dataparallel.errors import RankFailedError

if TYPE_CHECKING:
    from torch.distributed import Work

__all__ = ["GlooHandle"]


class _Owner(Protocol):
    """What a handle needs of its engine (`GlooBackend`)."""

    rank: int
    _in_flight: weakref.WeakSet[GlooHandle]


class GlooHandle:
    """A Gloo work object in flight, with the buffers it needs kept alive until it completes."""

    __slots__ = ("__weakref__", "_done", "_finish", "_keep", "_rank", "_work")

    def __init__(
        self, owner: _Owner, work: Work, keep: object, finish: Callable[[], None] | None
    ) -> None:
        self._rank, self._keep, self._finish = owner.rank, keep, finish
        self._work: Work | None = work
        self._done = False
        owner._in_flight.add(self)  # `close()` lets go of its work object

    def wait(self) -> None:
        if self._done:
            return
        if self._work is None:
            raise RankFailedError(
                f"a non-blocking Gloo collective on rank {self._rank} was still in flight "
                "when its world was finalized (dp.finalize(), or an elastic run re-forming it)."
            )
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise translate_error(exc, "non-blocking collective", self._rank) from exc
        self._done = True
        if self._finish is not None:
            self._finish()
        self._work = self._keep = self._finish = None

    def forget(self) -> None:
        """Let go of the work object (its engine is closing: it holds the group's connections).
        One that completed is finished first, so that a later `wait()` returns as it would have."""
        if self._done or self._work is None:
            return
        if self._work.is_completed():
            with contextlib.suppress(Exception):  # a failure: the later wait() says so
                self.wait()
        if not self._done:  # the buffers stay: Gloo may still be writing to them
            self._work = self._finish = None

    def test(self) -> bool:
        if self._done:
            return True
        if self._work is None:
            self.wait()  # raises: the world was finalized first
            return True
        if not self._work.is_completed():
            return False
        self.wait()  # completes the unpacking, or raises the error it completed with
        return True
