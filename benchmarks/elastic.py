"""How long an elastic run stops when a worker is SIGKILLed, against the same run without a failure.

Run: `OMP_NUM_THREADS=1 python benchmarks/elastic.py [--pairs 2] [--workers 3] [--fully-shard]`

The script launches `dataparallel run -n W --min-np 2 --backend gloo` on itself, in pairs taken
in turn: one run in which worker 1 kills itself with SIGKILL in the middle of its 20th step
(after its gradients, before their allreduce), one without. Each worker trains a small MLP with
`dp.DistributedOptimizer` under `@dp.elastic.run`, committing after every step, and notes the
wall-clock time of each commit; the victim notes the moment of its death, the survivors the
moment the world had re-formed (a reset callback). Printed per failure run:

- death -> re-formed: the survivors saw the failure, left the world, the launcher opened a round
  of the survivors, and they made a new Gloo world of it;
- death -> state synced: ... and then synchronized the state (`state.sync()`: from the new rank
  0, or for a fully sharded model cut again from the survivors' commits);
- death -> next commit: ... and then synchronized the state from the new rank 0, redid the step
  lost with the commit and committed it (the figure the issue asks for: at most 5 s);
- the step time (commit to commit) of the run without a failure, and the ratio.

`--fully-shard` times, in the same invocation and in turns, the same model under
`dp.torch.fully_shard` (each layer, then the model) with Adam over its shards, beside the
`DistributedOptimizer` runs: its commits copy each rank's rows to the rank before it, and a
re-form cuts every shard and Adam's state again for the survivors; printed with the ratio of
its death -> next commit to the unsharded run's.

`--hosts` (as root) runs the same across two emulated hosts instead (benchmarks/network.py's
`Link`: two network namespaces joined by a veth pair, unshaped, each running a real sshd with a
key made here): `dataparallel run -H a:2,b:2 --min-np 2`, launched in host a, starting host b's
workers over ssh. Two kinds of failure run, in turns with the clean one: host b's two workers
SIGKILLed at once (their connections close), and host b's link taken down (`ip link set ...
down` on its end of the pair) while its two workers stand still in the middle of step 20, so
that the others wait on them in the step's allreduce (nothing closes: the launcher must find b's
workers' heartbeats silent, `--link-timeout`, and the survivors cut their connections to it).
The link runs are made for each value of `--link-timeouts` (seconds, fractions too); "death" is
then the moment the link went down. The runs without a failure use the least of them, so that a
worker said lost in one (a false "lost": a busy machine taken for a dead link) shows.

`--hosts --split` adds a third host (the three joined by a bridge) and runs `-H a:1,b:1,c:1`
with a split: worker 2 (host c) pauses in the middle of step 20 while the others wait on it,
then c stops reaching b (`ip route add prohibit`, in c alone) while the launcher on a reaches
both, and worker 2 goes on. The workers whose connection between b and c fails report it, and
the launcher drops c (`docs/elastic.md`, *A split*); "death" is the moment of the split, and
the runs without a failure are the same three hosts without one. There each worker also notes
when it passes each phase of the re-form (`note_phases`: the link watch's cut, with what
`TCP_INFO` said of the connection; the error caught; the split reported; the world left; the
next round's group begun and made; the world made), and the launcher's lines are noted as they
come: printed per run, seconds after the split, the first worker to pass each.

Every worker also runs a thread that wakes every 0.1 s, as the heartbeat's does, and notes the
longest gap between two wakes: how long a busy machine keeps such a thread from its turn, the
least a link timeout must exceed. `--busy N` keeps N more processes spinning in each host for
the whole invocation (a machine busy with other work).

`--hosts --split --soak STEPS` asks whether a short link timeout takes a busy machine for a lost
link: runs of the three hosts without any failure, `STEPS` steps each, every value of
`--link-timeouts` in turn (`--pairs` rounds), with `--busy N` processes spinning beside them
(on the machine, outside the hosts: they take the same cores). Printed per run: the steps, the
wall time, the launcher's "was lost" lines (every one a false loss: nothing failed), and the
longest wait of the 0.1 s thread (beyond its 0.1 s).

`--gc-pauses` (one process, no launcher) times a full garbage collection of heaps of 1, 3 and
6 million small dicts (each holding a list), and of the last after `gc.freeze()`, beside a
thread that wakes every 0.1 s, as a worker's heartbeat does: the collection holds the
interpreter, so the thread waits as long.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 40
VICTIM_STEP = 20
SSH_PORT = 2222
SSHD_CONFIG = """Port {port}
ListenAddress {address}
HostKey {keys}/host
AuthorizedKeysFile {keys}/authorized_keys
PidFile none
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
"""


def worker(
    notes: Path, victim: str | None, sharded: bool, stall: bool, pause: bool, steps: int
) -> None:
    import torch

    import dataparallel as dp

    me = os.environ["DATAPARALLEL_ELASTIC_WORKER"]
    log = open(notes / f"{me}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the run

    def note(kind: str, **more: object) -> None:
        log.write(json.dumps({"kind": kind, "t": time.time(), "who": me, **more}) + "\n")

    if pause:
        note_phases(note)
    dp.initialize()

    gaps = [0.0]
    done = threading.Event()

    def beat() -> None:  # as the heartbeat's thread: wake every 0.1 s, note the longest gap
        last = time.monotonic()
        while not done.wait(0.1):
            now = time.monotonic()
            gaps[0] = max(gaps[0], now - last - 0.1)
            last = now

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer: torch.optim.Optimizer
    if sharded:
        for layer in (model[0], model[2]):
            dp.torch.fully_shard(layer)
        dp.torch.fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = dp.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: note("reformed")])
    data = torch.randn(32, 64)

    @dp.elastic.run
    def train(state: dp.elastic.TorchState) -> None:
        note("entered")  # after `state.sync()`: the state carried over to this world
        while state.step < steps:
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            if victim is not None and me in victim.split(",") and state.step == VICTIM_STEP:
                if stall:  # the link goes down meanwhile; the worker leaves by itself
                    note("stalled")
                    while True:
                        time.sleep(1)
                if pause:  # a split is made meanwhile; then the worker goes on into it, once
                    if not (notes / "go").exists():
                        note("paused")
                    while not (notes / "go").exists():
                        time.sleep(0.01)
                else:
                    note("died")
                    os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            state.step += 1
            state.commit()
            note("commit")

    train(state)
    done.set()
    beater.join()
    note("gap", gap=gaps[0])


def note_phases(note: Callable[..., None]) -> None:
    """Note when this worker passes each phase of a re-form after a lost link: wrap the
    library's own steps (module attributes looked up at each call), so that nothing in the
    library itself times anything."""
    from dataparallel import world
    from dataparallel.backends import connections
    from dataparallel.elastic import rounds

    def noted(module: object, name: str, before: str | None, after: str | None = None) -> None:
        inner = getattr(module, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            if before is not None:
                note(before)
            result = inner(*args, **kwargs)
            if after is not None:
                note(after)
            return result

        setattr(module, name, wrapped)

    fail = connections._fail

    def cut(connection: socket.socket, peer: tuple[str, int]) -> None:
        """The watch found a connection lost: note what TCP_INFO says of it, then shut it."""
        info = connections._TCP_INFO.unpack_from(
            connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        )
        note("watch_cut", peer=peer[0], unacked=info[8 + 4], probes=info[3],
             ack_age=info[8 + 12] / 1000, sent_age=info[8 + 9] / 1000)  # fmt: skip
        fail(connection, peer)

    connections._fail = cut
    for entry in connections._links._watched.values():  # the runner's round 0 group's
        if entry.lost is fail:
            entry.lost = cut
    report = rounds.report_split

    def caught(error: BaseException) -> None:
        note("caught", error=type(error).__name__, message=str(error)[:120])
        report(error)

    rounds.report_split = caught  # `elastic.run` caught the error, rolls back
    noted(rounds, "_report_split", "reported")  # a split reported to the launcher
    noted(rounds, "leave", "left")  # the world left (its engines cut and released)
    noted(rounds, "_make_group", "round_read", "group_made")  # the next round's Gloo group
    noted(world, "initialize", None, "initialized")  # the library's world over it


class Hosts:
    """The two emulated hosts of `--hosts`: the link, an sshd in each, and how to reach them."""

    def __init__(self, folder: Path, count: int = 2) -> None:
        sys.path.insert(0, str(HERE))
        from network import DEVICE, Link

        self.device = DEVICE
        self.link = Link(count)
        self.daemons: list[subprocess.Popen[bytes]] = []
        keys = folder / "keys"
        keys.mkdir()
        for name in ("client", "host"):
            key = keys / name
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                           check=True, stdin=subprocess.DEVNULL)  # fmt: skip
        (keys / "authorized_keys").write_bytes((keys / "client.pub").read_bytes())
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for host, address in enumerate(self.link.addresses):
            config = folder / f"sshd{host}.conf"
            config.write_text(SSHD_CONFIG.format(port=SSH_PORT, address=address, keys=keys))
            command = self.link.command(host, [sshd, "-D", "-e", "-f", str(config)])
            daemon = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
            self.daemons.append(daemon)
        wrapper = folder / "ssh"  # an ssh that neither reads nor writes known_hosts
        wrapper.write_text(
            f"#!/bin/sh\nexec {shutil.which('ssh')} -o UserKnownHostsFile=/dev/null "
            '-o LogLevel=ERROR "$@"\n'
        )
        wrapper.chmod(0o755)
        self.options = ["-p", str(SSH_PORT), "-i", str(keys / "client")]
        self.env = {**self.link.environment(), "PATH": f"{folder}:{os.environ['PATH']}"}
        for address in self.link.addresses:  # sshd answers: a condition, with a guard
            probe = [*self.link.command(0, ["ssh", *self.options, "-o", "BatchMode=yes",
                     "-o", "StrictHostKeyChecking=no", address, "true"])]  # fmt: skip
            for _ in range(100):
                if subprocess.run(probe, env=self.env, capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                raise SystemExit(f"sshd in host {address} does not answer")

    def set_link(self, up: bool) -> None:
        """Take host b's end of the link down, or bring it up again."""
        space = self.link.spaces[1]
        state = "up" if up else "down"
        subprocess.run(["ip", "-n", space, "link", "set", self.device, state], check=True)

    def split(self, made: bool) -> None:
        """Make host c stop reaching host b (a prohibiting route in c), or undo it."""
        verb = "add" if made else "del"
        b = self.link.addresses[1]
        subprocess.run(["ip", "-n", self.link.spaces[2], "route", verb, "prohibit", f"{b}/32"],
                       check=True)  # fmt: skip

    def wait_gone(self, tag: str, seconds: float = 60.0, host: int = 1) -> None:
        """Wait until no process of host `host` has `tag` on its command line (a guard)."""
        space = os.stat(f"/run/netns/{self.link.spaces[host]}").st_ino
        deadline = time.monotonic() + seconds

        def left() -> bool:
            for entry in os.listdir("/proc"):
                with contextlib.suppress(OSError):
                    if (
                        entry.isdigit()
                        and os.stat(f"/proc/{entry}/ns/net").st_ino == space
                        and tag.encode() in Path(f"/proc/{entry}/cmdline").read_bytes()
                    ):
                        return True
            return False

        while left():
            if time.monotonic() > deadline:
                raise SystemExit(f"host b's workers did not leave within {seconds:g} s")
            time.sleep(0.05)

    def close(self) -> None:
        for daemon in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        self.link.close()


