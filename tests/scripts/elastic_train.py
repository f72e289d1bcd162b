"""An elastic training run whose every update can be replayed: the tests' subject.

Linear regression in float64 on a dataset made from each sample's index. Each step, every rank
sums its samples' gradients in order, the ranks' sums are gathered and added in rank order, so
the update is a function of which samples each rank had: `replay` recomputes the final weights
from the history kept in the state, bit for bit. The state commits every `--commit` steps.

Options:
    --out FILE          rank 0 writes the final state (JSON) there
    --die W:K           worker W (its id, `w0`...) kills itself with SIGKILL after its K-th
                        commit, in the middle of the next step (after computing its gradient)
    --skip W:K          worker W skips its K-th commit (a commit called by only some ranks)
    --stall W:K:FILE    worker W, after its K-th commit, creates FILE in the middle of the next
                        step and waits there for ever: its peers wait on it in the step's
                        collective (the test then takes its host's link down)
    --pause W:K:FILE    worker W, after its K-th commit, creates FILE.paused in the middle of the
                        next step and waits there until FILE exists: its peers wait on it in
                        the step's collective (the test cuts links meanwhile), then it joins them
    --stall-forming W:G:FILE  worker W, about to arrive in round G (opened, not yet formed),
                        creates FILE and waits there for ever, its watch still beating: the
                        others wait for it to arrive (the test then takes its host's link down)
    --die-forming W:G   worker W kills itself with SIGKILL once round G has formed, as it begins
                        making the round's Gloo group (before the others can reach it)
    --slots FILE:K:LINE after its K-th commit, rank 0 writes LINE to FILE (what the discovery
                        script prints), then waits until the launcher has opened a new round;
                        K = 0: the newest worker of round 0 does so before its
                        `dp.initialize()`, while round 0's world forms, and enters it once the
                        others, who waited there for it, have given it up and formed round 1.
                        Given several times, each is done in turn
    --leave W:K         as --die, but worker W leaves with `sys.exit(0)` (a clean exit mid-run)
    --die-initializing W  worker W kills itself with SIGKILL as it starts, before
                        `dp.initialize()` (the others meet its absence as round 0 forms); may
                        be given for several workers
    --die-after-finish W  worker W kills itself with SIGKILL after training, once rank 0 has
                        written --out and ended (a worker lost as the run finishes)
    --fail-discovery FILE:K  after its K-th commit, rank 0 creates FILE (the discovery script
                        fails once while it exists, and removes it), then waits until it is gone
    --set-epoch-at-start  call `sampler.set_epoch(epoch)` at the start of every epoch (torch's
                        DistributedSampler habit) instead of `set_epoch(epoch + 1)` at its end
    --new-group W:S:FILE  every worker makes a group of the whole world (`dp.new_group`) before
                        the step that begins after S steps; worker W, the first time, creates
                        FILE.paused as that group begins to form (after `new_group` agreed on
                        its ranks) and waits there until FILE exists: the others wait for its
                        address in the group's rendezvous (the test cuts links meanwhile)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import dataparallel as dp

DIM = 4
LR = 0.05


def sample(i: int) -> tuple[np.ndarray, float]:
    x = np.random.default_rng(i).standard_normal(DIM)
    return x, float(x @ np.arange(1.0, DIM + 1.0)) + 0.1 * ((i % 7) - 3)


def gradient(w: np.ndarray, indices: list[int]) -> np.ndarray:
    g = np.zeros(DIM)
    for i in indices:
        x, y = sample(i)
        g = g + x * (x @ w - y)
    return g


def update(w: np.ndarray, parts: list[tuple[list[int], np.ndarray]]) -> np.ndarray:
    total = np.zeros(DIM)
    for _, g in parts:  # rank order
        total = total + g
    count = sum(len(indices) for indices, _ in parts)
    return w - LR * total / count


def replay(history: list[list[object]]) -> np.ndarray:
    """The weights after the committed steps of `history`, recomputed in one process."""
    w = np.zeros(DIM)
    for _, _, shares in history:
        w = update(w, [(list(s), gradient(w, list(s))) for s in shares])  # type: ignore[arg-type]
    return w


def die_forming(generation: int) -> None:
    """SIGKILL this worker when it begins making round `generation`'s Gloo group."""
    from dataparallel.elastic import rounds

    make = rounds._make_group

    def dying(store: object, chosen: rounds.Round, settings: object) -> None:
        if chosen.generation == generation:
            os.kill(os.getpid(), signal.SIGKILL)
        make(store, chosen, settings)  # type: ignore[arg-type]

    rounds._make_group = dying  # type: ignore[assignment]


