"""Train a small MLP on scikit-learn's digits, data-parallel, with PyTorch.

    .venv/bin/mpiexec -n 2 .venv/bin/python examples/torch_digits.py
    dataparallel run -n 2 examples/torch_digits.py --mode model
    dataparallel run -n 3 examples/torch_digits.py --mode zero2

Every rank trains on its share of each epoch's shuffled batches (`dp.DistributedDataLoader`);
gradients are averaged across ranks during `backward()`, by `dp.DistributedOptimizer` (default)
or by `dp.torch.DataParallelModel` (`--mode model`). With `--mode zero1` / `zero2` each rank
keeps the Adam state of its slice of the parameters only (`dp.torch.ZeroRedundancyOptimizer`,
stage 1 under `DataParallelModel`, stage 2 on the bare model, which also keeps only its slice of
the gradients), and the checkpoint's optimizer state is consolidated on rank 0 in torch's plain
format (it loads into `torch.optim.Adam`, or into ZeRO at any world size). Rank 0 draws the
progress bar, prints the logs and writes the checkpoint; the held-out accuracy is computed by
every rank on its share of the test set and summed with one allreduce. It runs in a few
seconds on a laptop; the digits ship with scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import dataparallel as dp

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError as exc:  # the digits ship with scikit-learn, which dataparallel does not need
    raise SystemExit(
        "This example trains on scikit-learn's digits: pip install 'dataparallel[examples]' "
        "(or pip install scikit-learn)."
    ) from exc


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--mode", choices=["optimizer", "model", "zero1", "zero2"], default="optimizer"
    )
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/torch_digits.pt"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load(seed: int) -> tuple[torch.Tensor, ...]:
    """Return the standardized train and test splits, identical on every rank."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-3
    return (
        torch.from_numpy((x_train - mean) / std),
        torch.from_numpy(y_train).long(),
        torch.from_numpy((x_test - mean) / std),
        torch.from_numpy(y_test).long(),
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Return the accuracy on (x, y): each rank scores its share, one allreduce sums the counts."""
    share = dp.DistributedDataContainer((x, y))
    xs, ys = share[:]
    model.eval()
    with torch.no_grad():
        correct = int((model(xs).argmax(dim=1) == ys).sum()) if len(share) else 0
    model.train()
    counts = dp.allreduce(np.array([correct, len(share)], dtype=np.int64))
    return float(counts[0] / counts[1])


def main() -> int:
    args = parse_args()
    dp.initialize()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load(args.seed)

    net = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    opt: torch.optim.Optimizer
    if args.mode == "model":
        model: nn.Module = dp.torch.DataParallelModel(net)  # broadcasts rank 0's weights
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    elif args.mode == "zero1":  # the wrapper reduces the gradients, ZeRO shards Adam's state
        model = dp.torch.DataParallelModel(net)
        opt = dp.torch.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=args.lr)
    elif args.mode == "zero2":  # ZeRO reduce-scatters the gradients itself: the bare model
        model = dp.synchronize(net)
        opt = dp.torch.ZeroRedundancyOptimizer(
            net.parameters(), torch.optim.Adam, stage=2, lr=args.lr
        )
    else:
        model = dp.synchronize(net)  # every rank starts from rank 0's weights
        opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=max(args.epochs // 3, 1), gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()
    loader = dp.DistributedDataLoader(
        (x_train, y_train), args.batch_size, shuffle=True, seed=args.seed
    )

    if dp.is_main():
        print(
            f"{dp.size()} ranks ({dp.get_backend().name}), {len(x_train)} training samples, "
            f"{len(loader)} batches of {args.batch_size} per rank per epoch, mode={args.mode}",
            flush=True,
        )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        total = torch.zeros(2)  # summed loss, batches
        for x, y in dp.progress(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
        scheduler.step()
        mean_loss = dp.allreduce(total)  # one small collective per epoch, on every rank
        accuracy = evaluate(model, x_test, y_test)
        if dp.is_main():
            print(
                f"epoch {epoch + 1:2d}  loss {float(mean_loss[0] / mean_loss[1]):.4f}  "
                f"test accuracy {accuracy:.2%}  lr {scheduler.get_last_lr()[0]:.2e}",
                flush=True,
            )

    accuracy = evaluate(model, x_test, y_test)
    if isinstance(opt, dp.torch.ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)  # collective: every rank's slices, gathered on rank 0
    if dp.is_main():
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "epochs": args.epochs},
            args.checkpoint,
        )
        print(f"checkpoint written to {args.checkpoint}", flush=True)
        elapsed = time.perf_counter() - start
        print(
            f"final test accuracy {accuracy:.2%} ({len(x_test)} held-out digits, {elapsed:.1f} s)"
        )
    dp.barrier()  # nobody leaves before the checkpoint is written
    dp.finalize()
    if accuracy < 0.95:
        print(f"test accuracy {accuracy:.2%} is below 95%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
