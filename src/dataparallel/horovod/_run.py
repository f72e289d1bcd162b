"""`horovod.run`: call a function on N ranks from Python and get back what each rank returned.

Horovod's `horovod.run(func, args=(), kwargs=None, num_proc=1, ...)` (`horovod/runner/__init__.py`)
over dataparallel's own launcher: the function and its arguments are pickled into a fresh folder
(by value with cloudpickle, so a function defined in `__main__` travels), `dataparallel run -n N`
starts `python -m dataparallel.horovod._task FOLDER` on every rank, and each rank writes what the
function returned (or the traceback it raised) beside them. The list comes back in rank order.

A rank that raises ends the whole job (the launcher's rule) and `run` raises `RuntimeError` naming
that rank and its exception, with its traceback, as Horovod raises `RuntimeError` for a job that
failed. Horovod's options that tune its own machinery (ssh, NIC discovery, its check cache) are
accepted and have no effect; those whose effect cannot be given here (elastic training, per-rank
output files, Gloo across several hosts) are refused with the reason.
"""

from __future__ import annotations

import pickle
import shlex
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

__all__ = ["run"]

_R = TypeVar("_R")  # what the function returns on each rank

# The folder's files: what each rank runs, and what each rank left.
FUNCTION_FILE = "function.pkl"


def result_file(rank: int) -> str:
    """Return the name of the file in which rank `rank` leaves its return value."""
    return f"result-{rank}.pkl"


def error_file(rank: int) -> str:
    """Return the name of the file in which rank `rank` leaves the traceback it raised."""
    return f"error-{rank}.txt"


def dumps(value: object, what: str) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    try:
        if cloudpickle is not None:
            return bytes(cloudpickle.dumps(value))
        return pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"horovod.run: {what} could not be pickled ({type(exc).__name__}: {exc}); every rank "
            "receives it pickled, so it must be picklable (module-level functions always are)."
        ) from exc


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _parse_hosts(hosts: str) -> list[tuple[str, int]]:
    """Parse Horovod's `host1:2,host2:4` into (host, slots) pairs."""
    parsed = []
    for item in hosts.split(","):
        host, _, slots = item.strip().rpartition(":")
        if not host or not slots.isdigit() or int(slots) < 1:
            raise ValueError(
                f"horovod.run: hosts={hosts!r}: expected 'host:slots' items separated by commas "
                "(for example 'node1:2,node2:2'), got the item {item.strip()!r}."
            )
        parsed.append((host, int(slots)))
    return parsed


def _launch_options(
    use_gloo: bool,
    hosts: str | None,
    hostfile: str | None,
    folder: Path,
) -> list[str]:
    """Return `dataparallel run`'s options for the engine and the hosts asked for."""
    if use_gloo:
        where = _parse_hosts(hosts) if hosts else []
        remote = [host for host, _ in where if host not in _LOCAL_HOSTS | {socket.gethostname()}]
        if remote or hostfile:
            raise ValueError(
                "horovod.run: with Gloo, dataparallel starts ranks on this machine only; got "
                f"{'hostfile=' + repr(hostfile) if hostfile else 'hosts=' + repr(hosts)}. Use MPI "
                "(use_mpi=True) across machines, or `dataparallel run --backend gloo --nnodes K` "
                "on each of them."
            )
        return ["--backend", "gloo"]
    options = ["--backend", "mpi"]
    if hosts:
        path = folder / "hostfile"
        path.write_text("".join(f"{host}:{slots}\n" for host, slots in _parse_hosts(hosts)))
        options += ["--hostfile", str(path)]
    elif hostfile:
        options += ["--hostfile", hostfile]
    return options


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _failure(folder: Path, num_proc: int, status: int) -> RuntimeError:
    """Return the error for a job that ended with `status`, naming the ranks that raised."""
    raised = [
        (rank, (folder / error_file(rank)).read_text(encoding="utf-8"))
        for rank in range(num_proc)
        if (folder / error_file(rank)).exists()
    ]
    if not raised:
        return RuntimeError(
            f"horovod.run: the job exited with status {status} and no rank returned from the "
            "function (the launcher's message above says which rank ended it, and how)."
        )
    # A rank that failed because another did (its peer gone: RankFailedError) is named after the
    # ranks that raised of their own accord, whichever engine noticed the death first.
    raised.sort(key=lambda found: ("RankFailedError" in _last_line(found[1]), found[0]))
    rank, text = raised[0]
    last = _last_line(text)
    others = f" (ranks {', '.join(str(r) for r, _ in raised[1:])} raised too)" if raised[1:] else ""
    return RuntimeError(
        f"horovod.run: rank {rank} raised {last}{others}; the job ended with status {status}.\n"
        f"rank {rank}'s traceback:\n{text}"
    )


