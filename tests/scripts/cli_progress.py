"""Iterate through `dp.progress` without initializing; the bar's label names the rank drawing it."""

import os
import sys

from dataparallel.progress import progress

rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
items = list(range(5))
bar = progress(items, desc=f"bar-from-rank-{rank}", file=sys.stderr, mininterval=0)
got = "the list" if bar is items else type(bar).__name__
total = sum(bar)
# One write for both lines: mpiexec interleaves the ranks' output by writes.
sys.stdout.write(f"rank {rank} got {got}\nrank {rank} sum {total}\n")
sys.stdout.flush()
