"""Horovod's asynchronous handles: `poll`, `synchronize`, and the queue behind them.

Horovod starts an operation when every rank has submitted it, matching operations by name in a
background thread. Here an `*_async` call queues the operation and returns a handle (an int, as
Horovod's) without communicating; queued operations start in submission order, the same on every
rank, when this process next needs one of them: `synchronize(handle)`, `poll(handle)`, a
blocking operation, or `join()`. Starting is dataparallel's own call (`dp.iallreduce`,
`dp.ibroadcast`, or a blocking collective where dataparallel has no non-blocking one).

So ranks may submit and wait in different places, as with Horovod, as long as every rank submits
the same operations in the same order. `barrier()` does not start queued operations (Horovod's
barrier does not wait for them either). `poll()` on a handle still queued starts it and reports
False (it had not completed when polled).

Names: two operations of one kind in flight with the same `name` raise `ValueError`, as in
Horovod; a name is free again once its operation has completed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dataparallel import caches

__all__ = [
    "Done",
    "Started",
    "Then",
    "blocking",
    "flush",
    "poll",
    "reset",
    "submit",
    "synchronize",
    "wait_started",
]


class Started(Protocol):
    """What starting an operation gives: something to test and to wait for (`dp.Request` is one)."""

    def test(self) -> bool: ...

    def wait(self) -> object: ...


class Done:
    """An operation that completed when it started (a blocking collective); holds its result."""

    def __init__(self, result: object) -> None:
        self.result = result

    def test(self) -> bool:
        return True

    def wait(self) -> object:
        return self.result


class Then:
    """A started operation whose result is passed through `after` once it completes."""

    def __init__(self, started: Started, after: Callable[[Any], object]) -> None:
        self.started, self.after = started, after

    def test(self) -> bool:
        return self.started.test()

    def wait(self) -> object:
        return self.after(self.started.wait())


@dataclass
class _Operation:
    key: str | None  # "allreduce.name" while the name is taken
    start: Callable[[], Started]
    started: Started | None = None
    error: BaseException | None = None
    finished: bool = False
    result: object = field(default=None, repr=False)

    def complete(self) -> bool:
        if self.error is not None or self.finished:
            return True
        if self.started is None:
            return False
        return self.started.test()


_operations: dict[int, _Operation] = {}
_queue: list[int] = []
_names: dict[str, int] = {}
_handles = itertools.count(1)


@caches.register  # dp.finalize() too: queued operations belong to the world that ends
def reset() -> None:
    """Forget every operation (`init()` and `shutdown()` call this, and `dp.finalize()`)."""
    _operations.clear()
    _queue.clear()
    _names.clear()


def submit(kind: str, name: str | None, start: Callable[[], Started]) -> int:
    """Queue an operation of `kind` (`"allreduce"`, ...); return its handle.

    Raises:
        ValueError: an operation of the same kind and name has not completed yet.
    """
    key = f"{kind}.{name}" if name is not None else None
    if key is not None and key in _names:
        holder = _operations.get(_names[key])
        if holder is not None and not holder.complete():
            raise ValueError(
                f"A {kind} named {name!r} is already in flight on this rank: two concurrent "
                "operations cannot share a name. Synchronize the first, or give another name."
            )
    handle = next(_handles)
    _operations[handle] = _Operation(key, start)
    if key is not None:
        _names[key] = handle
    _queue.append(handle)
    return handle


def _start(handle: int) -> None:
    op = _operations[handle]
    try:
        op.started = op.start()
    except Exception as error:  # every rank saw it alike (the handshake): report it at synchronize
        op.error = error


def flush(through: int | None = None) -> None:
    """Start the queued operations in order, up to `through` (default: all of them)."""
    while _queue:
        handle = _queue.pop(0)
        if handle in _operations:
            _start(handle)
        if handle == through:
            return


def wait_started() -> None:
    """Start every queued operation and wait until all of them have completed."""
    flush()
    for handle, op in list(_operations.items()):
        if op.started is not None and not op.finished and op.error is None:
            _finish(handle, op)


def _finish(handle: int, op: _Operation) -> None:
    started = op.started
    try:
        op.result = started.wait() if started is not None else None
    except Exception as error:
        op.error = error
    op.finished = True


def _release(handle: int, op: _Operation) -> None:
    _operations.pop(handle, None)
    if op.key is not None and _names.get(op.key) == handle:
        del _names[op.key]


def poll(handle: int) -> bool:
    """Return whether the operation has completed; `synchronize()` then returns at once.

    A handle still queued is started (in order, after those queued before it) and reported as
    not completed.
    """
    op = _operations.get(handle)
    if op is None:
        return True
    if op.started is None and op.error is None:
        flush(through=handle)
        return False
    return op.complete()


def synchronize(handle: int) -> Any:
    """Wait for the operation and return its result (None for an unknown handle, as Horovod)."""
    op = _operations.get(handle)
    if op is None:
        return None
    if op.started is None and op.error is None:
        flush(through=handle)
    if not op.finished and op.error is None:
        _finish(handle, op)
    _release(handle, op)
    if op.error is not None:
        raise op.error
    return op.result


def blocking(kind: str, name: str | None, start: Callable[[], Started]) -> Any:
    """Run an operation now, after every queued one has started; return its result."""
    return synchronize(submit(kind, name, start))
