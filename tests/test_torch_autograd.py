"""Differentiable collectives (`dp.torch.allreduce`, ...), at any world size.

Each rank draws its own input `x_r` and its own upstream gradient `w_r` (from seeds, so that every
rank can draw every rank's), runs the collective forward and `backward(w_r)`. The reference is one
process holding every rank's input: it computes the same outputs, and the gradient of the total
`sum_r <y_r, w_r>` with torch's autograd. Horovod's gradients are that gradient for allreduce and
alltoall, that gradient over `size` for allgather and broadcast, and that gradient times `size`
for reducescatter (`dataparallel.torch._autograd`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dataparallel as dp

Shapes = Callable[[int], tuple[int, ...]]


def draw(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def every_input(size: int, shape: Shapes, salt: int) -> list[torch.Tensor]:
    """Every rank's input, as a list of leaves of the one-process reference."""
    return [draw(r, shape(r), salt).requires_grad_() for r in range(size)]


def reference_grads(
    inputs: list[torch.Tensor], outputs: list[torch.Tensor], salt: int
) -> list[torch.Tensor]:
    """The gradient of sum_r <outputs[r], w_r> with respect to every rank's input."""
    total = sum((y * draw(r, tuple(y.shape), salt + 1)).sum() for r, y in enumerate(outputs))
    assert isinstance(total, torch.Tensor)
    return list(torch.autograd.grad(total, inputs, allow_unused=True))


