"""`Request`, what the non-blocking collectives return, and `wait_all`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast, overload

from dataparallel import world
from dataparallel.backends.base import Handle

__all__ = ["Request", "wait_all"]

_R = TypeVar("_R")


class Request(Generic[_R]):
    """A non-blocking collective in flight.

    `wait()` returns what the blocking call would have; `test()` says whether it has completed.
    The input must not be touched until `wait()` has returned.
    """

    def __init__(
        self, fusion: Handle, finish: Callable[[], object], pending: list[world.Waitable] | None
    ) -> None:
        self._fusion, self._finish, self._pending = fusion, finish, pending
        self._done, self._result = False, cast(_R, None)
        if pending is not None:
            pending.append(self)

    def test(self) -> bool:
        """Return whether the communication has completed (`wait()` then returns at once)."""
        return self._done or self._fusion.test()

    def wait(self) -> _R:
        """Block until the collective completes and return its result."""
        if not self._done:
            self._fusion.wait()
            self._result, self._done = cast(_R, self._finish()), True
            if self._pending is not None and self in self._pending:
                self._pending.remove(self)
        return self._result


@overload
def wait_all(requests: None = None) -> list[object]: ...


@overload
def wait_all(requests: Sequence[Request[_R]]) -> list[_R]: ...


def wait_all(requests: Sequence[world.Waitable] | None = None) -> list[Any]:
    """Wait for `requests`, or for every request this process has in flight; return the results.

    Flashlight's `syncDistributed`: afterwards every non-blocking collective has completed.
    """
    if requests is None:
        requests = list(world.current().pending)
    return [request.wait() for request in requests]
