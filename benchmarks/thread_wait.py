"""Does a thread waiting for an MPI call take backward's CPU? (issue 24's finding)

Run across the shaped link: `.venv/bin/python benchmarks/network.py --script thread_wait.py
--rates 1 --d 256` (as root), or on one machine under `mpiexec -n 2`.

Each rank times a transformer's backward (4 layers, width D, 8x32 tokens, one torch thread)
alone, and beside a thread that allreduces a float32 buffer of the model's size: one
`Iallreduce`, then `Wait` (MPICH polls its sockets without pause: the thread spins), or `Test`
and `time.sleep(p)` in turn for several pauses p. Printed per rank, medians over `--reps`
(the first rep is dropped): backward's time, the time until the allreduce completed (from when
both started), and the CPU time the waiting thread used. `raw` is the allreduce alone, blocking.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import torch
from mpi4py import MPI
from train_step import VOCAB, transformer

PAUSES: list[float | None] = [None, 0.0, 5e-5, 1e-4, 2e-4, 1e-3]  # None: Wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    model, loss_fn = transformer(args.d), torch.nn.CrossEntropyLoss()
    n = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, VOCAB, (8, 33), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    buf = np.zeros(n, np.float32)

    def reduce(pause: float | None, out: list[tuple[float, float]]) -> None:
        cpu, start = time.thread_time(), time.perf_counter()
        request = comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
        if pause is None:
            request.Wait()
        else:
            while not request.Test():
                time.sleep(pause)
        out.append((time.perf_counter() - start, time.thread_time() - cpu))

    def backward() -> float:
        model.zero_grad()
        loss = loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1))
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    rows: dict[str, list[tuple[float, float, float]]] = {"backward alone": [], "raw": []}
    for _ in range(args.reps):
        comm.Barrier()
        rows["backward alone"].append((backward(), 0.0, 0.0))
        comm.Barrier()
        out: list[tuple[float, float]] = []
        reduce(None, out)
        rows["raw"].append((0.0, *out[0]))
        for pause in PAUSES:
            out = []
            comm.Barrier()
            thread = threading.Thread(target=reduce, args=(pause, out))
            thread.start()
            took = backward()
            thread.join()
            name = "beside Wait" if pause is None else f"beside Test+sleep({pause * 1e3:g} ms)"
            rows.setdefault(name, []).append((took, *out[0]))
    lines = []
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values[1:]) * 1e3 for i in range(3)]
        lines.append(f"| {rank} | {name} | {med[0]:.1f} ms | {med[1]:.1f} ms | {med[2]:.1f} ms |")
    gathered = comm.gather(lines)
    if rank == 0:
        assert gathered is not None
        print(f"\nD={args.d}, {n / 1e6:.2f} M float32, {comm.Get_size()} ranks")
        print("| rank | case | backward | allreduce done after | waiting thread's CPU |")
        print("| --- | --- | --- | --- | --- |")
        for rank_lines in gathered:
            print("\n".join(rank_lines))
    comm.Free()


if __name__ == "__main__":
    main()
