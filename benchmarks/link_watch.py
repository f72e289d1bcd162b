"""What the link watch costs a training step (`backends/connections.Links`, 8 looks a link timeout).

Every process of a job across hosts runs the watch: Gloo's ranks over the connections their
groups made, MPI's ranks over every connection of theirs to another host. It reads each watched
connection's `TCP_INFO` and lists the process's file descriptors, every eighth of the link
timeout (`look_interval`: `--link-timeout`, 0.25 s at most), on a thread beside the training.
This times, in the same processes and in batches taken in turn (`_timing.compare`), a
data-parallel step (an MLP, Adam, `dp.DistributedOptimizer`)
with a watch of its own over K connections of each rank (both ends of K loopback connections, so
2K watched: a world of K + 1 ranks over 2 groups has about as many), and with that watch
stopped; and one look alone. The job's own world watches nothing (one host: its connections are
loopback's or shared memory's).

```
OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/link_watch.py --connections 8,64
```
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
from _timing import SMOKE, compare
from mpi4py import MPI

import dataparallel as dp
from dataparallel.backends.connections import Links, connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", default="8,64", help="K values, comma separated")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batches", type=int, default=12, help="batches of each case")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds a batch")
    parser.add_argument("--link-timeout", type=float, default=1.0, help="sets the looks' rate")
    args = parser.parse_args()
    dp.initialize()
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, 10),
    )
    dp.synchronize(model)
    optimizer = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    if dp.rank() == 0:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {dp.size()} ranks")
        print("K  | step, watch stopped | step, watching 2K | ratio | one look | looks' share")
    for count in (int(k) for k in args.connections.split(",")):
        with socket.create_server(("127.0.0.1", 0), backlog=count) as server:
            before = set(connections())
            ends = [socket.create_connection(server.getsockname()) for _ in range(count)]
            ends += [server.accept()[0] for _ in range(count)]
            made = {i: p for i, p in connections().items() if i not in before}
            links = Links()
            # Never lost (nothing waits on loopback's idle connections): it only looks.
            links.watch(made, args.link_timeout, lambda sock, peer: None)

            def watching(links: Links = links) -> None:
                links.start()
                step()

            def stopped(links: Links = links) -> None:
                links.stop()
                step()

            cases = {"stopped": stopped, "watching": watching}
            times = compare(cases, comm, batches=args.batches, budget=args.budget)
            links.stop()
            looks = []
            for _ in range(3 if SMOKE else 200):
                start = time.perf_counter()
                links.look()
                looks.append(time.perf_counter() - start)
            look = comm.allreduce(statistics.median(looks), op=MPI.MAX)
            for end in ends:
                end.close()
        if dp.rank() == 0:
            share = look / links.interval
            print(
                f"{count:<3}| {times['stopped'] * 1e3:.3f} ms | {times['watching'] * 1e3:.3f} ms | "
                f"{times['watching'] / times['stopped']:.4f} | {look * 1e6:.0f} us | "
                f"{share * 100:.3f}% of a core"
            )
    dp.finalize()


if __name__ == "__main__":
    main()
