"""How `ZeroRedundancyOptimizer` brings every rank's updated segments back: allgathers.

Rank r owns segment r of every bucket (`_zero_layout.py`), so each bucket is one plain allgather
straight into the flat buffer. On a busy node each call costs about as much whatever its size
(on Gloo a call is a rendezvous of the ranks' worker threads: benchmarks/NOTES.md), so
consecutive buckets are merged into one call while their total stays within `merge_bytes`: this
rank's segments are packed end to end, gathered into one receive buffer (rank after rank), and
copied back into their buckets. A bucket of `merge_bytes` or more goes alone, in place. The
buffers are made once: a send buffer of this rank's segments (1/N of the parameters) and one
receive buffer per merged call (at most `merge_bytes`).

`broadcasts` (Gloo): each call is `size` broadcasts, rank r's segments from rank r, all in
flight at once on Gloo's threads, instead of Gloo's ring allgather (3 ranks on 2 cores, 6 MB:
3.3-3.9 ms against 4.3-4.6; benchmarks/NOTES.md). A bucket alone is then broadcast straight from
and into the flat buffer: no send buffer, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dataparallel.backends.base import Backend, Handle
from dataparallel.torch._zero_layout import Bucket, Flat

__all__ = ["SliceGather"]


@dataclass
class _Call:
    """One allgather: its buckets, this rank's segments packed, where they land if merged."""

    buckets: list[int]
    send: torch.Tensor | None  # uint8: this rank's segments of `buckets`, end to end (None:
    # broadcast in place, from the bucket itself)
    recv: torch.Tensor | None  # uint8: every rank's `send`, rank after rank (None: in place)


class SliceGather:
    """The allgathers of the updated segments, planned once over a layout.

    Args:
        flats, buckets: the layout (`_zero_layout.plan_group`).
        backend: the engine.
        merge_bytes: the most bytes (the whole of the buckets) that one merged call gathers;
            0 makes one call per bucket.
        broadcasts: make each allgather as `size` broadcasts, rank r's segments from rank r
            (a bucket alone: straight from and into the flat buffer, no send buffer).
    """

    def __init__(
        self,
        flats: list[Flat],
        buckets: list[Bucket],
        backend: Backend,
        merge_bytes: int,
        broadcasts: bool = False,
    ) -> None:
        self.flats, self.buckets, self.backend = flats, buckets, backend
        self.broadcasts = broadcasts
        groups: list[list[int]] = []
        total = 0
        for b, bucket in enumerate(buckets):
            nbytes = self._bytes(bucket, bucket.stop - bucket.start)
            if not groups or total + nbytes > merge_bytes:
                groups.append([])
                total = 0
            groups[-1].append(b)
            total += nbytes
        self.calls: list[_Call] = []
        for group in groups:
            part = sum(self._bytes(buckets[b], buckets[b].counts[0]) for b in group)
            alone = len(group) == 1
            send = None if alone and broadcasts else torch.empty(part, dtype=torch.uint8)
            recv = None if alone else torch.empty(part * backend.size, dtype=torch.uint8)
            self.calls.append(_Call(group, send, recv))

    def _bytes(self, bucket: Bucket, items: int) -> int:
        return items * self.flats[bucket.flat].data.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held (send and receive)."""
        return sum(sum(t.nbytes for t in (c.send, c.recv) if t is not None) for c in self.calls)

    def _raw(self, b: int) -> torch.Tensor:
        """Bucket `b` of its flat buffer, as bytes."""
        bucket = self.buckets[b]
        data = self.flats[bucket.flat].data
        item = data.element_size()
        return data.view(torch.uint8)[bucket.start * item : bucket.stop * item]

    def run(self) -> None:
        """Every rank's segments to every rank: all calls started, then all waited for."""
        flights: list[tuple[_Call, list[Handle]]] = []
        for call in self.calls:
            send = self._pack(call)
            if call.recv is None and send is None:  # one bucket, broadcast in place
                flights.append((call, self._broadcast(self._raw(call.buckets[0]))))
            elif call.recv is None:
                assert send is not None
                raw = self._raw(call.buckets[0])
                flights.append((call, [self.backend.iallgather(send.numpy(), raw.numpy())]))
            elif self.broadcasts:
                assert send is not None
                rows = call.recv.view(self.backend.size, -1)
                rows[self.backend.rank].copy_(send)
                flights.append((call, self._broadcast(call.recv)))
            else:
                assert send is not None
                flights.append((call, [self.backend.iallgather(send.numpy(), call.recv.numpy())]))
        for call, handles in flights:
            for handle in handles:
                handle.wait()
            if call.recv is None:
                continue
            rows = call.recv.view(self.backend.size, -1)
            at = 0
            for b in call.buckets:
                bucket, raw = self.buckets[b], self._raw(b)
                n = self._bytes(bucket, bucket.counts[0])
                raw.view(self.backend.size, n).copy_(rows[:, at : at + n])
                at += n

    def _pack(self, call: _Call) -> torch.Tensor | None:
        """This rank's segments of `call`'s buckets, end to end, in its send buffer (if any)."""
        if call.send is None:
            return None
        at = 0
        for b in call.buckets:
            bucket, raw = self.buckets[b], self._raw(b)
            n = self._bytes(bucket, bucket.counts[0])
            lo = self._bytes(bucket, bucket.mine[0] - bucket.start)
            call.send[at : at + n].copy_(raw[lo : lo + n])
            at += n
        return call.send

    def _broadcast(self, rows: torch.Tensor) -> list[Handle]:
        """Broadcast row r of `rows` (`size` equal rows, bytes) from rank r, all in flight."""
        if rows.numel() == 0:
            return []
        split = rows.view(self.backend.size, -1)
        return [self.backend.ibroadcast(split[r].numpy(), r) for r in range(self.backend.size)]
