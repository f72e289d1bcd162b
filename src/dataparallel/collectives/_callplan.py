"""What a call plan holds (`_plans.py` makes and picks plans; `_onebuffer.py` runs the one-buffer
kinds): made once per signature, kept on the world."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.inline import Slot
from dataparallel.arrays.replay import Replay
from dataparallel.protocol import Records

__all__ = ["CallPlan", "Kind"]

Kind = Literal["inline", "packed", "fused", "whole"]


@dataclass(slots=True, eq=False)
class CallPlan:
    """How every call of one signature runs: made once by `_plan`, executed by `start`."""

    kind: Kind
    digest: int  # the call's summary hashed, what the handshake compares
    describe: Callable[[], dict[str, object]]  # the call field by field, for a mismatch
    action: Reduction
    dtypes: list[str]  # each leaf's dtype ("inline": how its bytes are combined)
    wire: str | None  # the 16-bit wire dtype of `compression=`
    nans: bool  # "fused" min/max: ranks flag their NaNs in the handshake
    apart: bool  # "fused" leaves may land in different flights: aliases are copied (`aliases`)
    replay: Replay  # what a rank that has joined (`dp.join`) makes instead
    replay_nan: Replay  # ... when some rank flagged a NaN (the masks follow)
    buf: np.ndarray | None = None  # "packed" over several leaves: the bucket
    views: list[np.ndarray] = field(default_factory=list)  # each leaf's place in `buf`
    records: Records | None = None  # "inline", "packed": the handshake's buffers
    slots: list[Slot] = field(default_factory=list)  # "inline": each leaf's place in the records
    form_slots: list[Slot] = field(default_factory=list)  # ... as a `_Form` lays its values
    offsets: tuple[int, ...] = ()  # "whole": each leaf's place in the lent buffer
    front: tuple[int, ...] = ()  # "whole": the leaves packed at its front (one call)
    alone: tuple[int, ...] = ()  # "whole": the leaves reduced into their places, one call each
    items: int = 0  # "whole": the lent buffer's length

    @property
    def nbytes(self) -> int:
        return (0 if self.buf is None else self.buf.nbytes) + (
            0 if self.records is None else self.records.rows.nbytes
        )

    def replay_of(self, flagged: bool) -> Replay:
        return self.replay_nan if flagged else self.replay
