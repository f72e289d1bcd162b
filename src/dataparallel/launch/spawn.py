"""`dataparallel run --backend gloo`: start this machine's processes of a job, and supervise them.

One loop serves every local launch, because a plain launch is an elastic one with a fixed n:
its processes are ranks from the start, placed by torchrun's variables (`Topology`), and the
first failure, a death by signal included, ends the job. An elastic launch (`--min-np`,
`ElasticOptions`) starts *workers* instead, and holds a TCP store that outlives them, where it
publishes the members of each successive world (`dataparallel.elastic`). Which departures
re-form the world and which end the run is the policy of docs/elastic.md: a worker killed by a
signal (or whose ssh ends with 255: its host or link gone, which ssh notices within
`--link-timeout`) is lost and the survivors re-form, since re-forming cannot fix a bug that
raised; so is a worker of another host whose heartbeat stood still for `--link-timeout`; a
round that leaves out workers lost by their link lists them, so that the others cut their
connections to them instead of waiting on them (`dataparallel.elastic.liveness`); a
worker that exits 0 finished and leaves; `--blacklist-cooldown-range` sets a failing host aside
for a doubling cool-down (Horovod's blacklist); the discovery script is followed every second
and its later failures keep the last slots (Horovod's rule); too few workers for
`--elastic-timeout`, or more than `--reset-limit` re-formed worlds (counted when a world forms),
end the run with status 1.

With a host list (`-H a:2,b:2`, `--hostfile`) the ranks of other hosts start over ssh
(`dataparallel.launch.hosts`) and are supervised as the local ones, so one rule covers both:
every output line is prefixed with its process (`[rank R] `, `[rank R on HOST] `,
`[worker N] `), Ctrl-C gives each process time to report its `KeyboardInterrupt`, `--timeout`
stops the job with status 124, and the job succeeds only when every process still in it finished
its script (a rank that leaves through `os._exit(0)` first fails it: `process.RunDir`).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataparallel.backends.rendezvous import address_toward
from dataparallel.config import (
    ELASTIC_STORE_VARIABLE,
    ELASTIC_TIMEOUT_VARIABLE,
    ELASTIC_WORKER_VARIABLE,
    LINK_TIMEOUT_VARIABLE,
    PREFIXED_VARIABLE,
    RUN_DIR_VARIABLE,
)
from dataparallel.errors import DataParallelError
from dataparallel.launch.hosts import (
    HostError,
    HostSlots,
    RemoteRank,
    Slot,
    Ssh,
    check_hosts,
    forwarded,
    hosts_of,
    is_local,
    remote_command,
)
from dataparallel.launch.process import (
    EXIT_TIMEOUT,
    RUNNER,
    Output,
    RunDir,
    Signals,
    child_environment,
    exit_status,
    free_port,
    let_leave,
    name_ranks,
    pump,
    signal_name,
    stop,
    torchrun_environment,
    warn,
)

if TYPE_CHECKING:
    from dataparallel.elastic.liveness import Heartbeats

__all__ = [
    "DiscoveryError",
    "ElasticOptions",
    "Topology",
    "cooldown_seconds",
    "discover",
    "run_gloo",
    "split_losers",
]

# How often the discovery script is run (Horovod: every second), and how long it may take.
DISCOVERY_INTERVAL = 1.0
DISCOVERY_TIMEOUT = 30.0
# A worker waits this much longer than the launcher for a world to form: the launcher decides.
_WORKER_MARGIN = 30.0
# How long a rank's failure for another rank's going (`RankFailedError`) waits for that rank's
# own exit to show, which then names the job's failure; past it, the waiting rank is named.
_CAUSE_SECONDS = 2.0
_LOCAL_NAMES = frozenset(("localhost", "127.0.0.1", "::1"))
# How long the loop waits for an exit (or a report, `_WAKE`) before it looks at the rest: the
# heartbeats, whether the newest round formed, discovery, the deadline (seconds).
_LOOK = 0.1
_WAKE = -1  # on `exits`: not a process's exit, a report of a split for the loop


def split_losers(cut: set[tuple[str, str]], hosts: dict[int, str]) -> list[tuple[str, str]]:
    """Return the hosts an elastic run drops for the pairs of `cut` (hosts whose workers cannot
    reach each other, though the launcher reaches both), each with a host it was cut off from.
    `hosts`: where each running worker is, by number (the rank order). Until no pair is left,
    the host in the most pairs goes; among those, the one with fewer workers; on a tie, the one
    whose first worker joined later, so that the lowest ranks go on.

    >>> split_losers({("a", "b"), ("b", "c")}, {0: "a", 1: "b", 2: "b", 3: "c"})  # b, alone
    [('b', 'a')]
    >>> split_losers({("b", "c")}, {0: "a", 1: "b", 2: "c"})
    [('c', 'b')]
    """

    def order(host: str) -> tuple[int, int, int]:
        numbers = [n for n, h in hosts.items() if h == host]
        return degree[host], -len(numbers), min(numbers, default=len(hosts))

    left, dropped = set(cut), []
    while left:
        degree = collections.Counter(host for pair in left for host in pair)
        loser = max(sorted(degree), key=order)
        other = min(h for pair in left if loser in pair for h in pair if h != loser)
        dropped.append((loser, other))
        left = {pair for pair in left if loser not in pair}
    return dropped


class DiscoveryError(DataParallelError):
    """The host discovery script failed or printed something other than `HOST:SLOTS` lines."""


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


@dataclass(frozen=True)
class ElasticOptions:
    """`dataparallel run`'s elastic options, checked; `-n` is the `Topology`'s `nproc_per_node`.

    `hosts` (`-H`/`--hostfile`) are the slots where no discovery script is given; `cooldown`
    (seconds, lowest and highest) sets a host aside after a loss there instead of its slot."""

    min_np: int
    max_np: int
    discovery: str | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    hosts: tuple[HostSlots, ...] | None = None
    cooldown: tuple[float, float] | None = None


def cooldown_seconds(limits: tuple[float, float], times: int) -> float:
    """Horovod's cool-down of a host set aside for the `times`-th time (1, 2, ...): the lower
    limit doubled each time plus up to one lower limit at random (hosts set aside together do
    not all come back at once), kept within the limits."""
    low, high = limits
    return max(low, min(high, low * (1 << min(times, 30)) + random.uniform(0, 1) * low))


def discover(script: str) -> dict[str, int]:
    """Run the discovery script and return the slots it reports, by host, in its order (a
    host listed twice gets the sum).

    Raises:
        DiscoveryError: the script failed, timed out, or printed a line that is not `HOST` or
            `HOST:SLOTS` with a positive SLOTS.
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
    slots: dict[str, int] = {}
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
        name = host.strip()
        slots[name] = slots.get(name, 0) + (int(count) if colon else 1)
    return slots


