"""Whether a `GradientSync` reduces on the communication thread or after backward: timed.

Which mode is faster depends on what the core count cannot tell: over shared memory with no
spare core, reducing during backward steals the core backward runs on (after it: 0.67-0.87x the
cost, benchmarks/NOTES.md); over a network most of a reduction is waiting on the wire, which
backward can fill. So a reduction that could do either (host parameters, a private engine, no
`DATAPARALLEL_OVERLAP`) and whose ranks span nodes times itself (on one node the cores choose,
`_buckets.overlaps`: the trial's ten steps picked the thread there by noise, issue 21): after
`SKIP` steps (the first rebuilds the buckets), it alternates the two modes for `2 * TRIALS`
steps, each timed from its first gradient to the end of its reduction (backward and
communication, what the mode changes), and keeps the thread if it was faster in the median of
the pairs (each step on the thread minus the step after backward just before it). A step costs
what its slowest rank took (one allreduce of the times, at a step boundary, on every rank alike:
the mode changes the bucket layout, which is part of every step's handshake). Pairs, not each
mode's median: the load of a shared machine drifts over the trial's steps, and two adjacent
steps see the same load.

Where ranks span nodes the thread is kept unless after backward wins by more than `MARGIN` of
its time. There the thread's gain is structural (the wire's time runs beside backward), and
within a few percent the trial's ten steps cannot tell the modes apart: at 2.5 Gbit/s (D=256,
issue 24, benchmarks/NOTES.md) the trial's medians came 0.2-1% apart and chose after backward,
where the same step held in each mode, side by side, cost 2-21 ms less on the thread in all six
comparisons (fp32 and fp16, three runs). Without ranks on other nodes (a trial made directly)
there is no margin.
"""

from __future__ import annotations

import numpy as np

from dataparallel.backends.base import Backend
from dataparallel.collectives import reductions

__all__ = ["ModeTrial"]


class ModeTrial:
    """The schedule and the timings of the trial; `mode` says the mode of the coming step."""

    SKIP = 2  # steps before the trial: the first step's rebuild, warm caches
    TRIALS = 5  # steps timed in each mode (3 chose differently for two copies of one model)
    MARGIN = 0.05  # across nodes, after backward must be this much faster to be kept

    def __init__(self) -> None:
        self.steps = 0  # steps completed (those a rank had joined are not counted)
        self.times: list[float] = []  # the trial's steps, after backward first, alternating
        self.chosen: bool | None = None
        self.medians: tuple[float, float] | None = None  # (after backward, thread), slowest rank

    @property
    def mode(self) -> bool:
        """Whether the coming step reduces on the communication thread (True) or after backward."""
        if self.chosen is not None:
            return self.chosen
        trial = self.steps - self.SKIP
        return trial < 0 or trial % 2 == 1

    @property
    def timing(self) -> bool:
        """Whether the coming step's time is recorded."""
        return self.chosen is None and self.steps >= self.SKIP

    def record(self, seconds: float, backend: Backend) -> bool:
        """Take the time of a completed step; return whether the mode of the next one changes.

        Collective on the step that ends the trial: every rank records the same steps.
        """
        before = self.mode
        if self.timing:
            self.times.append(seconds)
        self.steps += 1
        if self.chosen is None and self.steps == self.SKIP + 2 * self.TRIALS:
            times = np.array(self.times)
            if backend.size > 1:
                times = reductions.allreduce(times, op="max", backend=backend)
            after, thread = times[0::2], times[1::2]  # the trial starts after backward
            self.medians = (float(np.median(after)), float(np.median(thread)))
            across = backend.local_size < backend.size  # some ranks on other nodes
            margin = self.MARGIN * self.medians[0] if across else 0.0
            self.chosen = bool(np.median(thread - after) < margin)
        return self.mode != before
