"""One rank of `horovod.run`: `python -m dataparallel.horovod._task FOLDER` (one per rank).

Loads the function and its arguments from FOLDER, calls it, and leaves what it returned in
`result-R.pkl`; when it raises, leaves the traceback in `error-R.txt` and raises again, so that
the runner prints it with the rank and ends the job as for any script.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from pathlib import Path

from dataparallel.config import Settings
from dataparallel.horovod._run import FUNCTION_FILE, dumps, error_file, result_file


def _launcher_rank() -> int:
    """Return the rank the launcher gave this process (MPI's, else torchrun's variable)."""
    settings = Settings.from_env()
    if settings.mpi_launched and settings.mpi_rank is not None:
        return settings.mpi_rank
    return settings.rank if settings.rank is not None else 0


def main(folder: Path) -> None:
    """Call the function pickled in `folder` and leave its result, or its traceback, there."""
    rank = _launcher_rank()
    func, args, kwargs = pickle.loads((folder / FUNCTION_FILE).read_bytes())
    try:
        result = func(*args, **kwargs)
    except BaseException:
        (folder / error_file(rank)).write_text(traceback.format_exc(), encoding="utf-8")
        raise
    payload = dumps(result, f"rank {rank}'s return value")
    (folder / f"{result_file(rank)}.part").write_bytes(payload)
    (folder / f"{result_file(rank)}.part").rename(folder / result_file(rank))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
