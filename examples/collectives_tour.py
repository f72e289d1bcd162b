"""A tour of the collectives: run with `dataparallel run -n 2 examples/collectives_tour.py`.

Every rank holds different values; each step prints what every rank sees afterwards.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import dataparallel as dp


@dataclasses.dataclass
class Layer:
    weight: np.ndarray
    bias: np.ndarray | None


def main() -> None:
    dp.initialize()
    r, n = dp.rank(), dp.size()

    x = np.full(3, r + 1.0)
    dp.print("allreduce sum:", dp.allreduce(x), f"(expected {n * (n + 1) / 2})")
    dp.print("allreduce avg of a number:", dp.allreduce(float(r), op="avg"))

    grads = {"fc1": Layer(np.full((2, 2), float(r)), None), "fc2": [np.ones(4, np.float32) * r]}
    grads = dp.allreduce_gradients(grads)  # fused: one call per dtype bucket
    dp.print("averaged gradient tree:", grads["fc1"].weight.tolist(), grads["fc2"][0].tolist())

    dp.print("broadcast from the last rank:", dp.broadcast(np.arange(3) * r, root=n - 1))
    dp.print("allgather, uneven first axis:", dp.allgather(np.full(r + 1, r)))
    dp.print("allgather_object:", dp.allgather_object({"rank": r, "host": "local"}))

    request = dp.iallreduce(np.ones(1_000_000, np.float32))
    busy = sum(range(10_000))  # work while the reduction is in flight
    dp.print("iallreduce:", request.wait()[:3], "computed meanwhile:", busy)

    state = dp.synchronize({"step": r, "lr": 0.1 * (r + 1), "name": f"rank{r}"})
    dp.print("synchronize (objects kept per rank):", state)

    try:
        dp.allreduce(np.ones(2 + r))  # a different shape on every rank
    except dp.CollectiveMismatchError as error:
        if dp.is_main():
            print(f"mismatch caught on every rank:\n{error}")
    dp.barrier()
    dp.print("the world is still usable:", dp.allreduce(1))


if __name__ == "__main__":
    main()