def run(
    func: Callable[..., _R],
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
    num_proc: int = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Sequence[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[_R]:
    """Run `func(*args, **kwargs)` on `num_proc` ranks and return each rank's result, by rank.

    Horovod's `horovod.run`, over `dataparallel run`: the ranks start on this machine (or on the
    `hosts`/`hostfile` machines under MPI), each calls the function, which calls `hvd.init()`
    itself, and what each returns comes back pickled.

    Args:
        func: the function each rank calls; pickled (by value with cloudpickle when installed).
        args: its positional arguments.
        kwargs: its keyword arguments.
        num_proc: the number of ranks (`np`, Horovod's deprecated name, is accepted with its
            `DeprecationWarning`).
        hosts: `"host1:2,host2:4"` (MPI only), written to a host file for mpiexec.
        hostfile: an MPI host file (MPI only).
        use_gloo: start the ranks with Gloo (`dataparallel run --backend gloo`).
        use_mpi: start them under MPI (the default when mpi4py is installed, as in Horovod).
        mpi_args: further `mpiexec` arguments are not supported: must be None.
        verbose: print the launch command.
        executable: the Python that runs the ranks (default: `sys.executable`).
        output_filename: Horovod's per-rank output files: refused unless None (every rank's
            output reaches this process's stdout and stderr, prefixed with its rank).

    Horovod's elastic options (`min_num_proc`, `max_num_proc`, `slots`, `reset_limit`,
    `cooldown_range`, `host_discovery_script`, and the deprecated `min_np`, `max_np`) are refused
    unless None: dataparallel has no elastic mode. `start_timeout`, `ssh_port`,
    `ssh_identity_file`, `disable_cache`, `network_interface` and `network_interfaces` are
    accepted and unused (they tune Horovod's own start-up).

    Returns:
        The value `func` returned on each rank, in rank order.

    Raises:
        RuntimeError: the job failed: a rank raised (named, with its traceback), or died.
        ValueError: contradictory or unsupported options.
        TypeError: `func`, `args` or `kwargs` cannot be pickled.
    """
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
        num_proc = np
    if min_np is not None or max_np is not None:
        warnings.warn(
            "min_np and max_np are deprecated, use min_num_proc and max_num_proc instead",
            DeprecationWarning,
            stacklevel=2,
        )
        min_num_proc = min_np if min_np is not None else min_num_proc
        max_num_proc = max_np if max_np is not None else max_num_proc
    del start_timeout, ssh_port, ssh_identity_file, disable_cache
    del network_interface, network_interfaces
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"horovod.run: num_proc must be a positive int, got {num_proc!r}.")
    if hosts is not None and hostfile is not None:
        raise ValueError("horovod.run: give hosts or hostfile, not both.")
    if use_gloo and use_mpi:
        raise ValueError("horovod.run: use_gloo and use_mpi cannot both be True.")
    elastic = {
        "min_num_proc": min_num_proc,
        "max_num_proc": max_num_proc,
        "slots": slots,
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
        "host_discovery_script": host_discovery_script,
    }
    refused = [name for name, value in elastic.items() if value is not None]
    if refused:
        raise ValueError(
            f"horovod.run: {', '.join(refused)} belong to Horovod's elastic mode, which "
            "dataparallel does not have; leave them out (num_proc ranks run to the end)."
        )
    if output_filename is not None or mpi_args is not None:
        raise ValueError(
            "horovod.run: output_filename and mpi_args are not supported: every rank's output "
            "reaches this process's stdout and stderr, each line prefixed with its rank."
        )
    if use_gloo is None and not use_mpi:
        import importlib.util

        use_gloo = importlib.util.find_spec("mpi4py") is None  # Horovod: MPI when it is built
    call = (func, tuple(args), dict(kwargs or {}))
    with tempfile.TemporaryDirectory(prefix="dataparallel-horovod-run-") as tmp:
        folder = Path(tmp)
        (folder / FUNCTION_FILE).write_bytes(dumps(call, "the function and its arguments"))
        command = [
            executable or sys.executable,
            "-m",
            "dataparallel",
            "run",
            "-n",
            str(num_proc),
            *_launch_options(bool(use_gloo), hosts, hostfile, folder),
            "-m",
            "dataparallel.horovod._task",
            str(folder),
        ]
        if verbose:
            print(f"horovod.run: {shlex.join(command)}", flush=True)
        status = subprocess.run(command, stdin=subprocess.DEVNULL, check=False).returncode
        if status != 0:
            raise _failure(folder, num_proc, status)
        results: list[_R] = []  # what each rank's func returned, unpickled
        for rank in range(num_proc):
            result = folder / result_file(rank)
            if not result.exists():
                raise RuntimeError(
                    f"horovod.run: the job exited with status 0 but rank {rank} left no result "
                    f"(expected {result})."
                )
            results.append(pickle.loads(result.read_bytes()))
        return results
