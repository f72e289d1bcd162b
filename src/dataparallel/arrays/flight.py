"""One communication call of `Fusion` in flight, and what to do when it lands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dataparallel.arrays.device import DeviceBucket
from dataparallel.arrays.segments import Segments
from dataparallel.backends.base import Buffer, Handle
from dataparallel.types import WireDtype

__all__ = ["Deliver", "Flight"]

Deliver = Callable[[np.ndarray], object]  # where a reduce-scatter's or all-to-all's result goes


@dataclass
class Flight:
    """One communication call in flight and what to do when it lands."""

    request: Handle | None
    dtype: str
    buf: np.ndarray  # storage-dtype values, 1-D
    wire: Buffer  # what the engine gets: buf, a widened copy, or a DeviceBuffer
    slots: list[tuple[np.ndarray, int]] = field(default_factory=list)  # (work, offset) to unpack
    pooled: list[np.ndarray] = field(default_factory=list)
    span: int = 0  # the timeline's id of the communicate phase
    device: DeviceBucket | None = None  # the GPU bucket this flight carries (device.py)
    layout: Segments | None = None  # reduce-scatter and all-to-all: the bucket's rank layout
    recv: np.ndarray | None = None  # ... their results (storage dtype), and what the engine fills
    recv_wire: np.ndarray | None = None
    deliver: list[Deliver] = field(default_factory=list)
    compressed: WireDtype | None = None  # the 16-bit dtype `wire` holds, when compressed
    prescaled: bool = False  # scaled before the call (`dtypes.prescale`): nothing to do after
