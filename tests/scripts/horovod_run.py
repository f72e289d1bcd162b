"""Call `horovod.run` from a plain Python process, as Horovod's `pytorch_mnist.py --num-proc` does.

    python horovod_run.py ENGINE N [ok] [fail]

ENGINE is `mpi` or `gloo`. One job per word, in order (none: `ok`): with `ok`, each rank
allreduces its rank through the drop-in and returns what it saw, and the result list is printed
as one JSON line; with `fail`, rank 1 raises instead and this prints the `RuntimeError` that
`run` raises, and exits 3.
"""

import json
import sys

import torch

import dataparallel.horovod as horovod
import dataparallel.horovod.torch as hvd


def train(offset, *, fail=False):  # defined in __main__: travels by value (cloudpickle)
    hvd.init()
    if fail and hvd.rank() == 1:
        raise ValueError(f"rank {hvd.rank()} cannot train")
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    result = {"rank": hvd.rank(), "size": hvd.size(), "sum": total.item() + offset}
    hvd.shutdown()
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
