"""A stand-in `horovod` package: `import horovod.torch` gives `dataparallel.horovod.torch`.

Put on `sys.path` only by the runner of Horovod's own test suite (`tools/horovod_suite/run.py`),
never installed. Under the Gloo launcher (`dataparallel run --backend gloo`) it also sets the
variables `horovodrun`'s Gloo mode would (`HOROVOD_RANK`, `HOROVOD_SIZE`, ...), by which the
suite tells Gloo runs from MPI runs.
"""

import os

if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
    for ours, theirs in (
        ("RANK", "HOROVOD_RANK"),
        ("WORLD_SIZE", "HOROVOD_SIZE"),
        ("LOCAL_RANK", "HOROVOD_LOCAL_RANK"),
        ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"),
    ):
        if ours in os.environ:
            os.environ.setdefault(theirs, os.environ[ours])
