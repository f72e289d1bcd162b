"""One rank of a run of Horovod's suite: pytest on it, with `horovod` resolving to the drop-in.

Started by `run.py` under a launcher (`mpiexec`, `dataparallel run`). Rank 0 prints to the
terminal; the others write their output to `OUTDIR/rank-R.log`. Every rank writes its results to
`OUTDIR/rank-R.xml` (JUnit), which `run.py` reads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent / "shim"


def world_rank() -> int:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def main() -> int:
    test_file, outdir, *extra = sys.argv[1:]
    rank = world_rank()
    if rank > 0:
        log = os.open(Path(outdir) / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
    sys.path.insert(0, str(SHIM))  # `import horovod.torch` is dataparallel.horovod.torch
    sys.path.insert(0, str(SHIM.parent))  # the runner's plugin, _align (ranks meet per test)
    args = [
        test_file,
        "-v",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "-p",
        "_align",
        "-c",
        os.devnull,  # no ini file of the project or of Horovod applies
        "--rootdir",
        str(Path(test_file).resolve().parent),
        f"--junitxml={Path(outdir) / f'rank-{rank}.xml'}",
        *extra,
    ]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())
