"""An elastic run whose two survivors are left waiting on each other in two different engines.

Three workers make a group of all three (`dp.new_group`), then rank 2 SIGKILLs itself. Rank 0
starts a broadcast from rank 1 on the group, which rank 1 never makes, then fails on the world's
engine (a broadcast from the dead rank 2). Rank 1 waits on the world's engine in a broadcast from
rank 0, which rank 0 never makes: it fails only once rank 0 closes its world's engine, and rank
0's broadcast on the group ends only once rank 1 closes its group. Leaving the world must close
both engines without waiting for either first. The two then re-form and finish; rank 0 writes
`--out`: the world size at the end and the worlds the function ran in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np

import dataparallel as dp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

dp.initialize()
state = dp.elastic.ObjectState()
sizes: list[int] = []  # of the worlds the function ran in, in this process


@dp.elastic.run
def train(state: dp.elastic.ObjectState) -> None:
    sizes.append(dp.size())
    if dp.size() == 3:
        group = dp.new_group(range(3))
        world = dp.get_backend()
        if dp.rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        elif dp.rank() == 0:
            group.backend.ibroadcast(np.zeros(4), root=1)  # rank 1 never makes it
            world.broadcast(np.zeros(4), root=2)  # fails: rank 2 is gone
        else:
            world.broadcast(np.zeros(4), root=0)  # rank 0 never makes it
        raise AssertionError("a call with a lost rank returned")
    dp.allreduce(np.ones(1))


train(state)
if dp.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"size": dp.size(), "sizes": sizes}, file)
