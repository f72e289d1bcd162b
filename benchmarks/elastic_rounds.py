"""How forming an elastic round grows with the number of workers: the launcher's store under load.

Run: `python benchmarks/elastic_rounds.py [--workers 8,32,64,128,256] [--repeats 3]`

An elastic round forms in two parts, both in the one TCP store that `dataparallel run` holds
(`dataparallel.elastic.rounds`): the membership protocol (every worker waits for the round, reads
it, arrives; the last marks it formed), then torch's Gloo rendezvous under the round's prefix
(every member writes its address and reads every other's: N writes and N(N-1) reads), through
`forming.watching`, the wrapper whose waits poll the store and watch for a newer round.

Here N light workers (threads of one process, each with its own store client, as each worker
process has one) speak both parts against a store made as the launcher makes it; the launcher
publishes the round as `open_round` does. Per N, the median over `--repeats` rounds of: the time
from publication to the last worker seeing the round formed (membership), and to the last worker
holding every address (rendezvous), through the watched store and, in turn with it, through the
bare store (the reference: what torch's own rendezvous costs); their ratio, and the growth
against the smallest N (N^2 reads predict 4x per doubling for the rendezvous, N arrivals 2x for
the membership). Process start and torch's
import (seconds a worker, the same at any N) are left out: this is the store's share alone.

`--followers` asks instead what a run's idle traffic costs the same rounds: every simulated worker
also follows the rounds and beats as a worker on another host than the launcher does, in turn
(per N, per repeat): none (the reference); *polled*, the follower as it was (a thread that every
0.1 s beats and asks whether the next round opened); *notified*, the library's own
(`elastic.liveness`: the follower blocked on its notice queue, which the round's publication
fills, `rounds.publish`, and a beat every 0.1 s on a thread of its own). Each round is published
as after a host lost by its link (one worker listed as cut off), so that the notices, one push
a member, count in the membership. Printed per N and case:
the membership and the rendezvous (watched store) as above, and how long one look of the
launcher's at every worker's heartbeat takes (`liveness.Heartbeats.silent`, which its loop makes
every 0.1 s), median of 5 looks while the followers run.

`--looks` asks what the launcher's look at the heartbeats costs the same rounds, the way it reads
them in turn (per N, per repeat): *each*, one round trip a worker (a check where not heard yet, a
get: the look as it was, written here), and *one*, the library's (`Heartbeats.silent`: one
`multi_get` for every worker heard). Every worker's follower and beat run as in *notified*; the
launcher's ear is a process of its own (as the launcher is; in this one it would share the
interpreter's lock with a thousand threads), looking every 0.1 s from before the round to its
end; the two in turn, the first of each pair swapped every repeat (each round's keys stay in
the store, which the later rounds find fuller). Printed per N and case: the membership and the
rendezvous, and the median look idle (the followers beating, before the round) and during the
round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not one warning per client socket

import torch.distributed as dist

from dataparallel.elastic import liveness
from dataparallel.elastic.forming import round_key, watching
from dataparallel.elastic.rounds import (
    FORMED,
    LATEST,
    arrived_key,
    publish,
    ready_key,
    supersede,
)

TIMEOUT = datetime.timedelta(seconds=120)


def worker(
    port: int,
    me: str,
    generation: int,
    go: threading.Barrier,
    formed: dict[str, float],
    meshed: dict[str, float],
    plain: bool,
) -> None:
    """One worker's share of a round: `rounds.join`'s membership steps, then Gloo's rendezvous
    pattern (write my address, read everyone's) through the watched store (`plain`: through the
    store itself, as torch's `init_process_group` over a bare store would)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    go.wait()
    store.wait([round_key(generation)], TIMEOUT)
    latest = max(int(store.get(LATEST)), generation)
    members = tuple(json.loads(store.get(round_key(latest))))
    if store.add(arrived_key(latest), 1) == len(members):
        store.compare_set(ready_key(latest), "", FORMED)
    store.wait([ready_key(latest)], TIMEOUT)
    assert store.get(ready_key(latest)) == FORMED.encode()
    formed[me] = time.perf_counter()
    watched = store if plain else watching(store, latest, members)
    prefix = f"{round_key(latest)}/{'plain' if plain else 'group'}/"
    rank = members.index(me)
    watched.set(f"{prefix}{rank}", f"address of {me}")
    # Gloo's full mesh (`connectFullMesh`): for every other rank in turn, wait for its key, get it.
    others = [f"{prefix}{r}" for r in range(len(members)) if r != rank]
    addresses = []
    for key in others:
        watched.wait([key], TIMEOUT)  # the watched store's get waits too: one more check
        addresses.append(watched.get(key))
    assert len(addresses) == len(members) - 1
    meshed[me] = time.perf_counter()


def polled(port: int, me: str, generation: int, stop: threading.Event) -> None:
    """The round follower as it was: every 0.1 s, a beat and a look for the next round; when
    one opened, the look and the read of the workers it lost by their link."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    while not stop.wait(0.1):
        store.add(liveness.heartbeat_key(me), 1)
        if store.check([round_key(generation + 1)]):
            generation += 1
            store.check([round_key(generation)])  # as the look and the read of the lost workers'
            store.get(round_key(generation))  # list under a key of the round's


class Followers:
    """`n` followers (`case` "polled" or "notified") of the workers `members`, running until
    `stop`."""

    def __init__(
        self,
        port: int,
        members: list[str],
        generation: int,
        case: str,
        master: dist.TCPStore | None = None,
    ) -> None:
        """With `master`, the followers start 16 at a time, each 16 once beating: hundreds of
        clients connecting at once overflow the store's backlog, and some wait seconds (or
        give up) before they beat."""
        self.case, self.members, self.port = case, members, port
        self.stop = threading.Event()
        at = ("127.0.0.1", port)
        liveness._stop = self.stop  # the library's threads end on it
        targets: list[tuple[object, tuple[object, ...]]] = []
        for me in members:
            if case == "polled":
                targets.append((polled, (port, me, generation, self.stop)))
            else:
                targets.append((liveness._follow, (at, generation, lambda: (-1, ()), me)))
                targets.append((liveness._beat, (at, liveness.heartbeat_key(me))))
        self.threads = [threading.Thread(target=t, args=a, daemon=True) for t, a in targets]
        step = 32 if master is not None and case == "notified" else len(self.threads)
        for first in range(0, len(self.threads), step):
            for thread in self.threads[first : first + step]:
                thread.start()
            if master is not None and case == "notified":
                beats = [liveness.heartbeat_key(m) for m in members[first // 2 : first // 2 + 16]]
                guard = time.monotonic() + 60
                while not master.check(beats):
                    if time.monotonic() > guard:
                        raise RuntimeError(f"followers not beating after 60 s: {beats}")
                    time.sleep(0.01)

    def close(self, master: dist.TCPStore) -> None:
        self.stop.set()
        if self.case == "notified":  # each follower's own empty notice wakes it, as at exit
            for me in self.members:
                master.queue_push(liveness.notice_key(me), b"")
        for thread in self.threads:
            thread.join()


def one_round(
    master: dist.TCPStore,
    generation: int,
    n: int,
    plain: bool = False,
    members: list[str] | None = None,
    notify: bool = False,
) -> tuple[float, float]:
    """Publish round `generation` of `n` workers (`members`: named so; `notify`: with a notice
    to each, as where workers follow the rounds) and return (membership, rendezvous) seconds."""
    members = members or [f"w{generation}-{i}" for i in range(n)]
    formed: dict[str, float] = {}
    meshed: dict[str, float] = {}
    go = threading.Barrier(n + 1)
    threads = [
        threading.Thread(
            target=worker,
            args=(master.port, m, generation, go, formed, meshed, plain),
            daemon=True,
        )
        for m in members
    ]
    for t in threads:
        t.start()
    go.wait()  # every client connected and waiting: only the round's own work is timed
    start = time.perf_counter()
    supersede(master, generation - 1)
    publish(master, generation, members, ["lost"], notify)  # as after a host lost by its link
    for t in threads:
        t.join()
    if len(formed) != n or len(meshed) != n:
        raise RuntimeError(f"round {generation}: {len(formed)}/{len(meshed)} of {n} finished")
    return max(formed.values()) - start, max(meshed.values()) - start


def with_followers(master: dist.TCPStore, sizes: list[int], repeats: int) -> None:
    """`--followers`: rounds with idle followers beside them, by case in turn."""
    cases = ["none", "polled", "notified"]
    runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    generation = 1
    for _ in range(repeats):
        for n in sizes:
            for case in cases:
                members = [f"f{generation}-{i}" for i in range(n)]
                followers = None
                if case != "none":
                    followers = Followers(master.port, members, generation - 1, case)
                    time.sleep(0.3)  # every follower connected and beating
                ear, looks = liveness.Heartbeats(3600.0), []
                for _ in range(5):
                    begun = time.perf_counter()
                    ear.silent(master, members)
                    looks.append(time.perf_counter() - begun)
                notify = case == "notified"
                formed, meshed = one_round(master, generation, n, members=members, notify=notify)
                if followers is not None:
                    followers.close(master)
                runs.setdefault((n, case), []).append((formed, meshed, statistics.median(looks)))
                generation += 1
    print(f"rounds of N simulated workers (threads) with idle followers, median of {repeats} each")
    print("| workers | followers | membership | rendezvous | a look at every heartbeat |")
    print("| --- | --- | --- | --- | --- |")
    for n in sizes:
        for case in cases:
            r = runs[(n, case)]
            cells = [statistics.median(x[k] for x in r) * 1e3 for k in range(3)]
            print(f"| {n} | {case} | {cells[0]:.1f} ms | {cells[1]:.1f} ms | {cells[2]:.2f} ms |")


class EachHeartbeats(liveness.Heartbeats):
    """The launcher's look as it was: a round trip a worker (and a check before a worker is
    heard)."""

    def silent(self, store: dist.Store, workers: list[str]) -> dict[str, float]:  # type: ignore[override]
        now = time.monotonic()
        quiet: dict[str, float] = {}
        for worker in workers:
            key = liveness.heartbeat_key(worker)
            heard = self._heard.get(worker)
            if worker in self._done or (heard is None and not store.check([key])):
                continue
            self.note(worker, bytes(store.get(key)), now, quiet)
        return quiet


def ear(port: int) -> None:
    """`--ear PORT`: the launcher's look at the heartbeats, in a process of its own, every 0.1 s
    at the workers of the last `watch` line on stdin (JSON: case and workers); `report` prints
    the looks' seconds since the last report (JSON) and starts anew; end of input ends it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    looking: liveness.Heartbeats | None = None
    workers: list[str] = []
    looks: list[float] = []
    pending = b""  # what stdin said, not yet a whole line
    print("ready", flush=True)
    due = time.monotonic()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, due - time.monotonic()))
        if ready:
            said = os.read(sys.stdin.fileno(), 65536)
            if not said:
                return
            *lines, pending = (pending + said).split(b"\n")
            for line in lines:
                if line.startswith(b"watch "):
                    told = json.loads(line[len(b"watch ") :])
                    kind = EachHeartbeats if told["case"] == "each" else liveness.Heartbeats
                    looking, workers = kind(3600.0), told["workers"]
                elif line == b"report":
                    print(json.dumps(looks), flush=True)
                    looks = []
            continue
        due = max(due + 0.1, time.monotonic() - 0.1)
        if looking is not None:
            begun = time.perf_counter()
            looking.silent(store, workers)
            looks.append(time.perf_counter() - begun)


