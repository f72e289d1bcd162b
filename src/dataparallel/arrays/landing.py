"""Where a `Fusion` call lands: waiting for it with pauses (`settle`), and its results unpacked
into the arrays, scaled (`unpack`): the packed bucket's slots, a read-only array's new result,
a reduce-scatter's or all-to-all's deliveries, a GPU bucket on its device or staged back."""

from __future__ import annotations

import time

import numpy as np

from dataparallel.arrays.compression import from_wire
from dataparallel.arrays.dtypes import f32_to_bf16, scale_in_place
from dataparallel.arrays.flight import Deliver, Flight
from dataparallel.backends.base import Handle

__all__ = ["settle", "unpack"]


def settle(request: Handle, pause: float, limit: float | None) -> None:
    """Wait for `request` by testing it every `pause` seconds, sleeping in between.

    MPICH waits by polling its sockets without pause, a core's worth of system calls; on the
    communication thread that core is the one backward computes on wherever a rank has no
    spare core (issue 24). Each test moves the call along, and the kernel's socket buffers
    keep the link busy between tests. Past the engine's timeout `limit` (`DATAPARALLEL_TIMEOUT`)
    it returns, for the caller to wait in the engine, which raises after that timeout again.
    """
    deadline = None if limit is None else time.monotonic() + limit
    while not request.test():
        if deadline is not None and time.monotonic() > deadline:
            return
        time.sleep(pause)


def unpack(
    flight: Flight, receives: bool, scale: float | None, read_only: dict[int, Deliver]
) -> None:
    """Write a completed `flight`'s results where they belong, scaled by `scale` (None: not).

    `receives`: whether this rank gets a result (not a reduce's non-roots, nor a broadcast's
    root). `read_only`: the deliver of each read-only array packed from, by its id (popped).
    """
    if flight.device is not None and flight.device.direct:
        flight.device.land(receives, scale)
    elif receives:
        wire, buf = flight.wire, flight.buf
        if flight.recv is not None and flight.recv_wire is not None:
            wire, buf = flight.recv_wire, flight.recv  # a reduce-scatter's or all-to-all's
        assert isinstance(wire, np.ndarray)  # a direct device flight landed above
        # A packed bucket is scaled as it is unpacked: one pass over it instead of two.
        fold = scale is not None and scale != 1 and bool(flight.slots) and wire is buf
        fold = fold and flight.compressed is None
        if flight.compressed is not None:  # widen, then scale in the wide dtype
            from_wire(wire, flight.compressed, buf, flight.dtype, scale)
        elif scale is not None and scale != 1 and not fold:
            scale_in_place(wire, scale)
        if flight.compressed is None and wire is not buf and wire.dtype != np.uint8:
            if flight.dtype == "bfloat16":
                f32_to_bf16(wire, out=buf)
            else:
                buf[...] = wire
        for work, offset in flight.slots:
            values = buf[offset : offset + work.size].reshape(work.shape)
            if not work.flags.writeable:  # packed from a read-only view: a new array
                result = np.empty(work.shape, work.dtype)
                if fold:
                    scale_in_place(values, scale, out=result)  # type: ignore[arg-type]
                else:
                    np.copyto(result, values)
                read_only.pop(id(work))(result)
                continue
            if fold:
                scale_in_place(values, scale, out=work)  # type: ignore[arg-type]
            else:
                work[...] = values
        if flight.layout is not None:
            flight.layout.unpack(buf, flight.deliver)
    if flight.device is not None and not flight.device.direct:
        flight.device.unstage(receives)
