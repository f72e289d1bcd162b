"""`dataparallel run --min-np M [--max-np K] [--host-discovery-script S]`: an elastic run.

The launcher holds a TCP store that outlives every worker and writes *rounds* in it: the
members of each successive world (`dataparallel.elastic.rounds`). It starts `-n` workers (fewer
if discovery reports fewer slots), each the runner with the store's address and a worker id
(`w0`, `w1`, ...; ids are never reused), and then:

- a worker killed by a signal (SIGKILL, the OOM killer, a lost node) is *lost*: its slot is not
  used again (Horovod blacklists the host; here, one machine, the slot) and, while at least
  `--min-np` workers remain, a round of the survivors opens. The survivors, whose collectives
  failed with `RankFailedError`, join it (`elastic.run`);
- a worker that fails otherwise (a traceback, a non-zero exit) ends the run, as without
  `--min-np`: re-forming would not fix a bug;
- `--host-discovery-script S` is run every second; it prints Horovod's `HOST:SLOTS` lines (this
  launcher starts workers on this machine only: `localhost`, `127.0.0.1` or its hostname). When
  it reports more slots than are in use (up to `--max-np`), new workers start and a round with
  them opens; the others see it at their next `commit()` (`HostsUpdatedInterrupt`). When it
  reports fewer, the newest workers are *removed*: a round without them opens, and at that
  commit they leave with status 0 (`rounds.WorkerRemoved`) while the others re-form;
- fewer than `--min-np` workers for `--elastic-timeout` seconds ends the run (status 1) with the
  slots missing named; more than `--reset-limit` re-formed worlds end it too.

The run succeeds (status 0) when every worker still in it has finished its script.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from dataparallel.config import (
    ELASTIC_STORE_VARIABLE,
    ELASTIC_TIMEOUT_VARIABLE,
    ELASTIC_WORKER_VARIABLE,
    MPI_LAUNCHER_VARIABLES,
    MPI_RANK_VARIABLES,
)
from dataparallel.errors import DataParallelError
from dataparallel.launch._output import Output, pump
from dataparallel.launch._process import (
    EXIT_TIMEOUT,
    Signals,
    exit_status,
    let_leave,
    stop,
    warn,
)
from dataparallel.launch._rundir import signal_name

__all__ = ["DiscoveryError", "ElasticOptions", "discover", "run_elastic"]

RUNNER = "dataparallel.launch.runner"
# How often the discovery script is run (Horovod: every second).
DISCOVERY_INTERVAL = 1.0
# How long the discovery script may take.
DISCOVERY_TIMEOUT = 30.0
# A worker waits this much longer than the launcher for a world to form: the launcher decides.
_WORKER_MARGIN = 30.0
_LOCAL_NAMES = frozenset(("localhost", "127.0.0.1", "::1"))


class DiscoveryError(DataParallelError):
    """The host discovery script failed or printed something other than `HOST:SLOTS` lines."""


@dataclass(frozen=True)
class ElasticOptions:
    """`dataparallel run`'s elastic options, checked."""

    n: int
    min_np: int
    max_np: int
    discovery: str | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None


def discover(script: str) -> int:
    """Run the discovery script and return the slots it reports on this machine.

    Raises:
        DiscoveryError: the script failed, timed out, or printed a line that is not `HOST` or
            `HOST:SLOTS` with a positive SLOTS, or named a host other than this machine.
    """
    try:
        done = subprocess.run(
            [script],
            capture_output=True,
            text=True,
            timeout=DISCOVERY_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiscoveryError(f"--host-discovery-script {script!r} could not run: {exc}") from exc
    if done.returncode != 0:
        raise DiscoveryError(
            f"--host-discovery-script {script!r} exited with status {done.returncode}"
            + (f": {done.stderr.strip()}" if done.stderr.strip() else "")
        )
    slots = 0
    here = _LOCAL_NAMES | {socket.gethostname()}
    for number, line in enumerate(done.stdout.splitlines(), 1):
        text = line.strip()
        if not text:
            continue
        host, colon, count = text.partition(":")
        if colon and (not count.strip().isdigit() or int(count) < 1):
            raise DiscoveryError(
                f"--host-discovery-script {script!r}, line {number}: {text!r} is not HOST:SLOTS "
                "with a positive number of slots (Horovod's format, e.g. localhost:4)."
            )
        if host.strip() not in here:
            raise DiscoveryError(
                f"--host-discovery-script {script!r}, line {number}: host {host.strip()!r} is not "
                f"this machine ({', '.join(sorted(here))}): elastic runs start workers on this "
                "machine only."
            )
        slots += int(count) if colon else 1
    return slots


@dataclass
class _Worker:
    id: str
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread] = field(default_factory=list)