def run_here(
    collective: Callable[[torch.Tensor], torch.Tensor], rank: int, shape: Shapes, salt: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run `collective` on this rank's input, backward with this rank's w; return x, y, x.grad."""
    x = draw(rank, shape(rank), salt).requires_grad_()
    before = x.detach().clone()
    y = collective(x)
    assert y is not x and y.requires_grad
    y.backward(draw(rank, tuple(y.shape), salt + 1))
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0)  # out of place
    assert x.grad is not None
    return x, y, x.grad


# -- allreduce ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "scale"), [("sum", None), ("avg", None), ("sum", 0.5), ("avg", 3.0)]
)
def test_allreduce_gradient_is_the_allreduce_of_the_gradients(
    op: str, scale: float | None, rank: int, size: int
) -> None:
    def shape(r: int) -> tuple[int, ...]:
        return (3, 4)

    _, y, grad = run_here(lambda x: dp.torch.allreduce(x, op, scale=scale), rank, shape, 1)
    xs = every_input(size, shape, 1)
    factor = (1.0 if scale is None else scale) / (size if op == "avg" else 1)
    reduced = sum(xs) * factor
    assert isinstance(reduced, torch.Tensor)
    torch.testing.assert_close(y, reduced.detach())
    want = reference_grads(xs, [reduced] * size, 1)[rank]
    torch.testing.assert_close(grad, want)


def test_allreduce_matches_finite_differences(rank: int, size: int) -> None:
    """d/dx_r of sum_s <avg(x), w_s>, by central differences of the one-process function."""
    x = draw(rank, (5,), 3).requires_grad_()
    dp.torch.allreduce(x, "avg").backward(draw(rank, (5,), 4))
    assert x.grad is not None
    xs = [draw(r, (5,), 3) for r in range(size)]
    ws = [draw(r, (5,), 4) for r in range(size)]

    def f(mine: torch.Tensor) -> float:
        inputs = [mine if r == rank else xs[r] for r in range(size)]
        mean = sum(inputs) / size
        return float(sum((mean * w).sum() for w in ws))

    eps = 1e-6
    numeric = torch.tensor(
        [
            (f(xs[rank] + eps * e) - f(xs[rank] - eps * e)) / (2 * eps)
            for e in torch.eye(5, dtype=torch.float64)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(x.grad, numeric, rtol=1e-6, atol=1e-8)


def test_allreduce_composes_with_a_model_and_a_second_backward(rank: int, size: int) -> None:
    layer = torch.nn.Linear(4, 2).double()
    torch.nn.init.constant_(layer.weight, 0.5)
    torch.nn.init.zeros_(layer.bias)
    x = draw(rank, (3, 4), 5)
    hidden = dp.torch.allreduce(layer(x), "avg")
    (hidden**2).sum().backward()
    xs = [draw(r, (3, 4), 5) for r in range(size)]
    reference = torch.nn.Linear(4, 2).double()
    torch.nn.init.constant_(reference.weight, 0.5)
    torch.nn.init.zeros_(reference.bias)
    mean = sum(reference(v) for v in xs) / size
    assert isinstance(mean, torch.Tensor)
    (size * (mean**2).sum()).backward()  # every rank's loss is the same: the total is size times
    # This rank's weight gradient is its share: the sum over ranks is the reference's.
    assert layer.weight.grad is not None and reference.weight.grad is not None
    total = dp.allreduce(layer.weight.grad.clone(), "sum")
    torch.testing.assert_close(total, reference.weight.grad)


@pytest.mark.parametrize("op", ["min", "max", "prod"])
def test_allreduce_without_a_gradient_raises_in_backward(op: str, rank: int) -> None:
    x = draw(rank, (3,), 6).abs().requires_grad_()
    y = dp.torch.allreduce(x, op)
    with pytest.raises(RuntimeError, match="has no gradient"):
        y.sum().backward()


def test_allreduce_of_a_tensor_without_grad_returns_a_plain_new_tensor(rank: int) -> None:
    x = torch.full((2,), float(rank))
    y = dp.torch.allreduce(x, "max")
    assert y is not x and not y.requires_grad
    assert torch.equal(x, torch.full((2,), float(rank)))


def test_allreduce_refuses_what_is_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"takes a torch\.Tensor"):
        dp.torch.allreduce([1.0, 2.0])  # type: ignore[arg-type]


def test_allreduce_with_compression_differentiates_in_16_bits(rank: int, size: int) -> None:
    x = draw(rank, (64,), 7).float().requires_grad_()
    y = dp.torch.allreduce(x, "avg", compression=dp.Compression.fp16)
    assert y.dtype == torch.float32
    y.backward(torch.ones(64))
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(64))  # exact in float16
    want = sum(draw(r, (64,), 7).float() for r in range(size)) / size
    torch.testing.assert_close(y.detach(), want, rtol=2e-3, atol=2e-3)


# -- allgather ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_allgather_gradient_is_the_average_at_this_ranks_rows(
    dims: int, rank: int, size: int
) -> None:
    def shape(r: int) -> tuple[int, ...]:
        return (r + 2,) + (3,) * (dims - 1)  # the first axis differs between ranks

    _, y, grad = run_here(dp.torch.allgather, rank, shape, 8)
    xs = every_input(size, shape, 8)
    gathered = torch.cat(xs)
    torch.testing.assert_close(y, gathered.detach())
    want = reference_grads(xs, [gathered] * size, 8)[rank] / size
    torch.testing.assert_close(grad, want)


def test_allgather_of_a_scalar_has_the_scalars_gradient(rank: int, size: int) -> None:
    x = torch.tensor(float(rank), dtype=torch.float64, requires_grad=True)
    y = dp.torch.allgather(x)
    assert y.shape == (size,)
    y.backward(torch.arange(size, dtype=torch.float64))
    assert x.grad is not None and x.grad.shape == ()
    assert float(x.grad) == rank  # every rank sent the same upstream gradient


# -- broadcast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("root_of", [lambda n: 0, lambda n: n - 1], ids=["first", "last"])
def test_broadcast_gradient_goes_to_the_root_averaged(
    root_of: Callable[[int], int], rank: int, size: int
) -> None:
    root = root_of(size)

    def shape(r: int) -> tuple[int, ...]:
        return (2, 5)

    _, y, grad = run_here(lambda x: dp.torch.broadcast(x, root), rank, shape, 9)
    xs = every_input(size, shape, 9)
    torch.testing.assert_close(y, xs[root].detach())
    grads = reference_grads(xs, [xs[root]] * size, 9)
    want = grads[rank] / size if rank == root else torch.zeros(2, 5, dtype=torch.float64)
    torch.testing.assert_close(grad, want)


# -- groups -------------------------------------------------------------------------------------


def test_collectives_in_a_group_differentiate_among_its_ranks(rank: int, size: int) -> None:
    members = list(range(0, size, 2))  # every other rank; rank 1 of 2 is in no group
    group = dp.new_group(members)
    if not group.member:
        return
    me, n = dp.rank(group), dp.size(group)
    x = draw(rank, (4,), 10).requires_grad_()
    y = dp.torch.allreduce(x, "sum", group=group)
    torch.testing.assert_close(y.detach(), sum(draw(r, (4,), 10) for r in members))
    gathered = dp.torch.allgather(x.detach().clone().requires_grad_(), group=group)
    assert gathered.shape == (4 * n,)
    (y.sum() + gathered.sum()).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full((4,), float(n), dtype=torch.float64))
    assert me == members.index(rank)


# -- alltoall and reducescatter -----------------------------------------------------------------

needs_alltoall = pytest.mark.skipif(
    not hasattr(dp, "alltoall"), reason="dp.alltoall is not in this build yet"
)
needs_reducescatter = pytest.mark.skipif(
    not hasattr(dp, "reducescatter"), reason="dp.reducescatter is not in this build yet"
)


@needs_alltoall
def test_alltoall_gradient_goes_back_where_the_rows_came_from(rank: int, size: int) -> None:
    def splits_of(r: int) -> list[int]:
        return [(r + d) % 3 + 1 for d in range(size)]  # rank r sends splits_of(r)[d] rows to d

    def shape(r: int) -> tuple[int, ...]:
        return (sum(splits_of(r)), 2)

    x = draw(rank, shape(rank), 11).requires_grad_()
    y, received = dp.torch.alltoall(x, splits_of(rank))
    assert [int(s) for s in received] == [splits_of(r)[rank] for r in range(size)]
    y.backward(draw(rank, tuple(y.shape), 12))
    xs = every_input(size, shape, 11)
    pieces = [torch.split(v, splits_of(r)) for r, v in enumerate(xs)]
    outputs = [torch.cat([pieces[s][d] for s in range(size)]) for d in range(size)]
    torch.testing.assert_close(y.detach(), outputs[rank].detach())
    assert x.grad is not None
    torch.testing.assert_close(x.grad, reference_grads(xs, outputs, 11)[rank])


@needs_reducescatter
@pytest.mark.parametrize(("op", "scale"), [("sum", None), ("avg", None), ("sum", 2.0)])
def test_reducescatter_gradient_is_the_allgather_of_the_gradients(
    op: str, scale: float | None, rank: int, size: int
) -> None:
    rows = 2 * size + 1  # uneven: the first rank gets one row more

    def shape(r: int) -> tuple[int, ...]:
        return (rows, 3)

    x = draw(rank, shape(rank), 13).requires_grad_()
    y = dp.torch.reducescatter(x, op, scale=scale)
    y.backward(draw(rank, tuple(y.shape), 14))
    xs = every_input(size, shape, 13)
    factor = (1.0 if scale is None else scale) / (size if op == "avg" else 1)
    total = sum(xs) * factor
    assert isinstance(total, torch.Tensor)
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    outputs = list(torch.split(total, counts))
    torch.testing.assert_close(y.detach(), outputs[rank].detach())
    assert x.grad is not None
    want = reference_grads(xs, outputs, 13)[rank] * size
    torch.testing.assert_close(x.grad, want)


def test_bad_arguments_raise_on_every_rank_and_the_world_goes_on(rank: int, size: int) -> None:
    x = torch.ones(size, 2, requires_grad=True)
    with pytest.raises(ValueError, match="root"):
        dp.torch.broadcast(x, root=size)
    with pytest.raises(ValueError, match="splits"):
        dp.torch.alltoall(x, splits=[1] * (size + 1))
    with pytest.raises(ValueError, match="reduction"):
        dp.torch.allreduce(x, "mean")  # type: ignore[arg-type]
    y = dp.torch.allreduce(x, "sum")
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full((size, 2), float(size)))
