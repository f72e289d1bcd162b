"""Latency and bandwidth of dp.allreduce next to raw mpi4py, measured side by side in one run.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/collectives.py`

Rows (each the median of 45 batches taken in turn with the other cases, every rank in lock step):
- a 4-byte allreduce: raw `comm.Allreduce(IN_PLACE, ...)`, dp with and without mismatch checks;
- three metrics in a dict: raw Allreduce of the 3 packed doubles vs dp.allreduce(dict) (both one
  message: dp's values travel in the handshake);
- 1 MiB of float64 under max: raw vs dp, whose NaN check adds one pass over the values;
- one array of 64 KiB, 1, 16 and 64 MiB: raw Allreduce vs dp.allreduce (zero-copy, in place);
- a ResNet-50-shaped gradient tree (161 arrays, 25.6 M floats): dp.allreduce against the better of
  two raw approaches, one Allreduce per array or pack + one Allreduce + unpack;
- 200 arrays of 64 floats: raw Allreduce per array vs dp.allreduce (fused);
- a tree of 200 arrays (16 MiB in all): raw Allreduce per leaf vs dp.allreduce (fused buckets);
- the same tree through raw pickled `comm.allreduce` per leaf, the way not to do it;
- dp.iallreduce of 4 arrays of 8 MiB against raw Iallreduce one at a time and all at once.
Columns: raw and dp times, dp/raw (the ratio issue 9's goals are written in: below 1, dp is
faster) and dp - raw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp
from dataparallel import world

MiB = 1 << 20


def checked(enabled: bool, fn: Callable[[], object]) -> Callable[[], object]:
    """Return `fn` run with mismatch detection on or off (two attribute writes around it)."""
    active = world.current()
    on = active.settings
    wanted = dataclasses.replace(on, check=enabled)

    def run() -> object:
        active.settings = wanted
        try:
            return fn()
        finally:
            active.settings = on

    return run


def main() -> None:
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rows: list[tuple[str, float, float]] = []

    tiny = np.ones(1, np.float32)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, tiny, MPI.SUM),
            "checks on": checked(True, lambda: dp.allreduce(tiny)),
            "checks off": checked(False, lambda: dp.allreduce(tiny)),
        },
        comm,
    )
    rows += [("4 B, checks on", best["raw"], best["checks on"])]
    rows += [("4 B, checks off", best["raw"], best["checks off"])]

    metrics = {"loss": 1.0, "accuracy": 0.5, "samples": 32.0}
    packed = np.ones(3)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, packed, MPI.SUM),
            "dp": lambda: dp.allreduce(metrics),
        },
        comm,
    )
    rows.append(("3 metrics (a dict of floats)", best["raw"], best["dp"]))

    big = np.ones(MiB // 8)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, big, MPI.MAX),
            "dp": lambda: dp.allreduce(big, op="max"),
        },
        comm,
    )
    rows.append(("1 MiB max (NaN check, no NaN)", best["raw"], best["dp"]))

    sizes = {"64 KiB": 64 << 10, "1 MiB": MiB, "16 MiB": 16 * MiB, "64 MiB": 64 * MiB}
    for label, nbytes in sizes.items():
        buf = np.ones(nbytes // 4, np.float32)
        best = compare(
            {
                "raw": lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                "dp": lambda buf=buf: dp.allreduce(buf),
            },
            comm,
        )
        rows.append((f"{label} array", best["raw"], best["dp"]))

    resnet = [np.ones(shape, np.float32) for shape in resnet50_shapes()]
    packed = np.empty(sum(a.size for a in resnet), np.float32)

    def pack_reduce_unpack() -> None:
        offset = 0
        for a in resnet:
            packed[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        comm.Allreduce(MPI.IN_PLACE, packed, MPI.SUM)
        offset = 0
        for a in resnet:
            a.reshape(-1)[...] = packed[offset : offset + a.size]
            offset += a.size

    best = compare(
        {
            "per array": lambda: [comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM) for a in resnet],
            "packed": pack_reduce_unpack,
            "dp": lambda: dp.allreduce(resnet),
        },
        comm,
    )
    rows.append(("ResNet-50 tree, raw per array", best["per array"], best["dp"]))
    rows.append(("ResNet-50 tree, raw pack+1 call", best["packed"], best["dp"]))

    small = [np.ones(64, np.float32) for _ in range(200)]
    best = compare(
        {
            "per array": lambda: [comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM) for a in small],
            "dp": lambda: dp.allreduce(small),
        },
        comm,
    )
    rows.append(("200 x 64 floats, raw per array", best["per array"], best["dp"]))

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40_000, 200)
    sizes = (sizes * (16 * MiB // 4) // sizes.sum()).astype(int)
    leaves = [np.ones(int(n), np.float32) for n in sizes]

    def per_leaf() -> None:
        for leaf in leaves:
            comm.Allreduce(MPI.IN_PLACE, leaf, MPI.SUM)

    def pickled() -> None:
        for leaf in leaves:
            comm.allreduce(leaf, op=MPI.SUM)

    best = compare(
        {"per leaf": per_leaf, "pickled": pickled, "dp": lambda: dp.allreduce(leaves)}, comm
    )
    rows.append(("tree 200 x 16 MiB, raw per leaf", best["per leaf"], best["dp"]))
    rows.append(("tree 200 x 16 MiB, raw pickled", best["pickled"], best["dp"]))

    # Non-blocking: MPI moves a call only inside MPI calls, so dp keeps one in flight at a time
    # (`Backend.progresses`); raw, one at a time and all at once.
    quads = [np.ones(2 * MiB, np.float32) for _ in range(4)]

    def one_at_a_time() -> None:
        for q in quads:
            comm.Iallreduce(MPI.IN_PLACE, q, MPI.SUM).Wait()

    def all_at_once() -> None:
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, q, MPI.SUM) for q in quads])

    best = compare(
        {"one": one_at_a_time, "all": all_at_once, "dp": lambda: dp.iallreduce(quads).wait()},
        comm,
    )
    rows.append(("iallreduce 4 x 8 MiB, raw one at a time", best["one"], best["dp"]))
    rows.append(("iallreduce 4 x 8 MiB, raw all at once", best["all"], best["dp"]))

    if comm.rank == 0:
        print(f"dataparallel vs raw mpi4py, {comm.size} ranks, {MPI.Get_library_version()[:12]}")
        print("| case | raw | dataparallel | dp/raw | dp - raw |")
        print("| --- | --- | --- | --- | --- |")
        for name, raw_s, dp_s in rows:
            print(
                f"| {name} | {_fmt(raw_s)} | {_fmt(dp_s)} | {dp_s / raw_s:.2f} "
                f"| {_fmt(dp_s - raw_s)} |"
            )
        raw_s, dp_s = next((r, d) for n, r, d in rows if n == "4 B, checks on")
        print(f"4 B, checks on: dataparallel - raw = {_fmt(dp_s - raw_s)} (issue 9: at most 5 us)")
        for mib in (1, 16, 64):
            raw_s, dp_s = next((r, d) for n, r, d in rows if n == f"{mib} MiB array")
            print(
                f"bandwidth {mib:2} MiB (algorithm bytes/s): raw {mib * MiB / raw_s / 1e9:.2f} "
                f"GB/s, dataparallel {mib * MiB / dp_s / 1e9:.2f} GB/s"
            )
    comm.Free()
    dp.finalize()


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.2f} ms"


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50 (25.6 M floats), registration order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return [*shapes, (1000, 2048), (1000,)]


if __name__ == "__main__":
    main()
