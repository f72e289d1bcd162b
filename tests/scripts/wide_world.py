"""`wide_world.py`: the collectives in a world over `protocol.GATHER_LIMIT` ranks, NumPy only.

Past that many ranks the handshake is an allreduce of `protocol.BOUNDS` instead of a gather of
records: no payload travels in it (small calls send their values after it), the NaN flag and the
joined marks travel as maxima, and a mismatch is seen as the largest digest differing from the
smallest. Each rank checks its results itself (exact values: integers, or sums that are exact in
their dtype); a failed check raises, and `dp.initialize()`'s hook then aborts the whole job.
Rank 0 prints `MISMATCH <message>` (what every rank raised) and, once every rank has agreed that
all its checks held, `WIDE OK <size> <seconds>` (the seconds from the first collective to the
last). No rank imports torch or JAX: a world this wide on a small machine is only NumPy.
"""

import sys
import time

import numpy as np

import dataparallel as dp
from dataparallel.protocol import GATHER_LIMIT

dp.initialize()
rank, size = dp.rank(), dp.size()
assert size > max(GATHER_LIMIT, 3), f"a world of {size}: this script checks wider ones"
last = size - 1  # beyond the first GATHER_LIMIT ranks
start = time.monotonic()
total = size * (size - 1) // 2  # the sum of the ranks

# allreduce: sum and avg, several dtypes, one tree of them (numbers included)
tree = {
    "f64": np.arange(5, dtype=np.float64) + rank,
    "f32": np.full(7, rank, np.float32),
    "f16": np.ones(3, np.float16),  # 1 per rank: exact in float16
    "i32": np.full((2, 2), rank, np.int32),
    "i64": np.array([rank, -rank], np.int64),
    "c128": np.array([rank + 1j]),
    "metrics": {"loss": float(rank), "count": 1},
}
summed = dp.allreduce(tree)
assert np.array_equal(summed["f64"], size * np.arange(5) + total), summed["f64"]
assert np.array_equal(summed["f32"], np.full(7, total, np.float32)), summed["f32"]
assert summed["f16"].dtype == np.float16 and np.array_equal(summed["f16"], np.full(3, size))
assert np.array_equal(summed["i32"], np.full((2, 2), total)), summed["i32"]
assert np.array_equal(summed["i64"], [total, -total]), summed["i64"]
assert summed["c128"][0] == total + size * 1j, summed["c128"]
assert summed["metrics"] == {"loss": float(total), "count": size}, summed["metrics"]
halves = {"f64": np.full(4, rank, np.float64), "f32": np.full(3, 2.0 * rank, np.float32)}
averaged = dp.allreduce(halves, op="avg")
assert np.array_equal(averaged["f64"], np.full(4, (size - 1) / 2)), averaged["f64"]
assert np.array_equal(averaged["f32"], np.full(3, size - 1, np.float32)), averaged["f32"]
assert dp.allreduce(rank, op="max") == last and dp.allreduce(rank + 5, op="min") == 5

# the NaN flag travels in the bounds: one rank's NaN makes every rank's max NaN
values = np.array([float(rank), 1.0])
if rank == last:
    values[1] = np.nan
peaks = dp.allreduce(values, op="max")
assert peaks[0] == last and np.isnan(peaks[1]), peaks

# broadcast from a rank past the limit, allgather of rows that differ per rank
sent = {"w": np.full(3, rank, np.float32), "step": np.array(rank, np.int64)}
got = dp.broadcast(sent, root=last)
assert np.array_equal(got["w"], np.full(3, last, np.float32)) and int(got["step"]) == last
rows = np.full((rank % 3 + 1, 2), rank, np.int32)
gathered = dp.allgather(rows)
expected = np.concatenate([np.full((r % 3 + 1, 2), r, np.int32) for r in range(size)])
assert np.array_equal(gathered, expected), gathered.shape
assert dp.allgather_object(rank) == list(range(size))

# non-blocking: two reductions in flight, then waited for in the other order
first = dp.iallreduce(np.full(1000, rank, np.float64))
second = dp.iallreduce(np.ones(10, np.int64), op="sum")
assert np.array_equal(second.wait(), np.full(10, size))
assert np.array_equal(first.wait(), np.full(1000, total, np.float64))
assert np.array_equal(dp.ibroadcast(np.full(2, rank), root=last).wait(), [last, last])

# a mismatch: the last rank's shape differs; every rank raises, naming it
try:
    dp.allreduce(np.ones(4 if rank == last else 3))
except dp.CollectiveMismatchError as error:
    message = str(error)
else:
    raise AssertionError(f"rank {rank}: no CollectiveMismatchError")
assert "Ranks called allreduce with different arguments" in message, message
assert f"float64[3] on ranks 0-{last - 1}; float64[4] on rank {last}" in message, message
if rank == 0:
    print("MISMATCH", message.replace("\n", " | "), flush=True)
# ... and a mismatch of collectives, after which the world still works
try:
    if rank == last:
        dp.broadcast(np.ones(2), root=0)
    else:
        dp.allreduce(np.ones(2))
except dp.CollectiveMismatchError as error:
    assert "Ranks called different collectives (allreduce, broadcast)" in str(error), error
else:
    raise AssertionError(f"rank {rank}: no CollectiveMismatchError")
assert np.array_equal(dp.allreduce(np.ones(2)), [size, size])

# joining: the last rank runs out of data first and answers the others' reductions with zeros
if rank == last:
    joined_last = dp.join()
else:
    assert np.array_equal(dp.allreduce(np.ones(3)), np.full(3, size - 1))
    assert dp.allreduce(np.full(2, 1.0), op="avg")[0] == (size - 1) / size
    dp.barrier()
    joined_last = dp.join()
assert joined_last == last - 1, joined_last  # the highest of those that joined last together

elapsed = time.monotonic() - start
agreed = dp.allreduce(1)  # every rank got here: all of its checks held
if rank == 0:
    assert agreed == size
    print(f"WIDE OK {size} {elapsed:.2f}", flush=True)
dp.finalize()
assert "torch" not in sys.modules and "jax" not in sys.modules
