"""What a `dp.torch.join` block costs a ZeRO step while no rank has joined (even data).

Run: `OMP_NUM_THREADS=1 .venv/bin/dataparallel run -n 3 benchmarks/zero_join.py` (MPI), or with
`--backend gloo`. The model and steps of `benchmarks/zero.py` (an MLP of 1.59 M float32
parameters, Adam); cases, in the same processes, each on its own copy, their batches of steps
interleaved (`zero.timed`):

- `ZeRO stage 1 + DataParallelModel` and the same inside `dp.torch.join(model, opt)`: the block
  adds nothing to a step (the wrapper's own handshake carries it);
- `ZeRO stage 2` and the same inside `dp.torch.join(opt)`: one handshake per backward pass.

Printed: each case's median step time and its ratio to the same stage outside a block.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

from zero import STAGE1, STAGE2, Step, make, mlp, timed, trainer

import dataparallel as dp

IN_BLOCK = ", in a dp.torch.join block"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--batches", type=int, default=30, help="interleaved batches of steps")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per batch of steps")
    args = parser.parse_args()
    engine = type(dp.initialize()).__name__
    base = mlp()
    steps: dict[str, Step] = {}
    with ExitStack() as blocks:
        for stage in (STAGE1, STAGE2):
            for joined in (False, True):
                model, opt = make(stage, base, 1e-3)
                if joined:
                    joinables = (model, opt) if stage == STAGE1 else (opt,)
                    blocks.enter_context(dp.torch.join(*joinables))  # type: ignore[arg-type]
                steps[stage + (IN_BLOCK if joined else "")] = trainer(model, opt, args.batch)
        times = timed(steps, args.batches, args.budget)
    if dp.rank() == 0:
        print(f"{dp.size()} ranks, {engine}, {args.batch} samples per rank")
        for name, seconds in times.items():
            plain = times[name.removesuffix(IN_BLOCK)]
            print(f"  {name:<60} {seconds * 1e3:7.2f} ms  {seconds / plain:5.3f}x")
    dp.finalize()


if __name__ == "__main__":
    main()
