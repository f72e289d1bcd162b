"""The exceptions of dataparallel: one base, one class per way a distributed job goes wrong.

`library_error` finds ours inside another library's: a jitted JAX step that calls the engine
from inside XLA (a host callback, an FFI call) gets back from JAX a `JaxRuntimeError` that keeps
only the text of the error the engine raised. So the message of every `RankFailedError` is
remembered (the newest few; the text only: the error itself, with its traceback, would keep the
lost world's engine and its connections alive), and `library_error` finds it in the foreign one.
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
        if str(self):
            _remembered.append(str(self))


class LinkLostError(RankFailedError):
    """Another rank is out of reach: its connection stopped answering for the link timeout.

    Its host, or the link between the two hosts, is down; the rank itself may be alive, and
    reachable from others (a *split*). `address` is the peer's address as the connection had it.
    """

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


# The messages of the newest RankFailedErrors made in this process (`library_error`).
_remembered: collections.deque[str] = collections.deque(maxlen=8)


def library_error(error: BaseException) -> BaseException:
    """Return the dataparallel error that `error` stands for: `error` itself if it is one, one in
    its chain of causes, or a `RankFailedError` with the message of a recent one that `error`'s
    message holds (another library rethrowing ours as its own type); else `error`."""
    link: BaseException | None = error
    while link is not None:
        if isinstance(link, DataParallelError):
            return link
        link = link.__cause__ or link.__context__
    text = str(error)
    for message in reversed(_remembered):
        if message in text:
            return RankFailedError(message)
    return error


class RankJoinedError(DataParallelError, RuntimeError):
    """A collective that ranks which have joined (`dp.join`) cannot answer: a gather, a broadcast.

    Raised on every rank that made the call; the world stays usable.
    """
