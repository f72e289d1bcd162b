"""A world of one: every collective is the identity, with the same semantics as the real engines."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from dataparallel.backends.base import Backend, DoneHandle, Handle, ReduceOp
from dataparallel.config import Settings

__all__ = ["SingleBackend"]


class SingleBackend(Backend):
    """The process group of a single process (Flashlight's STUB backend)."""

    name = "single"

    def __init__(self) -> None:
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1

    @classmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> SingleBackend:
        if world_size not in (None, 1) or rank not in (None, 0):
            raise ValueError(
                f"The 'single' backend is a world of one, but rank={rank}, world_size={world_size} "
                "were given: use backend='mpi' or 'gloo' for several processes."
            )
        return cls()

    def accepts_device(self, device: str) -> bool:
        return True

    def split(self, ranks: Sequence[int]) -> SingleBackend | None:
        return SingleBackend() if 0 in ranks else None

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        return None

    def iallreduce(self, buf: Any, op: ReduceOp) -> Handle:
        return DoneHandle()

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> None:
        return None

    def broadcast(self, buf: Any, root: int) -> None:
        return None

    def ibroadcast(self, buf: Any, root: int) -> Handle:
        return DoneHandle()

    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        recv[: counts[0]] = send

    def reduce_scatter(self, send: Any, recv: Any, counts: list[int], op: ReduceOp) -> None:
        recv[: counts[0]] = send[: counts[0]]

    def alltoallv(
        self, send: Any, send_counts: list[int], recv: Any, recv_counts: list[int]
    ) -> None:
        recv[: recv_counts[0]] = send[: send_counts[0]]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        sys.exit(code)
