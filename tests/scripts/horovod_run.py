"""Call `horovod.run` from a plain Python process, as Horovod's `pytorch_mnist.py --num-proc` does.

    python horovod_run.py ENGINE N [ok] [fail]

ENGINE is `mpi` or `gloo`. One job per word, in order (none: `ok`): with `ok`, each rank
allreduces its rank and returns what it saw, and the result list is printed as one JSON line;
with `fail`, rank 1 raises instead and this prints the `RuntimeError` that `run` raises, and
exits 3. The function allreduces a NumPy array: what `run` does with it is the same whatever
the framework, and neither this process nor an MPI rank then imports torch.
"""

import json
import sys

import dataparallel.horovod as horovod


def train(offset, *, fail=False):  # defined in __main__: travels by value (cloudpickle)
    import numpy as np

    import dataparallel as dp

    dp.initialize()
    if fail and dp.rank() == 1:
        raise ValueError(f"rank {dp.rank()} cannot train")
    total = dp.allreduce(np.array([float(dp.rank())]), op="sum")
    result = {"rank": dp.rank(), "size": dp.size(), "sum": float(total[0]) + offset}
    dp.finalize()
    return result


engine, n = sys.argv[1], int(sys.argv[2])
for mode in sys.argv[3:] or ["ok"]:
    try:
        results = horovod.run(
            train,
            args=(100,),
            kwargs={"fail": mode == "fail"},
            num_proc=n,
            use_gloo=engine == "gloo",
            use_mpi=engine == "mpi",
        )
    except RuntimeError as exc:
        print("RuntimeError:", exc, flush=True)
        sys.exit(3)
    print(json.dumps(results), flush=True)