def one_run(
    workers: int,
    victim: str | None,
    hosts: Hosts | None = None,
    sharded: bool = False,
    link_timeout: float | None = None,
    stall: bool = False,
    split: bool = False,
    steps: int = STEPS,
) -> dict[str, float]:
    """One run of `steps` steps; with `stall`, the victims stand still and host b's link goes
    down; with `split`, the victim pauses and host c stops reaching host b."""
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        command = [sys.executable, "-m", "dataparallel", "run", "-n", str(workers)]
        env = None
        if hosts is not None:  # two hosts of workers // 2 each, launched in host a
            slots = workers // len(hosts.link.addresses)
            command += ["-H", ",".join(f"{a}:{slots}" for a in hosts.link.addresses)]
            command += hosts.options
            if link_timeout is not None:
                command += ["--link-timeout", f"{link_timeout:g}"]
            env = hosts.env
        limit = 300 + steps // 20  # a step takes 10-30 ms here
        command += ["--min-np", "2", "--backend", "gloo", "--timeout", str(limit), __file__]
        command += ["--worker", tmp, "--steps", str(steps)]
        command += ["--victim", victim] if victim else []
        command += ["--fully-shard"] if sharded else []
        command += ["--stall"] if stall else []
        command += ["--pause"] if split else []
        if hosts is not None:
            command = hosts.link.command(0, command)
        start = time.time()
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)  # fmt: skip
        reader = threading.Thread(target=read_stderr, args=(run, Path(tmp) / "launcher.jsonl"))
        reader.start()
        if hosts is not None and stall:
            cut_when(run, Path(tmp), "stalled", lambda: hosts.set_link(False))
        if hosts is not None and split:
            cut_when(run, Path(tmp), "paused", lambda: hosts.split(True))
            (Path(tmp) / "go").touch()
        try:
            run.wait(timeout=limit + 30)
            reader.join()
        finally:
            if hosts is not None and stall:
                hosts.wait_gone(tmp)  # b's workers leave by themselves; then the link is back
                hosts.set_link(True)
            if hosts is not None and split:
                hosts.wait_gone(tmp, host=2)  # the launcher stops c's worker
                hosts.split(False)
        wall = time.time() - start
        stderr = "".join(json.loads(line)["line"] for line in (Path(tmp) / "launcher.jsonl").open())
        if run.returncode != 0:  # the launcher's own lines say who was lost and why; then the tail
            said = [ln for ln in stderr.splitlines() if ln.startswith("dataparallel")]
            raise SystemExit(
                f"the run failed ({run.returncode}); the launcher said:\n"
                + "\n".join(said)
                + f"\nthe end of its output:\n{stderr[-3000:]}"
            )
        notes = [json.loads(line) for path in Path(tmp).glob("*.jsonl") for line in path.open()]
    commits = sorted(n["t"] for n in notes if n["kind"] == "commit")
    figures = {"wall": wall, "lost": float(stderr.count("was lost"))}
    figures["steps"] = float(sum(n["kind"] == "commit" and n["who"] == "w0" for n in notes))
    figures["gap"] = max((n["gap"] for n in notes if n["kind"] == "gap"), default=0.0)
    deaths = [n["t"] for n in notes if n["kind"] == "died"]
    if deaths:
        died = min(deaths)
        figures["reformed"] = min(n["t"] for n in notes if n["kind"] == "reformed") - died
        entered = [n["t"] for n in notes if n["kind"] == "entered" and n["t"] > died]
        figures["synced"] = min(entered) - died
        figures["next_commit"] = min(t for t in commits if t > died) - died
        for kind in PHASES:
            after = [n["t"] for n in notes if n["kind"] == kind and n["t"] > died]
            if after:
                figures[kind] = min(after) - died
        for n in sorted(notes, key=lambda n: n["t"]):  # who saw the loss first, and how
            if n["kind"] in ("watch_cut", "caught") and n["t"] > died:
                more = {k: v for k, v in n.items() if k not in ("kind", "t", "who")}
                print(f"  {n['t'] - died:.3f} s {n['who']} {n['kind']} {more}", flush=True)
        lost = [n["t"] for n in notes if n["kind"] == "launcher" and "was lost" in n["line"]]
        if lost:
            figures["launcher_lost"] = min(lost) - died
    else:
        w0 = sorted(n["t"] for n in notes if n["kind"] == "commit" and n["who"] == "w0")
        figures["step"] = statistics.median(b - a for a, b in itertools.pairwise(w0))
    return figures


