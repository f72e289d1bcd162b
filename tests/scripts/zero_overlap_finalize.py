"""`dp.finalize()` lands the exchange that `overlap_with_forward=` leaves in flight after `step()`.

Trains, at stage 1 (under `DataParallelModel`) and stage 2, host and staged (every call
through host buffers, copied back when it lands: what a device model takes), a model with the
overlap beside a copy without it, ends the world right after the last `step()` (the exchange in
flight), then reads the parameters directly: they must be the copy's. Prints
`landed <stage> <staged>` per case on every rank. Arguments `STAGE:STAGED ...` (say `1:0 2:1`)
choose the cases; none: all four.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _torch_common import global_batch, loss_of, make_model, share

import dataparallel as dp

dp.initialize()
pairs = []
chosen = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[1:]]
for stage, staged in [(s, bool(t)) for s, t in chosen or ((1, 0), (1, 1), (2, 0), (2, 1))]:
    model = make_model(seed=stage)
    plain = copy.deepcopy(model)
    opts = [
        dp.torch.ZeroRedundancyOptimizer(
            m.parameters(),
            torch.optim.Adam,
            stage=stage,
            bucket_bytes=64,
            lr=0.01,
            _staged=staged,
            **kw,
        )
        for m, kw in ((model, {"overlap_with_forward": model}), (plain, {}))
    ]
    nets = [dp.torch.DataParallelModel(m) if stage == 1 else m for m in (model, plain)]
    for step in range(4):
        x, y = global_batch(step)
        for net, opt in zip(nets, opts, strict=True):
            opt.zero_grad()
            loss_of(net, share(x), share(y)).backward()
            opt.step()
    overlap = opts[0]._forward
    assert overlap is not None and (overlap._gather is not None) == (dp.size() > 1)
    pairs.append((f"{stage} {staged}", model, plain))
dp.finalize()
assert not dp.initialized()
for case, model, plain in pairs:
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)
    print(f"landed {case}", flush=True)
