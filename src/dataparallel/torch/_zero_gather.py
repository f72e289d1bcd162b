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
3.3-3.9 ms against 4.3-4.6; benchmarks/NOTES.md). No send buffer then: a bucket alone is
broadcast straight from and into the flat buffer, merged buckets packed into this rank's row of
the receive buffer.

`staged` (parameters on a device, which the engines cannot read: MPI and Gloo are not CUDA-aware):
every call has its own host buffers (pinned where torch has CUDA), as a merged one has; this
rank's segment of each bucket is copied to the host once before the call (packing it), and each
bucket comes back with one host-to-device copy after it. The host case makes no such copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dataparallel.backends.base import Backend, Handle
from dataparallel.torch._zero_layout import Bucket, Flat, host_buffer

__all__ = ["SliceGather"]


@dataclass
class _Call:
    """One exchange: its buckets, and where this rank's segments go and every rank's land."""

    buckets: list[int]
    rows: torch.Tensor  # uint8, `size` equal rows: row r is rank r's segments end to end
    send: torch.Tensor | None  # uint8: this rank's segments packed (None: its row is sent)
    merged: bool  # whether `rows` is a receive buffer (else: the one bucket, in place)
    # (always, when staged: the buckets are on a device)


class SliceGather:
    """The exchanges of the updated segments, planned once over a layout.

    Args:
        flats, buckets: the layout (`_zero_layout.plan_group`).
        backend: the engine.
        merge_bytes: the most bytes (the whole of the buckets) that one merged call gathers;
            0 makes one call per bucket.
        broadcasts: make each exchange `size` broadcasts, rank r's row from rank r, instead of
            one allgather: no send buffer (a bucket alone goes straight from and into the flat
            buffer; merged buckets are packed into this rank's row of the receive buffer).
        staged: the flat buffers are on a device: every call goes through host buffers.
    """

    def __init__(
        self,
        flats: list[Flat],
        buckets: list[Bucket],
        backend: Backend,
        merge_bytes: int,
        broadcasts: bool = False,
        staged: bool = False,
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
            merged = len(group) > 1 or staged
            if merged:
                rows = host_buffer(part * backend.size, torch.uint8, staged)
            else:
                rows = self._raw(group[0])
            send = None if broadcasts else host_buffer(part, torch.uint8, staged)
            self.calls.append(_Call(group, rows.view(backend.size, part), send, merged))
        self._call_of = {b: c for c, call in enumerate(self.calls) for b in call.buckets}
        # The calls started and not landed: their index in `calls` -> their handles.
        self._flights: dict[int, list[Handle]] = {}

    def _bytes(self, bucket: Bucket, items: int) -> int:
        return items * self.flats[bucket.flat].data.element_size()

    def call_of(self, bucket: int) -> int:
        """The index in `calls` of the call that carries `bucket`."""
        return self._call_of[bucket]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held (send and receive)."""
        held = [(c.send, c.rows if c.merged else None) for c in self.calls]
        return sum(t.nbytes for pair in held for t in pair if t is not None)

    def _raw(self, b: int) -> torch.Tensor:
        """Bucket `b` of its flat buffer, as bytes (on the parameters' device)."""
        bucket = self.buckets[b]
        data = self.flats[bucket.flat].data
        item = data.element_size()
        return data.view(torch.uint8)[bucket.start * item : bucket.stop * item]

    def run(self) -> None:
        """Every rank's segments to every rank: all calls started, then all waited for."""
        self.start()
        self.finish()

    def start(self, order: list[int] | None = None) -> None:
        """Start every call (in `order`, indices into `calls`: the same on every rank); each
        lands at `finish` (that call's) or `finish()` (all of them)."""
        for c in range(len(self.calls)) if order is None else order:
            call = self.calls[c]
            mine = call.rows[self.backend.rank]
            if call.send is not None:  # an allgather: from the send buffer into the rows
                self._pack(call, call.send)
                handle = self.backend.iallgather(call.send.numpy(), call.rows.numpy())
                self._flights[c] = [handle]
                continue
            if call.merged:
                self._pack(call, mine)
            self._flights[c] = self._broadcast(call.rows)

    @property
    def in_flight(self) -> bool:
        """Whether some call started has not landed yet."""
        return bool(self._flights)

    def finish(self, calls: list[int] | None = None) -> None:
        """Wait for `calls` (default: every call in flight) and copy merged ones back; a call
        not in flight is skipped."""
        for c in list(self._flights) if calls is None else calls:
            handles = self._flights.pop(c, None)
            if handles is None:
                continue
            for handle in handles:
                handle.wait()
            call = self.calls[c]
            if not call.merged:
                continue
            at = 0
            for b in call.buckets:
                bucket, raw = self.buckets[b], self._raw(b)
                n = self._bytes(bucket, bucket.counts[0])
                # Staged: one host-to-device copy per bucket (blocking: the step's next kernels
                # see the whole bucket).
                raw.view(self.backend.size, n).copy_(call.rows[:, at : at + n])
                at += n

    def _pack(self, call: _Call, into: torch.Tensor) -> None:
        """This rank's segments of `call`'s buckets, end to end, into `into`.

        Staged, each is one device-to-host copy into pinned memory: a blocking `copy_`, which
        waits for the stream that produced the segment (the inner optimizer's step) before the
        engine reads the bytes."""
        at = 0
        for b in call.buckets:
            bucket, raw = self.buckets[b], self._raw(b)
            n = self._bytes(bucket, bucket.counts[0])
            lo = self._bytes(bucket, bucket.mine[0] - bucket.start)
            into[at : at + n].copy_(raw[lo : lo + n])
            at += n

    def _broadcast(self, rows: torch.Tensor) -> list[Handle]:
        """Broadcast row r of `rows` (`size` equal rows, bytes) from rank r, all in flight."""
        if rows.numel() == 0:
            return []
        return [self.backend.ibroadcast(rows[r].numpy(), r) for r in range(self.backend.size)]