def run_gloo(
    target: list[str],
    topology: Topology,
    *,
    elastic: ElasticOptions | None = None,
    timeout: float | None = None,
    slots: list[Slot] | None = None,
    ssh: Ssh | None = None,
) -> int:
    """Run `target` on this node's processes of a Gloo job and return the job's exit status.

    Args:
        target: what the runner runs: `[script, *args]` or `["-m", module, *args]`.
        topology: this node's processes and the rendezvous address; with one node and no
            `master_port`, a free loopback port is chosen.
        elastic: run elastically with these options (`topology.nproc_per_node` workers to
            start with, on its hosts or the discovery script's, this machine's by default), or
            None for a fixed world.
        timeout: seconds before every process is stopped (exit status 124).
        slots: every rank of the job and its host (`hosts.place`), for a launch across hosts:
            the ranks of other hosts start over `ssh`, the rendezvous is `topology`'s
            `master_addr` and `master_port`, and its `nproc_per_node` is ignored.
        ssh: how to reach the other hosts (default: ssh's own settings).

    Raises:
        HostError: a host of `slots` (or of an elastic run's first slots) cannot be reached, or
            lacks this working directory or this interpreter (before any rank starts).

    Returns:
        0 when every process still in the job finished its script; else the first failed one's
        status (128 + N for a death by signal N, 1 for one that exited with 0 before its script
        finished), 1 when an elastic run stayed below `--min-np` past `--elastic-timeout`,
        exceeded `--reset-limit` or discovery failed, 124 on timeout, or 128 + N when the
        launcher was stopped by signal N.
    """
    job = _Job(target, topology, elastic, slots, ssh or Ssh())
    deadline = None if timeout is None else time.monotonic() + timeout
    with Signals() as signals:
        try:
            return job.supervise(signals, deadline, timeout)
        except DiscoveryError as exc:
            warn(f"{exc}; stopping the run.")
            return 1
        finally:
            job.close()


@dataclass
class _Process:
    """One process of the job: a rank (fixed world) or a worker (elastic), by its number."""

    number: int
    proc: subprocess.Popen[bytes]
    host: str | None = None  # with a host list: where it runs
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def id(self) -> str:
        """Return the worker's id in the elastic store (ids are never reused)."""
        return f"w{self.number}"


