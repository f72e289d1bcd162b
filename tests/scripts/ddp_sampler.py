"""A DDP script ported to dataparallel: dp.initialize() instead of init_process_group, the rest
unchanged (DistributedSampler, dist.all_reduce, DistributedDataParallel).

It prints what tests/test_torch_distributed.py checks: each rank's `ddp` line, whose `sum` is the
all_reduce of rank + 1 over torch's group made beside the world, then whether torch's group is
still there after dp.finalize() (`AFTER FINALIZE ... initialized=False`).
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dataparallel as dp


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


dp.initialize()
assert dist.is_initialized(), "torch.distributed was not initialized alongside the world"
assert (dist.get_rank(), dist.get_world_size()) == (dp.rank(), dp.size())
data = TensorDataset(torch.arange(12.0).reshape(12, 1), torch.ones(12, 1))
sampler = DistributedSampler(data, shuffle=False)
loader = DataLoader(data, batch_size=2, sampler=sampler)
seen = [int(x.item()) for batch, _ in loader for x in batch]
count = torch.tensor([len(seen)])
dist.all_reduce(count)
ranks = torch.tensor([dp.rank() + 1.0])
dist.all_reduce(ranks)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(1, 1))
for batch, target in loader:
    loss = torch.nn.functional.mse_loss(model(batch), target)
    loss.backward()
grads = [p.grad.clone() for p in model.parameters()]
every = [torch.zeros_like(grads[0]) for _ in range(dp.size())]
dist.all_gather(every, grads[0])  # DDP averaged the gradients: every rank holds the same ones
same = all(torch.equal(every[0], g) for g in every)
say(
    f"ddp rank={dist.get_rank()} size={dist.get_world_size()} backend={dp.get_backend().name} "
    f"samples={','.join(map(str, seen))} total={count.item()} same_grads={same} "
    f"sum={ranks.item():g}",
)
dp.finalize()
say(f"AFTER FINALIZE rank=- initialized={dist.is_initialized()}")
