"""A world of one: every collective is the identity, with the same semantics as the real engines."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dataparallel.backends.base import (
    Backend,
    Buffer,
    DoneHandle,
    Handle,
    HostBuffer,
    Received,
    ReduceOp,
    host_only,
)
from dataparallel.config import Settings
from dataparallel.types import WireDtype

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

    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        return None

    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        return DoneHandle()

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        return DoneHandle()

    def reduce(self, buf: Buffer, op: ReduceOp, root: int) -> None:
        return None

    def broadcast(self, buf: Buffer, root: int) -> None:
        return None

    def ibroadcast(self, buf: Buffer, root: int) -> Handle:
        return DoneHandle()

    def allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        host_only(recv, "allgatherv")[: counts[0]] = host_only(send, "allgatherv")

    def reduce_scatter(self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp) -> None:
        recv, send = host_only(recv, "reduce_scatter"), host_only(send, "reduce_scatter")
        recv[: counts[0]] = send[: counts[0]]

    def alltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> None:
        recv, send = host_only(recv, "alltoallv"), host_only(send, "alltoallv")
        recv[: recv_counts[0]] = send[: send_counts[0]]

    def broadcast_object(self, obj: object, root: int) -> Received:
        return obj

    def allgather_object(self, obj: object) -> list[Received]:
        return [obj]

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        sys.exit(code)
