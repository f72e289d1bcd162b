"""How long an elastic run stops when a worker is SIGKILLed, against the same run without a failure.

Run: `OMP_NUM_THREADS=1 python benchmarks/elastic.py [--pairs 2] [--workers 3] [--fully-shard]`

The script launches `dataparallel run -n W --min-np 2 --backend gloo` on itself, in pairs taken
in turn: one run in which worker 1 kills itself with SIGKILL in the middle of its 20th step
(after its gradients, before their allreduce), one without. Each worker trains a small MLP with
`dp.DistributedOptimizer` under `@dp.elastic.run`, committing after every step, and notes the
wall-clock time of each commit; the victim notes the moment of its death, the survivors the
moment the world had re-formed (a reset callback). Printed per failure run:

- death -> re-formed: the survivors saw the failure, left the world, the launcher opened a round
  of the survivors, and they made a new Gloo world of it;
- death -> state synced: ... and then synchronized the state (`state.sync()`: from the new rank
  0, or for a fully sharded model cut again from the survivors' commits);
- death -> next commit: ... and then synchronized the state from the new rank 0, redid the step
  lost with the commit and committed it (the figure the issue asks for: at most 5 s);
- the step time (commit to commit) of the run without a failure, and the ratio.

`--fully-shard` times, in the same invocation and in turns, the same model under
`dp.torch.fully_shard` (each layer, then the model) with Adam over its shards, beside the
`DistributedOptimizer` runs: its commits copy each rank's rows to the rank before it, and a
re-form cuts every shard and Adam's state again for the survivors; printed with the ratio of
its death -> next commit to the unsharded run's.

`--hosts` (as root) runs the same across two emulated hosts instead (benchmarks/network.py's
`Link`: two network namespaces joined by a veth pair, unshaped): `dataparallel run -H a:2,b:2
--min-np 2`, launched in host a, starting host b's workers through an `ssh` that enters b's
namespace (the launcher's own ssh command line, run without sshd); the failure run kills both
workers of host b at once, so the survivors lose a whole host.
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
from typing import Any

HERE = Path(__file__).resolve().parent
STEPS = 40
VICTIM_STEP = 20
# Stands in for ssh across the emulated hosts: `ssh [-o X | -p X | -i X]... HOST COMMAND`
# runs COMMAND in HOST's namespace, under its hostname.
FAKE_SSH = """#!/bin/sh
while [ $# -gt 2 ]; do case $1 in -o|-p|-i) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
case $host in
{cases}
  *) echo "no host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; $1"