def with_looks(master: dist.TCPStore, sizes: list[int], repeats: int) -> None:
    """`--looks`: rounds with the launcher's ear looking beside them, by case in turn."""
    cases = ["each", "one"]
    runs: dict[tuple[int, str], list[tuple[float, float, float, float | None]]] = {}
    looker = subprocess.Popen(
        [sys.executable, __file__, "--ear", str(master.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert looker.stdin is not None and looker.stdout is not None
    assert looker.stdout.readline() == "ready\n"

    def tell(line: str) -> None:
        assert looker.stdin is not None
        looker.stdin.write(line + "\n")
        looker.stdin.flush()

    def report() -> list[float]:
        tell("report")
        assert looker.stdout is not None
        return list(json.loads(looker.stdout.readline()))

    generation = 1
    for repeat in range(repeats):
        for n in sizes:
            for case in cases if repeat % 2 == 0 else cases[::-1]:  # ABBA: the store grows
                members = [f"l{generation}-{i}" for i in range(n)]
                followers = Followers(master.port, members, generation - 1, "notified", master)
                time.sleep(0.2)
                tell("watch " + json.dumps({"case": case, "workers": members}))
                report()  # the looks before
                time.sleep(0.65)
                idle = report()[1:]  # the first look checks every worker, once
                formed, meshed = one_round(master, generation, n, members=members, notify=True)
                busy = report()
                tell("watch " + json.dumps({"case": case, "workers": []}))
                followers.close(master)
                runs.setdefault((n, case), []).append(
                    (
                        formed,
                        meshed,
                        statistics.median(idle),
                        statistics.median(busy) if busy else None,
                    )
                )
                generation += 1
    looker.stdin.close()
    looker.wait()
    print(
        "rounds of N simulated workers (threads) with the launcher's ear looking, "
        f"median of {repeats} each"
    )
    print(
        "| workers | the launcher's look | membership | rendezvous | a look, idle "
        "| a look, in the round |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in sizes:
        for case in cases:
            r = runs[(n, case)]
            cells = [f"{statistics.median(x[k] for x in r) * 1e3:.1f} ms" for k in range(2)]
            cells.append(f"{statistics.median(x[2] for x in r) * 1e3:.2f} ms")
            busy = [x[3] for x in r if x[3] is not None]  # none where the round was quicker
            cells.append(f"{statistics.median(busy) * 1e3:.2f} ms" if busy else "-")
            print(f"| {n} | {case} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="8,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--followers", action="store_true", help="idle followers beside")
    parser.add_argument("--looks", action="store_true", help="the launcher's looks beside")
    parser.add_argument("--ear", type=int, help=argparse.SUPPRESS)  # --looks' own process
    args = parser.parse_args()
    if args.ear is not None:
        ear(args.ear)
        return
    sizes = [int(n) for n in args.workers.split(",")]
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    one_round(master, 0, sizes[0])  # warm-up: the store's and the clients' first connections
    if args.followers:
        with_followers(master, sizes, args.repeats)
        return
    if args.looks:
        with_looks(master, sizes, args.repeats)
        return
    generation = 1
    watched: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    plain: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(args.repeats):  # the two cases in turn, every size in every repeat
        for n in sizes:
            for case, runs in ((False, watched), (True, plain)):
                runs[n].append(one_round(master, generation, n, plain=case))
                generation += 1

    def median(runs: list[tuple[float, float]], part: int) -> float:
        return statistics.median(r[part] for r in runs)

    base = sizes[0]
    print(f"rounds of N simulated workers (threads), median of {args.repeats} each")
    print(
        "| workers | membership | rendezvous, watched | rendezvous, bare store | watched / bare "
        f"| membership / N={base} | rendezvous / N={base} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in sizes:
        formed, meshed, bare = median(watched[n], 0), median(watched[n], 1), median(plain[n], 1)
        print(
            f"| {n} | {formed * 1e3:.1f} ms | {meshed * 1e3:.1f} ms | {bare * 1e3:.1f} ms | "
            f"{meshed / bare:.2f} | {formed / median(watched[base], 0):.1f}x | "
            f"{meshed / median(watched[base], 1):.1f}x |"
        )


if __name__ == "__main__":
    main()