class _Job:
    """This node's processes, what the launcher tells them, and what their exits mean.

    A fixed world gives each rank torchrun's variables and a run folder; an elastic one gives
    each worker the store, and opens a *round* (`dataparallel.elastic.rounds`) with the workers
    in the run, in joining order (rank order), whenever they change.
    """

    def __init__(
        self,
        target: list[str],
        topology: Topology,
        elastic: ElasticOptions | None,
        slots: list[Slot] | None = None,
        ssh: Ssh | None = None,
    ):
        self.target, self.topology, self.elastic = target, topology, elastic
        self.slots, self.ssh = slots, ssh or Ssh()
        self.local = {} if slots is None else {h: is_local(h) for h in hosts_of(slots)}
        self.noun = "rank" if elastic is None else "worker"
        self.everyone: list[_Process] = []
        self.running: dict[int, _Process] = {}  # running and in the job, in joining order
        self.removed: dict[int, _Process] = {}  # left out of an elastic run, not yet gone
        self.finished: list[int] = []
        self.lost: list[int] = []
        self.cut_off: list[str] = []  # workers lost by their link since the last round opened
        # Reports of a peer lost by its link (`rounds.report_split`), as the listener pops them
        # from the store (`_listen`), which then wakes the loop through `exits` (`_WAKE`).
        self.reports: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.listener: threading.Thread | None = None
        self.notify = False  # whether workers follow the rounds (`liveness.follows`)
        self.heartbeats: Heartbeats | None = None  # elastic, with a link timeout
        # Ranks that failed because another rank went (`RankFailedError`), and since when: the
        # job's failure is that other rank's, once its exit shows.
        self.left_behind: dict[int, int] = {}  # rank -> its status
        self.left_behind_since: float | None = None
        self.exits: queue.Queue[int] = queue.Queue()
        self.stdout, self.stderr = Output(sys.stdout), Output(sys.stderr)
        self.env = child_environment()
        self.run_dir: RunDir | None = None
        self.store: Any = None  # torch's TCPStore
        self.generation = -1
        self.formed = -1  # the newest round known to have formed
        self.resets = 0  # rounds formed after the first
        self.members: dict[int, list[int]] = {}  # round -> its workers, in rank order
        self.started_in: dict[int, int] = {}  # worker -> the first round it is a member of
        # Elastic: the slots by host (discovery's last report, -H's, or -n on this machine), the
        # workers lost on each since it last came back, and the hosts set aside until when.
        self.offered: dict[str, int] = {}
        if elastic is not None and elastic.discovery is None:
            hosts = elastic.hosts or (HostSlots("localhost", topology.nproc_per_node),)
            self.offered = {entry.host: entry.slots for entry in hosts}
        self.lost_on: collections.Counter[str] = collections.Counter()
        self.aside: dict[str, float] = {}
        self.times_aside: collections.Counter[str] = collections.Counter()
        self.store_host = "127.0.0.1"  # where workers reach the store: another host's way in
        self.unreachable: set[str] = set()  # hosts said to be out of reach of a loopback store
        self.discovery_failing = False  # its last call failed (said once, not every second)
        self.below_since: float | None = None  # since when fewer than --min-np workers run
        self.next_discovery = 0.0  # when discovery runs next
        if elastic is None:
            port = topology.master_port
            self.port = free_port(topology.master_addr) if port is None else port
            self.run_dir = RunDir()
            self.env.update({RUN_DIR_VARIABLE: self.run_dir.path, PREFIXED_VARIABLE: "1"})
        else:
            self.env[ELASTIC_TIMEOUT_VARIABLE] = f"{elastic.elastic_timeout + _WORKER_MARGIN:g}"
            if self.ssh.link_timeout is not None:
                from dataparallel.elastic.liveness import Heartbeats

                self.heartbeats = Heartbeats(self.ssh.link_timeout)
        if self.ssh.link_timeout is not None and (elastic is not None or slots is not None):
            # How long a rank of another host waits for the launcher's beats (`RemoteRank`),
            # and an elastic worker for its store's answer.
            self.env[LINK_TIMEOUT_VARIABLE] = f"{self.ssh.link_timeout:g}"

    def _is_local(self, host: str) -> bool:
        if host not in self.local:
            try:
                self.local[host] = is_local(host)
            except HostError:
                self.local[host] = False  # ssh will say what is wrong with it
        return self.local[host]

    def _where(self, host: str | None) -> str:
        """How a process's host is named in its lines: always in a fixed world across hosts;
        in an elastic run once its hosts are not all this machine."""
        if host is None:
            return ""
        if self.elastic is not None and all(map(self._is_local, self.offered)):
            return ""
        return f" on {host}"

    def _running_on(self, host: str) -> int:
        return sum(1 for p in self.running.values() if p.host == host)

    def _usable(self, host: str) -> int:
        """The slots of `host` that workers may hold: its offer less those lost there."""
        return max(0, self.offered.get(host, 0) - self.lost_on[host])

    def _free_host(self) -> str | None:
        """The first host, in the offer's order, with a slot for a new worker (None: none)."""
        for host in self.offered:
            if host in self.aside or self._running_on(host) >= self._usable(host):
                continue
            if self.store_host in _LOCAL_NAMES and not self._is_local(host):
                if host not in self.unreachable:
                    self.unreachable.add(host)
                    warn(
                        f"host {host!r} is not this machine, and the run began on this machine "
                        "only, with its store on loopback: no worker starts there. Start the "
                        "run with --master-addr (this machine's address that every host "
                        "reaches), or with another host in the first discovery."
                    )
                continue
            return host
        return None

    def _store_address(self) -> str:
        """Where workers reach the launcher's store: `--master-addr` if given, else this
        machine's address toward the first other host of the offer, else loopback."""
        if self.topology.master_addr not in _LOCAL_NAMES:
            return self.topology.master_addr
        for host in self.offered:
            if not self._is_local(host):
                here = address_toward(host, 9)  # the port only picks a route
                if here is not None:
                    return here
        return "127.0.0.1"

    def start(self) -> bool:
        """Start the next process: rank by rank in a fixed world, a new worker id when elastic
        (on the first host with a free slot); False when an elastic run has no free slot."""
        number = len(self.everyone)
        env = dict(self.env)
        stdin: int | None = subprocess.DEVNULL
        host = None
        if self.elastic is None:
            topology = self.topology
            slot = Slot(topology.rank(number), "", number, topology.nproc_per_node)
            if self.slots is not None:
                slot = self.slots[number]
                host = slot.host
            number = slot.rank
            size, node, nodes = topology.world_size, topology.node_rank, topology.nnodes
            if self.slots is not None:  # nodes: the hosts, in the order of their first rank
                hosts = list(dict.fromkeys(each.host for each in self.slots))
                size, node, nodes = len(self.slots), hosts.index(slot.host), len(hosts)
            env.update(
                torchrun_environment(
                    rank=number,
                    world_size=size,
                    local_rank=slot.local_rank,
                    local_world_size=slot.local_size,
                    group_rank=node,
                    group_world_size=nodes,
                    master_addr=topology.master_addr,
                    master_port=self.port,
                )
            )
            if number == 0:
                stdin = None  # the terminal's input goes to rank 0, as under torchrun
        else:
            host = self._free_host()
            if host is None:
                return False
            env[ELASTIC_WORKER_VARIABLE] = f"w{number}"
        proc: subprocess.Popen[bytes]
        if host is not None and not self._is_local(host):
            runner = [sys.executable, "-m", RUNNER, "--prefixed", "--remote", *self.target]
            proc = RemoteRank(host, self.ssh, remote_command(os.getcwd(), forwarded(env), runner))
        else:
            command = [sys.executable, "-m", RUNNER, "--prefixed", "--parent", str(os.getpid())]
            proc = subprocess.Popen(
                [*command, *self.target],
                env=env,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        process = _Process(number, proc, host)
        where = self._where(host)
        prefix = f"[{self.noun} {number}{where}] ".encode()
        assert proc.stdout is not None and proc.stderr is not None
        for source, output in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
            thread = threading.Thread(target=pump, args=(source, output, prefix), daemon=True)
            thread.start()
            process.pumps.append(thread)
        threading.Thread(target=self._wait, args=(process,), daemon=True).start()
        self.everyone.append(process)
        self.running[number] = process
        return True

    def _open_store(self) -> None:
        """Start the elastic run's store (torch's), once the first discovery and the hosts have
        answered: a run that ends before any worker starts never imports torch; and, where the
        workers watch their links, the listener for their reports of a split."""
        from dataparallel.backends.gloo.group import import_torch_distributed

        self.store = import_torch_distributed().TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self.env[ELASTIC_STORE_VARIABLE] = f"{self.store_host}:{self.store.port}"
        from dataparallel.elastic.liveness import follows

        self.notify = follows(self.store_host)
        if self.notify:  # only workers that watch their links report a split
            self.listener = threading.Thread(
                target=self._listen, name="dataparallel-splits", daemon=True
            )
            self.listener.start()

    def _listen(self) -> None:
        """Hand each report of a split to the loop as it comes, and wake the loop; end at the
        empty report that `close` pushes (or when the store is gone)."""
        from dataparallel.elastic.liveness import FOLLOW_WAIT, SPLITS, client, popped

        try:
            for report in popped(client(("127.0.0.1", self.store.port), FOLLOW_WAIT), SPLITS):
                self.reports.put(json.loads(report))
                self.exits.put(_WAKE)
        except RuntimeError:  # the store is gone: the run is ending
            return

    def _wait(self, process: _Process) -> None:
        process.proc.wait()
        self.exits.put(process.number)

    def supervise(self, signals: Signals, deadline: float | None, timeout: float | None) -> int:
        """Wait until every process has finished, or the job must end; return its status."""
        n = self.topology.nproc_per_node if self.slots is None else len(self.slots)
        first = n
        if self.elastic is not None:
            first = min(n, self._capacity())  # the first discovery: it must succeed
            self.store_host = self._store_address()
            for host in self.offered:
                self._is_local(host)
        others = [host for host, local in self.local.items() if not local]
        if others:  # before any rank starts: no rank waits for a host that cannot come
            check_hosts(others, self.ssh, os.getcwd(), sys.executable)
        if self.elastic is not None:
            self._open_store()
        for _ in range(first):
            if not self.start():
                break
        if self.elastic is not None:
            self.next_discovery = time.monotonic() + DISCOVERY_INTERVAL
            self._reform(changed=True)  # the first round, or the wait for --min-np workers
        while self.running:
            if signals.received is not None:
                if signals.received == signal.SIGINT:
                    for process in self.everyone:  # the terminal's Ctrl-C reaches local ones
                        if isinstance(process.proc, RemoteRank):
                            process.proc.send_signal(signal.SIGINT)
                    let_leave([p.proc for p in self.everyone])
                return 128 + signals.received
            if deadline is not None and time.monotonic() >= deadline:
                warn(f"the job ran past --timeout {timeout:g}s; stopping every {self.noun}.")
                return EXIT_TIMEOUT
            stranded = None if self.run_dir is None else self.run_dir.stranded()
            if stranded is not None:
                warn(f"{stranded}; stopping the other rank(s).")
                return 1
            gone = len(self.lost) + len(self.finished)
            with contextlib.suppress(queue.Empty):
                number = self.exits.get(timeout=_LOOK)
                status = None if number == _WAKE else self._exited(number, signals)
                if status is not None:
                    return status
            if self.left_behind:
                status = self._left_behind()
                if status is not None:
                    return status
            if self.elastic is not None:
                self._hear()
                self._settle_split()
                status = self._reform(changed=len(self.lost) + len(self.finished) > gone)
                if status is None:
                    status = self._check_formed()
                if status is not None:
                    return status
        if signals.received is not None:  # the last ones died of the launcher's own Ctrl-C
            return 128 + signals.received
        if self.elastic is not None and not self.finished:
            lost = ", ".join(map(str, self.lost))
            warn(f"every worker was lost (worker(s) {lost}) and none finished its script.")
            return 1
        return 0

    def _exited(self, number: int, signals: Signals) -> int | None:
        """Judge the exit of process `number`: the job's status if it must end, else None.

        A worker killed by a signal in an elastic run is *lost* (noted in `lost`), even after
        another finished (a worker lost in the last commit must not fail a finished run), as is
        one on another host whose ssh reports a signal (128 + N, from the remote shell) or its
        own failure (255: the host or the link gone); any other failure ends the job, as does a
        rank that exited 0 without finishing its script.
        """
        process = self.running.pop(number, None)
        if process is None:  # removed from an elastic run, or stopped by `drop_unformed`
            gone = self.removed.pop(number, None)
            status = None if gone is None else gone.proc.returncode
            if status:
                warn(f"removed worker {number} ended with status {status}.")
            return None
        if signals.received is not None:  # it died of the launcher's own Ctrl-C
            return None
        code = process.proc.returncode
        status = exit_status(code)
        problem = None
        # A rank on another host notes nothing here: its status 0 is taken as finished.
        if code == 0 and self.run_dir is not None and not isinstance(process.proc, RemoteRank):
            problem = self.run_dir.unfinished_rank(number)
        if code == 0 and problem is None:
            self.finished.append(number)
            self.drop_unformed()
            return None
        if code > 0 and self.run_dir is not None and self.run_dir.failed_for_peer(number):
            self.left_behind[number] = status  # judged once the rank that went shows
            if self.left_behind_since is None:
                self.left_behind_since = time.monotonic()
            return None
        others = sum(p.proc.poll() is None for p in self.running.values())
        stopping = f"; stopping the other {others} {self.noun}(s)" if others else ""
        if problem is not None:
            warn(f"{problem}{stopping}. Status 0 means that every rank finished its script.")
            return 1
        remote = isinstance(process.proc, RemoteRank)
        if self.elastic is None or (code > 0 and not (remote and code > 128)):
            why = ""
            if remote and code == 255:  # ssh's own status: a link that went down ends so
                why = " (ssh's own failure, or the rank's: the host or its link may be gone)"
            where = self._where(process.host)
            warn(f"{self.noun} {number}{where} exited with status {status}{why}{stopping}.")
            return status
        self._lose(process, code)
        return None

    def _hear(self) -> None:
        """Lose the workers of other hosts whose heartbeat stood still for --link-timeout, and
        end their ssh (where the link is up after all, the worker dies with it)."""
        remote = {p.id: p for p in self.running.values() if isinstance(p.proc, RemoteRank)}
        if self.heartbeats is None or not remote:
            return
        for worker, seconds in self.heartbeats.silent(self.store, remote).items():
            process = self.running.pop(remote[worker].number)
            process.proc.kill()
            self._lose(process, 255, silent=seconds)

    def _settle_split(self) -> None:
        """Settle a split of the newest round: workers that lost a peer by its link, though the
        launcher still hears both (`rounds.report_split`), left their world and wait for a
        round that nothing else would open. Hosts are dropped until no two left are cut off
        from each other (`split_losers`): their workers are lost, and the others re-form
        without them."""
        from dataparallel.elastic.liveness import address_key

        reports = []
        with contextlib.suppress(queue.Empty):
            while True:  # a report of an older round: that world is gone already
                report = self.reports.get_nowait()
                if report["round"] == self.generation:
                    reports.append(report)
        if not reports:
            return
        hosts_at: dict[str, str] = {}  # a worker's address -> its host
        for process in self.running.values():
            published = address_key(process.id)
            if process.host is not None and self.store.check([published]):
                hosts_at[bytes(self.store.get(published)).decode()] = process.host
        by_id = {p.id: p for p in self.running.values()}
        cut: set[tuple[str, str]] = set()
        for report in reports:
            reporter, peer = by_id.get(report["worker"]), hosts_at.get(report["address"])
            if reporter is None or reporter.host is None or peer in (None, reporter.host):
                continue  # gone already, or its peer is (or shares its host)
            assert peer is not None
            cut.add((min(reporter.host, peer), max(reporter.host, peer)))
        hosts = {n: p.host for n, p in self.running.items() if p.host is not None}
        for host, other in split_losers(cut, hosts):
            for process in [p for p in self.running.values() if p.host == host]:
                self.running.pop(process.number)
                process.proc.kill()
                self._lose(process, 255, split=other)

    def _lose(
        self,
        process: _Process,
        code: int,
        silent: float | None = None,
        split: str | None = None,
    ) -> None:
        """Note worker `process` lost (its exit `code`, `silent` seconds without a heartbeat,
        or dropped in a `split` from that host): its slot is not used again, or with a
        cool-down its host is set aside (Horovod's blacklist)."""
        assert self.elastic is not None and process.host is not None
        host = process.host
        self.lost.append(process.number)
        self.lost_on[host] += 1
        if split is not None:
            how = (
                f"its host and {split} cannot reach each other, though the launcher reaches "
                f"both (a split): {host} has fewer workers, or joined later, and goes"
            )
            self.cut_off.append(process.id)
        elif silent is not None:
            how = f"no heartbeat for {silent:.1f} s: the host or its link gone"
            self.cut_off.append(process.id)  # its peers may wait on it: `elastic.liveness`
        elif code < 0:
            how = signal_name(-code)
        elif code == 255:
            how = "its ssh failed with 255: the host or its link gone"
            self.cut_off.append(process.id)  # its peers may wait on it: `elastic.liveness`
        else:
            how = signal_name(code - 128)
        where = self._where(host)
        remain = len(self.running)
        warn(f"worker {process.number}{where} was lost ({how}); {remain} worker(s) remain.")
        cooldown = self.elastic.cooldown
        if cooldown is not None and host not in self.aside:
            self.times_aside[host] += 1
            seconds = cooldown_seconds(cooldown, self.times_aside[host])
            self.aside[host] = time.monotonic() + seconds
            warn(f"host {host} is set aside for {seconds:.1f} s: no worker starts there.")
        if self._running_on(host) == 0 and not self._is_local(host):
            warn(f"host {host} has no worker left; the run goes on without it.")

    def _left_behind(self) -> int | None:
        """Judge the ranks that failed because another went: name the ranks that finished their
        script while they waited (status 1), or, past `_CAUSE_SECONDS` with no other exit to
        blame, the first of them (its status). None: wait on, for a rank that failed otherwise
        (its note is there, its exit is coming: `_exited` ends the job with its status)."""
        assert self.run_dir is not None and self.left_behind_since is not None
        waiting = sorted(self.left_behind)
        late = time.monotonic() - self.left_behind_since >= _CAUSE_SECONDS
        if not late and self.run_dir.failed_otherwise(waiting):
            return None
        gone = sorted(set(self.finished) | set(self.run_dir.finished()))
        others = sum(p.proc.poll() is None for n, p in self.running.items() if n not in gone)
        stopping = f"; stopping the other {others} rank(s)" if others else ""
        if gone:
            early = name_ranks(gone)
            warn(
                f"{early} finished {'its' if len(gone) == 1 else 'their'} script while "
                f"{name_ranks(waiting)} still waited in a collective call that {early} never made "
                f"(RankFailedError there){stopping}. Every rank must make the same collective "
                f"calls; look for what made {early} finish early (a return, a sys.exit, a skipped "
                "step)."
            )
            return 1
        if not late:
            return None
        first = waiting[0]
        warn(
            f"rank {first} exited with status {self.left_behind[first]}: another rank failed or "
            f"exited while it waited on it, and no other rank of this machine ended{stopping}."
        )
        return self.left_behind[first]

    def _reform(self, *, changed: bool) -> int | None:
        """Follow discovery, and open a round when the workers `changed` (or discovery changed
        them); return the run's status if it must end, else None."""
        elastic = self.elastic
        assert elastic is not None
        now = time.monotonic()
        follow = elastic.discovery is not None or bool(self.aside)
        if follow and now >= self.next_discovery and not self.finished:
            self.next_discovery = now + DISCOVERY_INTERVAL
            capacity = self._rediscover()
            while len(self.running) < capacity and self.start():
                changed = True
            keep = max(capacity, elastic.min_np)  # never below --min-np: see docs/elastic.md
            if len(self.running) > keep:
                self.remove(len(self.running) - keep, capacity)
                changed = True
        if changed and self.running:
            if len(self.running) >= elastic.min_np or self.finished:
                self.below_since = None
                status = self.open_round()
                if status is not None:
                    return status
            elif self.below_since is None:
                self.below_since = now
        if self.below_since is not None and now - self.below_since >= elastic.elastic_timeout:
            missing = elastic.min_np - len(self.running)
            lost = ", ".join(map(str, self.lost)) or "none"
            warn(
                f"the run has {len(self.running)} worker(s), fewer than --min-np "
                f"{elastic.min_np}, since {elastic.elastic_timeout:g} s (--elastic-timeout): "
                f"{missing} slot(s) missing on this machine (lost: worker(s) {lost}); stopping."
            )
            return 1
        return None

    def _capacity(self) -> int:
        """Return the slots an elastic run may use now: discovery's (or -H's, or -n), less the
        lost ones, at most --max-np; a host whose cool-down ended counts whole again."""
        assert self.elastic is not None
        discovery = self.elastic.discovery
        if discovery is not None:
            self.offered = discover(discovery)
        now = time.monotonic()
        for host, until in list(self.aside.items()):
            if until <= now:
                del self.aside[host]
                self.lost_on[host] = 0
                warn(f"host {host}'s cool-down ended: its slots count again.")
        if discovery is None:
            slots = min(self.topology.nproc_per_node, sum(map(self._usable, self.offered)))
        else:
            slots = sum(map(self._usable, self.offered))
        return min(self.elastic.max_np, slots)

    def _rediscover(self) -> int:
        """`_capacity` after the first call: a discovery script that fails now (a host service
        down for a moment) leaves the slots it reported last, and runs again a second later."""
        assert self.elastic is not None
        try:
            capacity = self._capacity()
        except DiscoveryError as exc:
            if not self.discovery_failing:
                warn(
                    f"{exc}; keeping the {sum(self.offered.values())} slot(s) it reported last, "
                    "and retrying."
                )
            self.discovery_failing = True
            return min(self.elastic.max_np, sum(map(self._usable, self.offered)))
        if self.discovery_failing:
            warn(f"the host discovery script works again ({sum(self.offered.values())} slot(s)).")
        self.discovery_failing = False
        return capacity

    def _check_formed(self) -> int | None:
        """Note whether the newest round formed; return 1 if that exceeds --reset-limit."""
        if self.formed < self.generation:
            from dataparallel.elastic.rounds import formed

            if formed(self.store, self.generation):
                return self._formed(self.generation)
        return None

    def _formed(self, generation: int) -> int | None:
        """Round `generation` formed: say what it left out, and count it against --reset-limit
        (a round that never formed does not count); return 1 if the limit is exceeded."""
        assert self.elastic is not None
        before, self.formed = self.formed, generation
        kept = self.members[generation]
        finished = [n for n in self.members.get(before, []) if n in self.finished and n not in kept]
        if finished:
            warn(
                f"round {generation} formed without worker(s) {', '.join(map(str, finished))}, "
                "which finished their script while the others were still training: a worker "
                "that exits 0 leaves the run."
            )
        if generation == 0:
            return None
        self.resets += 1
        limit = self.elastic.reset_limit
        if limit is not None and self.resets > limit:
            warn(f"the run re-formed {self.resets} time(s); --reset-limit is {limit}: stopping.")
            return 1
        return None

    def open_round(self) -> int | None:
        """Publish a round of the workers in the run, in joining order (rank order); return 1
        if the round before, found formed only now, exceeds --reset-limit."""
        from dataparallel.elastic.rounds import publish, supersede

        status = None
        if supersede(self.store, self.generation) and self.formed < self.generation:
            status = self._formed(self.generation)  # it formed since the last look
        self.generation += 1
        members = [p.id for p in self.running.values()]
        self.members[self.generation] = list(self.running)
        for number in self.running:
            self.started_in.setdefault(number, self.generation)
        publish(self.store, self.generation, members, self.cut_off, self.notify)
        self.cut_off = []
        return status

    def remove(self, count: int, slots: int) -> None:
        """Leave `count` workers out of the next round (discovery leaves the run `slots`): the
        newest of the hosts that hold more workers than they now offer, then the newest of all.
        Told through the store, they leave at their next commit, with status 0."""
        from dataparallel.elastic.rounds import removed_key

        over = {
            h: self._running_on(h) - self._usable(h)
            for h in {p.host for p in self.running.values()}
            if h is not None
        }
        newest = list(reversed(self.running))
        chosen: list[int] = []
        for number in newest:  # first the newest of the hosts that hold more than they offer
            host = self.running[number].host
            if len(chosen) < count and host is not None and over[host] > 0:
                chosen.append(number)
                over[host] -= 1
        chosen += [n for n in newest if n not in chosen][: count - len(chosen)]
        for number in chosen:
            process = self.running.pop(number)
            self.store.set(removed_key(process.id), "1")
            self.removed[number] = process
            warn(
                f"worker {number} is removed (the discovery script leaves the run {slots} "
                "slot(s)): it leaves at its next commit."
            )

    def drop_unformed(self) -> None:
        """Stop the workers of a round that cannot form any more (a member finished its script
        first): they never joined a world, and the run is ending."""
        if self.elastic is None or self.generation < 0:
            return
        from dataparallel.elastic.rounds import ready_key

        if self.store.check([ready_key(self.generation)]):
            return
        newcomers = [n for n in self.running if self.started_in.get(n) == self.generation]
        stop([self.running.pop(n).proc for n in newcomers])

    def close(self) -> None:
        """Stop every process still running and the listener, drain their output, and remove
        the run folder."""
        stop([p.proc for p in self.everyone])
        if self.listener is not None:
            from dataparallel.elastic.liveness import SPLITS

            with contextlib.suppress(RuntimeError):
                self.store.queue_push(SPLITS, b"")
            self.listener.join(timeout=5.0)
        for process in self.everyone:
            for thread in process.pumps:
                thread.join(timeout=5.0)
            if process.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    process.proc.stdin.close()
        if self.run_dir is not None:
            self.run_dir.remove()