def stall_forming(generation: int, path: str) -> None:
    """Stop this worker for ever (after creating `path`) once round `generation` has opened,
    before it arrives there: `rounds.join` waits for the round's key, then arrives."""
    from dataparallel.elastic import rounds

    exists = rounds._exists

    def stalling(store: object, key: str, wait: object) -> bool:
        found = exists(store, key, wait)  # type: ignore[arg-type]
        if found and key == rounds.round_key(generation):
            open(path, "w").close()
            wait_until(lambda: False)
        return found

    rounds._exists = stalling  # type: ignore[assignment]


def stall_grouping(generation: int, path: str) -> None:
    """Stop this worker for ever (after creating `path`) once round `generation` has formed, as
    it begins making the round's Gloo group: the others wait for its address there."""
    from dataparallel.elastic import rounds

    make = rounds._make_group

    def stalling(store: object, chosen: rounds.Round, settings: object) -> None:
        if chosen.generation == generation:
            open(path, "w").close()
            wait_until(lambda: False)
        make(store, chosen, settings)  # type: ignore[arg-type]

    rounds._make_group = stalling  # type: ignore[assignment]


def pause_grouping(path: str) -> None:
    """The first time this worker's engine makes a group (`GlooBackend.split`), create
    `path`.paused and wait there until `path` exists."""
    from dataparallel.backends.gloo.backend import GlooBackend

    split = GlooBackend.split

    def pausing(self: GlooBackend, ranks: object) -> object:
        if not os.path.exists(path + ".paused"):
            open(path + ".paused", "w").close()
            wait_until(lambda: os.path.exists(path))
        return split(self, ranks)  # type: ignore[arg-type]

    GlooBackend.split = pausing  # type: ignore[assignment, method-assign]


def wait_for_round(generation: int, formed: bool = False) -> None:
    """Wait until the launcher has opened round `generation` (`formed`: until it formed)."""
    from dataparallel.config import Settings
    from dataparallel.elastic import rounds

    store = rounds.connect(Settings.from_env())
    store.wait([rounds.round_key(generation)])
    if formed:
        store.wait([rounds.ready_key(generation)])


def wait_until(done: object) -> None:
    """Poll `done()` (a condition another process brings about) until it holds."""
    while not done():  # type: ignore[operator]
        time.sleep(0.01)


def ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=23)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--commit", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--die", action="append", default=[])
    parser.add_argument("--skip")
    parser.add_argument("--stall", default="::")
    parser.add_argument("--pause", default="::")
    parser.add_argument("--die-forming", default="")
    parser.add_argument("--stall-forming", default="::")
    parser.add_argument("--slots", action="append", default=[])
    parser.add_argument("--leave", default="")
    parser.add_argument("--die-initializing", action="append", default=[])
    parser.add_argument("--die-after-finish", default="")
    parser.add_argument("--fail-discovery")
    parser.add_argument("--set-epoch-at-start", action="store_true")
    parser.add_argument("--new-group", default="::")
    args = parser.parse_args()
    me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER", "")
    dies_after = {w: int(k) for w, _, k in (d.partition(":") for d in args.die)}.get(me)
    leaver, _, leaves_after = args.leave.partition(":")
    staller, stalls_after, stall_file = args.stall.split(":", 2)
    pauser, pauses_after, pause_file = args.pause.split(":", 2)
    paused = False
    skip_worker, _, skip_at = (args.skip or "").partition(":")
    tries = 0
    forming_worker, _, forming_round = args.die_forming.partition(":")
    if me == forming_worker:
        die_forming(int(forming_round))
    stall_worker, stall_round, stall_path = args.stall_forming.split(":", 2)
    if me == stall_worker:
        stall_forming(int(stall_round), stall_path)
    grouper, group_at, group_file = args.new_group.split(":", 2)
    if me == grouper:
        pause_grouping(group_file)
    if me in args.die_initializing:
        os.kill(os.getpid(), signal.SIGKILL)
    slots = [(path, int(k), line) for path, k, line in (s.split(":", 2) for s in args.slots)]
    later_slots = [(path, k, line) for path, k, line in slots if k > 0]  # rank 0's, in turn
    for path, _, line in [each for each in slots if each[1] == 0]:
        from dataparallel.elastic import rounds

        joined = rounds.current()
        assert joined is not None
        if joined.generation == 0 and joined.rank == joined.size - 1:
            with open(path, "w") as file:
                file.write(line + "\n")
            wait_for_round(joined.generation + 1, formed=True)  # the others gave round 0 up
    dp.initialize()
    state = dp.elastic.ObjectState(
        w=np.zeros(DIM),
        epoch=0,
        steps=0,
        history=[],
        sampler=dp.elastic.ElasticSampler(range(args.samples), shuffle=True, seed=5),
    )
    commits = 0
    failed_discovery = False

    def commit() -> None:
        nonlocal commits, failed_discovery, tries
        tries += 1
        if me == skip_worker and tries == int(skip_at):
            return
        state.commit()
        commits += 1
        if later_slots and dp.rank() == 0 and commits >= later_slots[0][1]:
            path, _, line = later_slots.pop(0)
            with open(path, "w") as file:
                file.write(line + "\n")
            from dataparallel.elastic import rounds

            joined = rounds.current()
            assert joined is not None
            wait_for_round(joined.generation + 1)
        if args.fail_discovery and not failed_discovery and dp.rank() == 0:
            path, _, k = args.fail_discovery.rpartition(":")
            if commits >= int(k):
                failed_discovery = True
                open(path, "w").close()
                wait_until(lambda: not os.path.exists(path))

    @dp.elastic.run
    def train(state: dp.elastic.ObjectState) -> None:
        nonlocal paused
        while state.epoch < args.epochs:
            sampler = state.sampler
            if args.set_epoch_at_start:  # also on re-entry, for the epoch rolled back into
                sampler.set_epoch(state.epoch)
            for b in range(sampler.steps(args.batch)):
                if group_at and state.steps == int(group_at):
                    dp.new_group(range(dp.size()))
                indices = sampler.get_indices(b, args.batch)
                g = gradient(state.w, indices)
                if dies_after is not None and commits >= dies_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if me == leaver and commits >= int(leaves_after):
                    sys.exit(0)
                if me == staller and commits >= int(stalls_after):
                    open(stall_file, "w").close()
                    wait_until(lambda: False)
                if me == pauser and commits >= int(pauses_after) and not paused:
                    paused = True
                    open(pause_file + ".paused", "w").close()
                    wait_until(lambda: os.path.exists(pause_file))
                parts = dp.allgather_object((indices, g))
                state.w = update(state.w, parts)
                state.history.append([state.epoch, dp.size(), [p[0] for p in parts]])
                sampler.record_batch(b, args.batch)
                state.steps += 1
                if state.steps % args.commit == 0:
                    commit()
            state.epoch += 1
            if not args.set_epoch_at_start:
                sampler.set_epoch(state.epoch)
            commit()

    train(state)
    if dp.rank() == 0 and args.out:
        out = {"w": state.w.tolist(), "history": state.history, "size": dp.size()}
        with open(args.out + ".part", "w") as file:
            json.dump({**out, "pid": os.getpid()}, file)
        os.replace(args.out + ".part", args.out)
    if me == args.die_after_finish and args.out:
        wait_until(lambda: os.path.exists(args.out))
        with open(args.out) as file:
            pid = json.load(file)["pid"]
        wait_until(lambda: ended(pid))
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
