"""How long an elastic run stops when a worker is SIGKILLed, against the same run without a failure.

Run: `OMP_NUM_THREADS=1 python benchmarks/elastic.py [--pairs 2] [--workers 3]`

The script launches `dataparallel run -n W --min-np 2 --backend gloo` on itself, in pairs taken
in turn: one run in which worker 1 kills itself with SIGKILL in the middle of its 20th step
(after its gradients, before their allreduce), one without. Each worker trains a small MLP with
`dp.DistributedOptimizer` under `@dp.elastic.run`, committing after every step, and notes the
wall-clock time of each commit; the victim notes the moment of its death, the survivors the
moment the world had re-formed (a reset callback). Printed per failure run:

- death -> re-formed: the survivors saw the failure, left the world, the launcher opened a round
  of the survivors, and they made a new Gloo world of it;
- death -> next commit: ... and then synchronized the state from the new rank 0, redid the step
  lost with the commit and committed it (the figure the issue asks for: at most 5 s);
- the step time (commit to commit) of the run without a failure, and the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 40
VICTIM_STEP = 20


def worker(notes: Path, victim: str | None) -> None:
    import torch

    import dataparallel as dp

    dp.initialize()
    me = os.environ["DATAPARALLEL_ELASTIC_WORKER"]
    log = open(notes / f"{me}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the run

    def note(kind: str) -> None:
        log.write(json.dumps({"kind": kind, "t": time.time(), "who": me}) + "\n")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = dp.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: note("reformed")])
    data = torch.randn(32, 64)

    @dp.elastic.run
    def train(state: dp.elastic.TorchState) -> None:
        while state.step < STEPS:
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            if me == victim and state.step == VICTIM_STEP:
                note("died")
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.step += 1
            state.commit()
            note("commit")

    train(state)


def one_run(workers: int, victim: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        command = [sys.executable, "-m", "dataparallel", "run", "-n", str(workers)]
        command += ["--min-np", "2", "--backend", "gloo", "--timeout", "300", __file__]
        command += ["--worker", tmp] + (["--victim", victim] if victim else [])
        start = time.time()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.time() - start
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        notes = [json.loads(line) for path in Path(tmp).glob("*.jsonl") for line in path.open()]
    commits = sorted(n["t"] for n in notes if n["kind"] == "commit")
    figures = {"wall": wall}
    deaths = [n["t"] for n in notes if n["kind"] == "died"]
    if deaths:
        died = deaths[0]
        figures["reformed"] = min(n["t"] for n in notes if n["kind"] == "reformed") - died
        figures["next_commit"] = min(t for t in commits if t > died) - died
    else:
        w0 = sorted(n["t"] for n in notes if n["kind"] == "commit" and n["who"] == "w0")
        figures["step"] = statistics.median(b - a for a, b in itertools.pairwise(w0))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--victim", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.victim)
        return
    failed, clean = [], []
    for _ in range(args.pairs):
        failed.append(one_run(args.workers, "w1"))
        clean.append(one_run(args.workers, None))
    step = statistics.median(f["step"] for f in clean)
    print(f"{args.workers} workers, worker 1 SIGKILLed at step {VICTIM_STEP} of {STEPS}:")
    print("| run | death -> re-formed | death -> next commit | wall |")
    print("| --- | --- | --- | --- |")
    for i, f in enumerate(failed):
        print(
            f"| failure {i + 1} | {f['reformed']:.2f} s | {f['next_commit']:.2f} s | "
            f"{f['wall']:.1f} s |"
        )
    for i, f in enumerate(clean):
        print(f"| no failure {i + 1} | - | - | {f['wall']:.1f} s |")
    recovery = statistics.median(f["next_commit"] for f in failed)
    print(f"step without a failure (median, commit to commit): {step * 1e3:.1f} ms")
    print(f"death -> next commit (median): {recovery:.2f} s = {recovery / step:.0f} steps")
    print(
        f"wall, failure / no failure: {statistics.median(f['wall'] for f in failed):.1f} s / "
        f"{statistics.median(f['wall'] for f in clean):.1f} s"
    )


if __name__ == "__main__":
    main()