# The phases of a re-form after a lost link, in order (`note_phases`; the launcher's line
# saying the worker was lost: `launcher_lost`), each the first time any worker passed it.
PHASES = ["watch_cut", "caught", "reported", "left", "launcher_lost", "round_read", "group_made",
          "initialized", "reformed", "entered"]  # fmt: skip


def read_stderr(run: subprocess.Popen[str], log: Path) -> None:
    """Note each line the launcher writes to stderr with the moment it came."""
    assert run.stderr is not None
    with open(log, "w") as out:
        for line in run.stderr:
            out.write(json.dumps({"kind": "launcher", "t": time.time(), "line": line}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--hosts", action="store_true", help="across two emulated hosts")
    parser.add_argument(
        "--link-timeouts", default="1,5", help="--hosts: the link runs' --link-timeout values"
    )
    parser.add_argument("--busy", type=int, default=0, help="--hosts: spinning processes a host")
    parser.add_argument("--split", action="store_true", help="--hosts: three hosts, a split")
    parser.add_argument("--soak", type=int, default=0, help="--split: clean runs of N steps")
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--gc-pauses", action="store_true", help="a collection's pause, alone")
    parser.add_argument("--fully-shard", action="store_true", help="also a fully_shard model")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--victim", help=argparse.SUPPRESS)
    parser.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pause", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.victim, args.fully_shard, args.stall, args.pause, args.steps)
        return
    if args.gc_pauses:
        gc_pauses()
        return
    if args.split:
        timeouts = [float(t) for t in args.link_timeouts.split(",")]
        if args.soak:
            soak_runs(args.pairs, timeouts, args.soak, args.busy)
        else:
            split_runs(args.pairs, timeouts)
        return
    hosts = None
    victim, what = "w1", "worker 1"
    timeouts = [float(t) for t in args.link_timeouts.split(",")] if args.hosts else []
    least = min(timeouts, default=None)
    folder = tempfile.TemporaryDirectory(prefix="elastic-hosts-")
    if args.hosts:
        reason = why_no_hosts()
        if reason is not None:
            print(f"skipped: {reason}")
            return
        args.workers += args.workers % 2
        victim = ",".join(f"w{n}" for n in range(args.workers // 2, args.workers))
        what = f"host b's {args.workers // 2} workers ({victim})"
        hosts = Hosts(Path(folder.name))
    failed, clean, sharded_failed, sharded_clean = [], [], [], []
    cut: dict[float, list[dict[str, float]]] = {t: [] for t in timeouts}
    spinning: list[subprocess.Popen[bytes]] = []
    try:
        if hosts is not None:
            spin = [sys.executable, "-c", "while True: pass"]
            for host in (0, 1):
                for _ in range(args.busy):
                    spinning.append(subprocess.Popen(hosts.link.command(host, spin)))
        for _ in range(args.pairs):
            failed.append(one_run(args.workers, victim, hosts))
            for t in timeouts:
                cut[t].append(one_run(args.workers, victim, hosts, link_timeout=t, stall=True))
            clean.append(one_run(args.workers, None, hosts, link_timeout=least))
            if args.fully_shard:
                sharded_failed.append(one_run(args.workers, victim, hosts, sharded=True))
                sharded_clean.append(one_run(args.workers, None, hosts, sharded=True))
    finally:
        for process in spinning:
            process.kill()
            process.wait()
        if hosts is not None:
            hosts.close()
        folder.cleanup()
    report(args.workers, hosts is not None, f"{what} SIGKILLed", failed, clean, "")
    for t, runs in cut.items():
        how = f"host b's link down (--link-timeout {t:g}) with {what} waiting"
        report(args.workers, True, how, runs, clean, "")
    if args.fully_shard:
        report(
            args.workers,
            hosts is not None,
            f"{what} SIGKILLed",
            sharded_failed,
            sharded_clean,
            "fully_shard + Adam, ",
        )
        ratio = statistics.median(f["next_commit"] for f in sharded_failed) / statistics.median(
            f["next_commit"] for f in failed
        )
        print(f"death -> next commit, fully_shard / unsharded (medians): {ratio:.2f}")


def cut_when(run: subprocess.Popen[str], folder: Path, kind: str, cut: Callable[[], None]) -> None:
    """Once a worker's log in `folder` holds an event of `kind` (or the run has ended), `cut`
    the link and log the moment as the driver's "died" event: the loss the run recovers from."""
    seen = False
    while not seen and run.poll() is None:
        time.sleep(0.01)
        seen = any(f'"{kind}"' in path.read_text() for path in folder.glob("*.jsonl"))
    cut()
    with open(folder / "driver.jsonl", "w") as log:
        log.write(json.dumps({"kind": "died", "t": time.time(), "who": "driver"}) + "\n")


def why_no_hosts() -> str | None:
    """Why emulated hosts cannot be had here (network namespaces, sshd), or None."""
    sys.path.insert(0, str(HERE))
    from network import why_not

    reason = why_not()
    if reason is None and not os.path.exists(shutil.which("sshd") or "/usr/sbin/sshd"):
        reason = "sshd is not installed: apt-get install -y openssh-server"
    return reason


def split_runs(pairs: int, link_timeouts: list[float]) -> None:
    """`--hosts --split`: three hosts, one worker each; for each link timeout in turn, a split
    between b and c, and (at the least of them) a run without one."""
    reason = why_no_hosts()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    failed: dict[float, list[dict[str, float]]] = {t: [] for t in link_timeouts}
    clean = []
    with tempfile.TemporaryDirectory(prefix="elastic-hosts-") as folder:
        hosts = Hosts(Path(folder), count=3)
        try:
            for _ in range(pairs):
                for t in link_timeouts:
                    failed[t].append(one_run(3, "w2", hosts, link_timeout=t, split=True))
                clean.append(one_run(3, None, hosts, link_timeout=min(link_timeouts)))
        finally:
            hosts.close()
    for t, runs in failed.items():
        what = f"a split between hosts b and c (--link-timeout {t:g}), worker 2 on c"
        report(3, True, what, runs, clean, "", "3 emulated hosts")
        phases(runs)


def gc_pauses() -> None:
    """`--gc-pauses`: how long a full collection keeps a 0.1 s thread from its turn."""
    import gc

    def beat(gaps: list[float], stop: threading.Event) -> None:
        last = time.monotonic()
        while not stop.wait(0.1):
            now = time.monotonic()
            gaps[0] = max(gaps[0], now - last - 0.1)
            last = now

    print("| heap | gc.collect() | the 0.1 s thread's longest extra wait |")
    print("| --- | --- | --- |")
    for n, frozen in ((1, False), (3, False), (6, False), (6, True)):
        heap = [{"a": [i]} for i in range(n * 10**6)]
        if frozen:  # kept out of every later collection
            gc.freeze()
        gaps, stop = [0.0], threading.Event()
        thread = threading.Thread(target=beat, args=(gaps, stop))
        thread.start()
        time.sleep(0.3)
        begun = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - begun
        time.sleep(0.3)
        stop.set()
        thread.join()
        what = f"{n} M dicts + lists" + (", after `gc.freeze()`" if frozen else "")
        print(f"| {what} | {took:.3f} s | {gaps[0]:.3f} s |", flush=True)
        gc.unfreeze()
        del heap


def soak_runs(pairs: int, link_timeouts: list[float], steps: int, busy: int) -> None:
    """`--hosts --split --soak STEPS`: runs of the three hosts without a failure, each link
    timeout in turn, `busy` processes spinning beside them the whole time."""
    reason = why_no_hosts()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    spin = [sys.executable, "-c", "while True: pass"]
    spinning = [subprocess.Popen(spin) for _ in range(busy)]
    print(f"3 workers, 3 emulated hosts, no failure, {steps} steps a run, {busy} spinning beside")
    print("| run (UTC) | --link-timeout | steps | wall | step | false losses | longest wait |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    try:
        with tempfile.TemporaryDirectory(prefix="elastic-hosts-") as folder:
            hosts = Hosts(Path(folder), count=3)
            try:
                for _ in range(pairs):
                    for t in link_timeouts:
                        begun = time.strftime("%H:%M:%S", time.gmtime())
                        f = one_run(3, None, hosts, link_timeout=t, steps=steps)
                        print(
                            f"| {begun} | {t:g} | {f['steps']:.0f} | {f['wall']:.1f} s | "
                            f"{f['step'] * 1e3:.1f} ms | {f['lost']:.0f} | {f['gap']:.3f} s |",
                            flush=True,
                        )
            finally:
                hosts.close()
    finally:
        ticks = os.sysconf("SC_CLK_TCK")
        used = []
        for process in spinning:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                used.append((int(stat[11]) + int(stat[12])) / ticks)  # utime + stime
            process.kill()
            process.wait()
        if spinning:
            print("CPU seconds of the spinning processes: " + ", ".join(f"{u:.0f}" for u in used))


def phases(runs: list[dict[str, float]]) -> None:
    """Print when each phase of the re-form was first passed, seconds after the cut."""
    print("| run | " + " | ".join(PHASES) + " | next_commit |")
    print("| --- " * (len(PHASES) + 2) + "|")
    for i, f in enumerate(runs):
        cells = [f"{f[k]:.2f}" if k in f else "-" for k in [*PHASES, "next_commit"]]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")


def report(
    workers: int,
    hosts: bool,
    what: str,
    failed: list[dict[str, float]],
    clean: list[dict[str, float]],
    model: str,
    machines: str = "2 emulated hosts",
) -> None:
    step = statistics.median(f["step"] for f in clean)
    where = "" if not hosts else f", {machines}"
    print(f"\n{model}{workers} workers{where}, {what} at step {VICTIM_STEP} of {STEPS}:")
    print("| run | death -> re-formed | death -> state synced | death -> next commit | wall |")
    print("| --- | --- | --- | --- | --- |")
    for i, f in enumerate(failed):
        print(
            f"| failure {i + 1} | {f['reformed']:.2f} s | {f['synced']:.2f} s | "
            f"{f['next_commit']:.2f} s | {f['wall']:.1f} s |"
        )
    for i, f in enumerate(clean):
        print(f"| no failure {i + 1} | - | - | - | {f['wall']:.1f} s |")
    runs = failed + clean
    print(
        f"longest wait of a 0.1 s thread beside the training: {max(f['gap'] for f in runs):.3f} s;"
        f" runs without a failure that lost a worker anyway: {sum(f['lost'] for f in clean):g}"
        f" of {len(clean)}"
    )
    recovery = statistics.median(f["next_commit"] for f in failed)
    print(f"step without a failure (median, commit to commit): {step * 1e3:.1f} ms")
    print(f"death -> next commit (median): {recovery:.2f} s = {recovery / step:.0f} steps")
    print(
        f"wall, failure / no failure: {statistics.median(f['wall'] for f in failed):.1f} s / "
        f"{statistics.median(f['wall'] for f in clean):.1f} s"
    )


if __name__ == "__main__":
    main()
