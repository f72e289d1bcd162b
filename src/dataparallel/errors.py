"""The exceptions of dataparallel: one base, one class per way a distributed job goes wrong."""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataParallelError",
    "NotInitializedError",
    "RankFailedError",
    "RankJoinedError",
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


class RankJoinedError(DataParallelError, RuntimeError):
    """A collective that ranks which have joined (`dp.join`) cannot answer: a gather, a broadcast.

    Raised on every rank that made the call; the world stays usable.
    """
