"""torchmetrics' global metric under dataparallel, whatever the order of two imports.

Usage: `torchmetrics_sync.py ORDER`:
- `dp-first`: `import dataparallel`, `dp.initialize()`, and only then `import torch` (torchmetrics
  imports it): torch's group is made as torch is imported;
- `torch-first`: torch and torchmetrics imported first, then `dp.initialize()`;
- `rank0-only`: after `dp.initialize()`, only rank 0 imports torch; the others go on to an
  allreduce. Every rank prints the error it gets (`MISMATCH ...`).

Each rank holds its share of a fixed set of predictions (shares of different sizes and
accuracies) and prints `METRIC rank=R initialized=B accuracy=A global=G`: A is torchmetrics'
`compute()` after `update` with the rank's share, G the accuracy over the whole set.
"""

import sys

import numpy as np

import dataparallel as dp

order = sys.argv[1]


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if order == "torch-first":
    import torch
    import torchmetrics

    dp.initialize()
elif order == "dp-first":
    dp.initialize()
    import torch
    import torchmetrics
elif order == "rank0-only":
    dp.initialize()
    try:
        if dp.rank() == 0:
            import torch
        dp.allreduce(np.ones(3))
    except dp.CollectiveMismatchError as error:
        say(f"MISMATCH rank={dp.rank()} {' '.join(str(error).split())}")
    dp.finalize()
    sys.exit(0)
else:
    raise SystemExit(f"unknown order {order!r}")

# 0/1 predictions against targets; rank r holds items [r*7 : r*7 + 7 + 3*r] (different sizes).
rng = np.random.default_rng(7)
n = sum(7 + 3 * r for r in range(dp.size()))
preds = rng.integers(0, 2, n)
target = np.where(rng.random(n) < 0.3 + 0.4 * (np.arange(n) % 2), preds, 1 - preds)
start = sum(7 + 3 * r for r in range(dp.rank()))
mine = slice(start, start + 7 + 3 * dp.rank())
metric = torchmetrics.Accuracy(task="binary")
metric.update(torch.as_tensor(preds[mine]), torch.as_tensor(target[mine]))
accuracy = float(metric.compute())
initialized = torch.distributed.is_initialized()
say(
    f"METRIC rank={dp.rank()} initialized={initialized} accuracy={accuracy:.6f} "
    f"global={float(np.mean(preds == target)):.6f}"
)
dp.finalize()
