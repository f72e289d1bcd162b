"""The exceptions of dataparallel: one base, one class per way a distributed job goes wrong.

`library_error` finds ours inside another library's: a jitted JAX step that calls the engine
from inside XLA (a host callback, an FFI call) gets back from JAX a `JaxRuntimeError` that keeps
only the text of the error the engine raised. So every `RankFailedError` is remembered as text
(the newest few: its message, its class and its other fields, such as a `LinkLostError`'s
address; the error itself, with its traceback, would keep the lost world's engine and its
connections alive), and `library_error` finds its message in the foreign one and makes it again:
elastic training tells a lost link (a split to report) from a lost rank by it.
"""

from __future__ import annotations

import collections

__all__ = [
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataParallelError",
    "LinkLostError",
    "NotInitializedError",
    "RankFailedError",
    "RankJoinedError",
    "library_error",
]


class DataParallelError(Exception):
    """Base class of every error raised by dataparallel itself."""


class NotInitializedError(DataParallelError, RuntimeError):
    """A call needed the process group before `dp.initialize()` set it up."""


class BackendUnavailableError(DataParallelError, ImportError):
    """The requested engine cannot be used here; the message names what to install."""


class CollectiveMismatchError(DataParallelError, RuntimeError):
    """Ranks entered a collective with different calls, shapes, dtypes, trees, roots or ops.

    Raised on every rank of the job; the world stays usable for the next collective.
    """


class CollectiveTimeoutError(DataParallelError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class RankFailedError(DataParallelError, RuntimeError):
    """Another rank of the job failed or exited while this one was waiting on it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        entry = (str(self), type(self), self._fields())
        if entry[0] and entry not in _remembered:  # made again by `library_error`: once
            _remembered.append(entry)

    def _fields(self) -> dict[str, str]:
        """This error's fields besides its message, as its class takes them by keyword: what
        `library_error` makes it again with (text only)."""
        return {}


class LinkLostError(RankFailedError):
    """Another rank is out of reach: its connection stopped answering for the link timeout.

    Its host, or the link between the two hosts, is down; the rank itself may be alive, and
    reachable from others (a *split*). `address` is the peer's address as the connection had it.
    """

    def __init__(self, message: str, address: str) -> None:
        self.address = address  # before it is remembered
        super().__init__(message)

    def _fields(self) -> dict[str, str]:
        return {"address": self.address}


# The newest RankFailedErrors made in this process (`library_error`): message, class, fields.
_remembered: collections.deque[tuple[str, type[RankFailedError], dict[str, str]]] = (
    collections.deque(maxlen=8)
)


def library_error(error: BaseException) -> BaseException:
    """Return the dataparallel error that `error` stands for: `error` itself if it is one, one in
    its chain of causes, or a recent `RankFailedError` (of its class, with its fields: a
    `LinkLostError` keeps its address) whose message `error`'s message holds (another library
    rethrowing ours as its own type); else `error`."""
    link: BaseException | None = error
    while link is not None:
        if isinstance(link, DataParallelError):
            return link
        link = link.__cause__ or link.__context__
    text = str(error)
    for message, kind, fields in reversed(_remembered):
        if message in text:
            return kind(message, **fields)
    return error


class RankJoinedError(DataParallelError, RuntimeError):
    """A collective that ranks which have joined (`dp.join`) cannot answer: a gather, a broadcast.

    Raised on every rank that made the call; the world stays usable.
    """