class _Run:
    """The launcher's state: the store, the workers, the rounds."""

    def __init__(self, target: list[str], options: ElasticOptions) -> None:
        from dataparallel.backends.gloo.group import import_torch_distributed

        self.options, self.target = options, target
        dist = import_torch_distributed()
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self.address = f"127.0.0.1:{self.store.port}"
        self.workers: dict[str, _Worker] = {}  # running and in the run, in joining order
        self.removed: dict[str, _Worker] = {}  # left out of the run, not yet gone
        self.finished: list[str] = []
        self.lost: list[str] = []
        self.generation = -1
        self.started_in: dict[str, int] = {}  # worker -> the first round it is a member of
        self.exits: queue.Queue[str] = queue.Queue()
        self.stdout, self.stderr = Output(sys.stdout), Output(sys.stderr)
        self._ids = 0

    def start_worker(self) -> str:
        worker_id = f"w{self._ids}"
        self._ids += 1
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in MPI_LAUNCHER_VARIABLES and k not in MPI_RANK_VARIABLES
        }
        env.update(
            {
                ELASTIC_STORE_VARIABLE: self.address,
                ELASTIC_WORKER_VARIABLE: worker_id,
                ELASTIC_TIMEOUT_VARIABLE: f"{self.options.elastic_timeout + _WORKER_MARGIN:g}",
            }
        )
        env.setdefault("PYTHONUNBUFFERED", "1")
        command = [sys.executable, "-m", RUNNER, "--prefixed", "--parent", str(os.getpid())]
        proc = subprocess.Popen(
            [*command, *self.target],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        worker = _Worker(worker_id, proc)
        prefix = f"[worker {worker_id[1:]}] ".encode()
        assert proc.stdout is not None and proc.stderr is not None
        for source, output in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
            thread = threading.Thread(target=pump, args=(source, output, prefix), daemon=True)
            thread.start()
            worker.pumps.append(thread)
        threading.Thread(target=self._wait, args=(worker,), daemon=True).start()
        self.workers[worker_id] = worker
        return worker_id

    def _wait(self, worker: _Worker) -> None:
        worker.proc.wait()
        self.exits.put(worker.id)

    def open_round(self) -> None:
        """Publish a round of the workers in the run, in joining order (rank order)."""
        from dataparallel.elastic.forming import round_key
        from dataparallel.elastic.rounds import LATEST, supersede

        supersede(self.store, self.generation)
        self.generation += 1
        members = list(self.workers)
        for member in members:
            self.started_in.setdefault(member, self.generation)
        self.store.set(round_key(self.generation), json.dumps(members))
        self.store.set(LATEST, str(self.generation))

    def remove(self, count: int, slots: int) -> None:
        """Leave the newest `count` workers out of the next round (discovery leaves the run
        `slots`): told through the store, they leave at their next commit, with status 0."""
        from dataparallel.elastic.rounds import removed_key

        for worker_id in list(self.workers)[-count:]:
            self.store.set(removed_key(worker_id), "1")
            self.removed[worker_id] = self.workers.pop(worker_id)
            warn(
                f"worker {worker_id[1:]} is removed (the discovery script leaves the run {slots} "
                "slot(s)): it leaves at its next commit."
            )

    def drop_unformed(self) -> None:
        """Stop the workers of a round that cannot form any more (a member finished its script
        first): they never joined a world, and the run is ending."""
        from dataparallel.elastic.rounds import ready_key

        if self.generation < 0 or self.store.check([ready_key(self.generation)]):
            return
        newcomers = [w for w in self.workers if self.started_in.get(w) == self.generation]
        stop([self.workers.pop(w).proc for w in newcomers])

    def close(self) -> None:
        everyone = [*self.workers.values(), *self.removed.values()]
        stop([worker.proc for worker in everyone])
        for worker in everyone:
            for thread in worker.pumps:
                thread.join(timeout=5.0)


def run_elastic(target: list[str], options: ElasticOptions, *, timeout: float | None = None) -> int:
    """Run `target` as an elastic job and return its exit status (see the module's notes).

    Returns:
        0 when every worker still in the run finished its script; a failed worker's status; 1
        when the run stayed below `--min-np` past `--elastic-timeout`, exceeded `--reset-limit`
        or discovery failed; 124 past `timeout`; 128 + N when the launcher got signal N.
    """
    run = _Run(target, options)
    deadline = None if timeout is None else time.monotonic() + timeout
    with Signals() as signals:
        try:
            return _supervise(run, options, signals, deadline, timeout)
        except DiscoveryError as exc:
            warn(f"{exc}; stopping the run.")
            return 1
        finally:
            run.close()


def _capacity(options: ElasticOptions, lost: int) -> int:
    """Slots this run may use now: discovery's (or -n), less the lost ones, at most --max-np."""
    slots = options.n if options.discovery is None else discover(options.discovery)
    return min(options.max_np, slots - lost)


def _supervise(
    run: _Run,
    options: ElasticOptions,
    signals: Signals,
    deadline: float | None,
    timeout: float | None,
) -> int:
    capacity = _capacity(options, 0)
    for _ in range(min(options.n, capacity)):
        run.start_worker()
    below_since: float | None = None
    next_discovery = time.monotonic() + DISCOVERY_INTERVAL
    if len(run.workers) >= options.min_np:
        run.open_round()
    else:
        below_since = time.monotonic()
    while run.workers:
        if signals.received is not None:
            if signals.received == signal.SIGINT:
                let_leave([worker.proc for worker in run.workers.values()])
            return 128 + signals.received
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            warn(f"the job ran past --timeout {timeout:g}s; stopping every worker.")
            return EXIT_TIMEOUT
        changed = False
        with contextlib.suppress(queue.Empty):
            worker_id = run.exits.get(timeout=0.1)
            worker = run.workers.pop(worker_id, None)
            if worker is None:  # removed, or stopped by drop_unformed
                gone = run.removed.pop(worker_id, None)
                status = None if gone is None else gone.proc.returncode
                if status:
                    warn(f"removed worker {worker_id[1:]} ended with status {status}.")
                continue
            code = worker.proc.returncode
            if code == 0:
                run.finished.append(worker_id)
                run.drop_unformed()
                continue
            if code > 0 or run.finished:
                others = len(run.workers)
                stopping = f"; stopping the other {others} worker(s)" if others else ""
                warn(f"worker {worker_id[1:]} exited with status {code}{stopping}.")
                return exit_status(code)
            run.lost.append(worker_id)
            warn(
                f"worker {worker_id[1:]} was lost ({signal_name(-code)}); "
                f"{len(run.workers)} worker(s) remain."
            )
            changed = True
        if options.discovery is not None and now >= next_discovery and not run.finished:
            next_discovery = now + DISCOVERY_INTERVAL
            capacity = _capacity(options, len(run.lost))
            while len(run.workers) < capacity:
                run.start_worker()
                changed = True
            keep = max(capacity, options.min_np)  # never below --min-np: see docs/elastic.md
            if len(run.workers) > keep:
                run.remove(len(run.workers) - keep, capacity)
                changed = True
        if changed:
            if len(run.workers) >= options.min_np:
                below_since = None
                if options.reset_limit is not None and run.generation >= options.reset_limit:
                    warn(
                        f"the run was re-formed {run.generation} time(s), and --reset-limit is "
                        f"{options.reset_limit}; stopping."
                    )
                    return 1
                run.open_round()
            elif below_since is None:
                below_since = now
        if below_since is not None and now - below_since >= options.elastic_timeout:
            missing = options.min_np - len(run.workers)
            lost = ", ".join(w[1:] for w in run.lost) or "none"
            warn(
                f"the run has {len(run.workers)} worker(s), fewer than --min-np "
                f"{options.min_np}, since {options.elastic_timeout:g} s (--elastic-timeout): "
                f"{missing} slot(s) missing on this machine (lost: worker(s) {lost}); stopping."
            )
            return 1
    return 0