"""


def worker(notes: Path, victim: str | None, sharded: bool) -> None:
    import torch

    import dataparallel as dp

    dp.initialize()
    me = os.environ["DATAPARALLEL_ELASTIC_WORKER"]
    log = open(notes / f"{me}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the run

    def note(kind: str) -> None:
        log.write(json.dumps({"kind": kind, "t": time.time(), "who": me}) + "\n")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer: torch.optim.Optimizer
    if sharded:
        for layer in (model[0], model[2]):
            dp.torch.fully_shard(layer)
        dp.torch.fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = dp.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: note("reformed")])
    data = torch.randn(32, 64)

    @dp.elastic.run
    def train(state: dp.elastic.TorchState) -> None:
        note("entered")  # after `state.sync()`: the state carried over to this world
        while state.step < STEPS:
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            if victim is not None and me in victim.split(",") and state.step == VICTIM_STEP:
                note("died")
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.step += 1
            state.commit()
            note("commit")

    train(state)


def one_run(
    workers: int, victim: str | None, link: Any = None, sharded: bool = False
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        command = [sys.executable, "-m", "dataparallel", "run", "-n", str(workers)]
        env = None
        if link is not None:  # two hosts of workers // 2 each, launched in host a
            slots = workers // 2
            command += ["-H", ",".join(f"{a}:{slots}" for a in link.addresses)]
            env = {**link.environment(), "PATH": f"{tmp}:{os.environ['PATH']}"}
            cases = "\n".join(
                f"  {a}) ns={s}; name={h};;"
                for a, s, h in zip(link.addresses, link.spaces, link.hosts, strict=True)
            )
            ssh = Path(tmp) / "ssh"
            ssh.write_text(FAKE_SSH.format(cases=cases))
            ssh.chmod(0o755)
        command += ["--min-np", "2", "--backend", "gloo", "--timeout", "300", __file__]
        command += ["--worker", tmp] + (["--victim", victim] if victim else [])
        command += ["--fully-shard"] if sharded else []
        if link is not None:
            command = link.command(0, command)
        start = time.time()
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        wall = time.time() - start
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        notes = [json.loads(line) for path in Path(tmp).glob("*.jsonl") for line in path.open()]
    commits = sorted(n["t"] for n in notes if n["kind"] == "commit")
    figures = {"wall": wall}
    deaths = [n["t"] for n in notes if n["kind"] == "died"]
    if deaths:
        died = min(deaths)
        figures["reformed"] = min(n["t"] for n in notes if n["kind"] == "reformed") - died
        entered = [n["t"] for n in notes if n["kind"] == "entered" and n["t"] > died]
        figures["synced"] = min(entered) - died
        figures["next_commit"] = min(t for t in commits if t > died) - died
    else:
        w0 = sorted(n["t"] for n in notes if n["kind"] == "commit" and n["who"] == "w0")
        figures["step"] = statistics.median(b - a for a, b in itertools.pairwise(w0))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--hosts", action="store_true", help="across two emulated hosts")
    parser.add_argument("--fully-shard", action="store_true", help="also a fully_shard model")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--victim", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.victim, args.fully_shard)
        return
    link = None
    victim, what = "w1", "worker 1"
    if args.hosts:
        sys.path.insert(0, str(HERE))
        from network import Link, why_not

        reason = why_not()
        if reason is not None:
            print(f"skipped: {reason}")
            return
        args.workers += args.workers % 2
        victim = ",".join(f"w{n}" for n in range(args.workers // 2, args.workers))
        what = f"host b's {args.workers // 2} workers ({victim})"
        link = Link()
    failed, clean, sharded_failed, sharded_clean = [], [], [], []
    try:
        for _ in range(args.pairs):
            failed.append(one_run(args.workers, victim, link))
            clean.append(one_run(args.workers, None, link))
            if args.fully_shard:
                sharded_failed.append(one_run(args.workers, victim, link, sharded=True))
                sharded_clean.append(one_run(args.workers, None, link, sharded=True))
    finally:
        if link is not None:
            link.close()
    report(args.workers, link is not None, what, failed, clean, "")
    if args.fully_shard:
        report(
            args.workers,
            link is not None,
            what,
            sharded_failed,
            sharded_clean,
            "fully_shard + Adam, ",
        )
        ratio = statistics.median(f["next_commit"] for f in sharded_failed) / statistics.median(
            f["next_commit"] for f in failed
        )
        print(f"death -> next commit, fully_shard / unsharded (medians): {ratio:.2f}")


def report(
    workers: int,
    hosts: bool,
    what: str,
    failed: list[dict[str, float]],
    clean: list[dict[str, float]],
    model: str,
) -> None:
    step = statistics.median(f["step"] for f in clean)
    where = "" if not hosts else ", 2 emulated hosts"
    print(f"{model}{workers} workers{where}, {what} SIGKILLed at step {VICTIM_STEP} of {STEPS}:")
    print("| run | death -> re-formed | death -> state synced | death -> next commit | wall |")
    print("| --- | --- | --- | --- | --- |")
    for i, f in enumerate(failed):
        print(
            f"| failure {i + 1} | {f['reformed']:.2f} s | {f['synced']:.2f} s | "
            f"{f['next_commit']:.2f} s | {f['wall']:.1f} s |"
        )
    for i, f in enumerate(clean):
        print(f"| no failure {i + 1} | - | - | - | {f['wall']:.1f} s |")
    recovery = statistics.median(f["next_commit"] for f in failed)
    print(f"step without a failure (median, commit to commit): {step * 1e3:.1f} ms")
    print(f"death -> next commit (median): {recovery:.2f} s = {recovery / step:.0f} steps")
    print(
        f"wall, failure / no failure: {statistics.median(f['wall'] for f in failed):.1f} s / "
        f"{statistics.median(f['wall'] for f in clean):.1f} s"
    )


if __name__ == "__main__":
    main()
