"""`dataparallel run --backend gloo`: spawn the ranks locally with torchrun's environment.

Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
`MASTER_PORT`, from which `dp.initialize()` picks Gloo. Their output is streamed line by line with
a `[rank N] ` prefix (`_output.py`). When a child fails, the others are stopped (SIGTERM, then
SIGKILL after a grace period) and the launcher exits with the failed child's status. A child that
exits with status 0 without having finished its script (it left through `os._exit(0)`; each rank
notes how it ended in the run folder, `_rundir.py`) is a failure too (status 1).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from dataparallel.config import (
    MPI_LAUNCHER_VARIABLES,
    MPI_RANK_VARIABLES,
    PREFIXED_VARIABLE,
    RUN_DIR_VARIABLE,
)
from dataparallel.launch._output import Output, pump
from dataparallel.launch._process import (
    EXIT_TIMEOUT,
    Signals,
    exit_status,
    free_port,
    let_leave,
    stop,
    warn,
)
from dataparallel.launch._rundir import RunDir

__all__ = ["Topology", "child_env", "run_gloo"]

RUNNER = "dataparallel.launch.runner"


@dataclass(frozen=True)
class Topology:
    """Where the processes of this node sit in the job, as torchrun numbers them."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @property
    def world_size(self) -> int:
        """Return the number of processes in the whole job."""
        return self.nproc_per_node * self.nnodes

    def rank(self, local_rank: int) -> int:
        """Return the global rank of local process `local_rank` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank


def child_env(
    base: dict[str, str], topology: Topology, local_rank: int, port: int
) -> dict[str, str]:
    """Return the environment of local process `local_rank`: `base` plus torchrun's variables.

    Variables by which an MPI launcher reveals itself are dropped, so that a launcher started
    inside an MPI job does not make `dp.initialize()` pick MPI in its children.
    """
    env = {
        k: v
        for k, v in base.items()
        if k not in MPI_LAUNCHER_VARIABLES and k not in MPI_RANK_VARIABLES
    }
    env.update(
        RANK=str(topology.rank(local_rank)),
        WORLD_SIZE=str(topology.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(topology.nproc_per_node),
        MASTER_ADDR=topology.master_addr,
        MASTER_PORT=str(port),
    )
    env.setdefault("PYTHONUNBUFFERED", "1")  # stream output as it is printed, not at exit
    return env


def _wait(proc: subprocess.Popen[bytes], local_rank: int, exited: queue.Queue[int]) -> None:
    proc.wait()
    exited.put(local_rank)


def run_gloo(target: list[str], topology: Topology, *, timeout: float | None = None) -> int:
    """Run `target` on this node's processes of a Gloo job and return the job's exit status.

    Args:
        target: what the runner runs: `[script, *args]` or `["-m", module, *args]`.
        topology: this node's processes and the rendezvous address; with one node and no
            `master_port`, a free loopback port is chosen.
        timeout: seconds before every rank is stopped (exit status 124).

    Returns:
        0 when every rank succeeded; else the first failed rank's status (128 + N for a death by
        signal N, 1 for a rank that exited with 0 before its script finished), 124 on timeout, or
        128 + N when the launcher was stopped by signal N.
    """
    port = topology.master_port
    if port is None:
        port = free_port(topology.master_addr)
    command = [sys.executable, "-m", RUNNER, "--prefixed", "--parent", str(os.getpid()), *target]
    run_dir = RunDir()
    base = {**os.environ, RUN_DIR_VARIABLE: run_dir.path, PREFIXED_VARIABLE: "1"}
    deadline = None if timeout is None else time.monotonic() + timeout
    exited: queue.Queue[int] = queue.Queue()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    stdout, stderr = Output(sys.stdout), Output(sys.stderr)
    with Signals() as signals:
        try:
            for local in range(topology.nproc_per_node):
                rank = topology.rank(local)
                proc = subprocess.Popen(
                    command,
                    env=child_env(base, topology, local, port),
                    stdin=None if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                procs.append(proc)
                prefix = f"[rank {rank}] ".encode()
                assert proc.stdout is not None and proc.stderr is not None
                for source, output in ((proc.stdout, stdout), (proc.stderr, stderr)):
                    thread = threading.Thread(
                        target=pump, args=(source, output, prefix), daemon=True
                    )
                    thread.start()
                    pumps.append(thread)
                threading.Thread(target=_wait, args=(proc, local, exited), daemon=True).start()
            status = _supervise(procs, topology, run_dir, exited, signals, deadline, timeout)
        finally:
            stop(procs)
            for thread in pumps:
                thread.join(timeout=5.0)
            run_dir.remove()
    return status


def _supervise(
    procs: list[subprocess.Popen[bytes]],
    topology: Topology,
    run_dir: RunDir,
    exited: queue.Queue[int],
    signals: Signals,
    deadline: float | None,
    timeout: float | None,
) -> int:
    """Wait until every rank has exited, or one fails, or time runs out, or a signal comes."""
    remaining = len(procs)
    while remaining:
        if signals.received is not None:
            if signals.received == signal.SIGINT:
                let_leave(procs)
            return 128 + signals.received
        if deadline is not None and time.monotonic() >= deadline:
            warn(f"the job ran past --timeout {timeout:g}s; stopping every rank.")
            return EXIT_TIMEOUT
        stranded = run_dir.stranded()
        if stranded is not None:
            warn(f"{stranded}; stopping the other rank(s).")
            return 1
        with contextlib.suppress(queue.Empty):
            local = exited.get(timeout=0.1)
            remaining -= 1
            if signals.received is not None:  # the ranks died of the launcher's own Ctrl-C
                continue
            status = exit_status(procs[local].returncode)
            rank = topology.rank(local)
            problem = None if status != 0 else run_dir.unfinished_rank(rank)
            if status != 0 or problem is not None:
                others = sum(p.poll() is None for p in procs)
                stopping = f"; stopping the other {others} rank(s)" if others else ""
                if problem is None:
                    warn(f"rank {rank} exited with status {status}{stopping}.")
                    return status
                warn(f"{problem}{stopping}. Status 0 means that every rank finished its script.")
                return 1
    return 0
