"""What a call plan holds: one small frozen type per way a reduction runs (`_plans.py` makes,
picks and executes them), made once per signature and kept on the world."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.inline import Slot
from dataparallel.arrays.replay import Replay
from dataparallel.protocol import Records

__all__ = ["Agreement", "CallPlan", "Fused", "Inline", "Packed", "Whole"]


@dataclass(frozen=True, slots=True, eq=False)
class Agreement:
    """What the handshake compares, and what a rank that has joined (`dp.join`) makes instead."""

    digest: int  # the call's summary hashed
    describe: Callable[[], dict[str, object]]  # the call field by field, for a mismatch
    replay: Replay
    replay_nan: Replay  # ... when some rank flagged a NaN (the masks follow)

    def replay_of(self, flagged: bool) -> Replay:
        return self.replay_nan if flagged else self.replay


@dataclass(frozen=True, slots=True, eq=False)
class Inline:
    """The values travel in the handshake; every rank combines every rank's, in rank order."""

    agreement: Agreement
    action: Reduction
    records: Records  # the handshake's buffers
    dtypes: list[str]  # how each leaf's bytes are combined
    slots: list[Slot]  # each leaf's place in the records
    numbers: list[Slot] | None  # Python floats given as one float64 array: its place, if so

    @property
    def nbytes(self) -> int:
        return self.records.rows.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class Packed:
    """The handshake, then one engine call of one host bucket: the bucket `Fusion` would send."""

    agreement: Agreement
    action: Reduction
    records: Records
    bucket: np.ndarray | None  # several leaves: their bucket (`fusion.bucket_views`); one: None
    views: list[np.ndarray]  # each leaf's place in `bucket`

    @property
    def nbytes(self) -> int:
        return (0 if self.bucket is None else self.bucket.nbytes) + self.records.rows.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class Whole:
    """Read-only host leaves of one dtype reduced into one lent buffer whose views they become:
    the small ones packed at its front (one call), each larger one from its own memory."""

    agreement: Agreement
    action: Reduction
    records: Records
    offsets: tuple[int, ...]  # each leaf's place in the lent buffer
    front: tuple[int, ...]  # the leaves packed at its front
    alone: tuple[int, ...]  # the leaves reduced into their places, one call each
    items: int  # the lent buffer's length

    @property
    def nbytes(self) -> int:
        return self.records.rows.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class Fused:
    """The handshake, then the leaves through `Fusion` (`_call.run`), NaN masks and all."""

    agreement: Agreement
    action: Reduction
    records: Records | None  # the handshake's buffers, where the world's size allows them
    wire: str | None  # the 16-bit wire dtype of `compression=`
    nans: bool  # min/max: ranks flag their NaNs in the handshake
    apart: bool  # the leaves may land in different flights: aliases are copied (`aliases`)

    @property
    def nbytes(self) -> int:
        return 0 if self.records is None else self.records.rows.nbytes


# How every call of one signature runs; `_plans.execute` dispatches on the type.
CallPlan: TypeAlias = Inline | Packed | Whole | Fused
