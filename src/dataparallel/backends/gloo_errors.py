"""Gloo's failures as dataparallel's errors: a peer that left, a call that timed out."""

from __future__ import annotations

from dataparallel.errors import CollectiveTimeoutError, RankFailedError

__all__ = ["translate_error"]

_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
)


def translate_error(exc: BaseException, what: str, rank: int) -> BaseException:
    """Return the dataparallel error for a Gloo failure (timeouts, vanished peers), or `exc`."""
    message = str(exc)
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    if "timed out" in message.lower() or "timeout" in message.lower():
        return CollectiveTimeoutError(
            f"Gloo {what} on rank {rank} timed out ({first}). A rank may be stuck or calling "
            "other collectives; raise dp.initialize(timeout=...) / DATAPARALLEL_TIMEOUT if it is "
            "just slow."
        )
    if any(sign in message for sign in _PEER_GONE):
        return RankFailedError(
            f"Gloo {what} on rank {rank} failed: another rank failed or exited ({first}). "
            "Look for the first traceback of the job: it names the rank that failed."
        )
    return exc
