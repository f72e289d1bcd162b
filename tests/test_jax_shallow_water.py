"""mpi4jax's shallow-water example's halo exchange, with the calls renamed, against one process.

mpi4jax's `examples/shallow_water.py` splits a channel (periodic in x, walls in y) into pieces,
one per rank, each with one cell of overlap on every side, and after each update fills those
halos from its neighbours: four exchanges, clockwise (send west while receiving from the east,
then north/south, east/west, south/north), each a `sendrecv` where the rank has both neighbours,
a lone `send` or `recv` at a wall, nothing where it has neither, and a `sendrecv` with itself
where one rank spans the periodic direction. `exchange` below makes those calls in that order,
as `dp.send/recv/sendrecv(...)` where mpi4jax's program has `mpi4jax.send/recv/sendrecv(...,
comm=comm)`, inside a jitted step run under `lax.fori_loop`. The model is a smaller one written
here (a linear gravity wave on a rotating plane, on the same staggered grid), since the halos
are what is tested; mpi4jax's own code is not copied.

Every rank runs the program split over the world's ranks, for every way of laying them out in
rows x columns, gathers the pieces and compares them with the same program run in this process
as one piece (its periodic edge is then its `sendrecv` with itself). A wave crosses every piece's
edges in the steps run, so a halo filled from the wrong neighbour, or late, shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import dataparallel as dp  # noqa: E402

NY, NX = 12, 18  # the channel's cells, without halos: split into 1, 2 or 3 along either axis
DX = DY = 5e3
GRAVITY, DEPTH, CORIOLIS = 9.81, 100.0, 1e-4
DT = 0.25 * DX / np.sqrt(GRAVITY * DEPTH)
STEPS = 30

# Where each direction's halo is sent from, and where the one received lands.
SEND = {
    "west": (slice(None), 1),
    "north": (-2, slice(None)),
    "east": (slice(None), -2),
    "south": (1, slice(None)),
}
RECV = {
    "east": (slice(None), -1),
    "south": (0, slice(None)),
    "west": (slice(None), 0),
    "north": (-1, slice(None)),
}
ORDER = (("west", "east"), ("north", "south"), ("east", "west"), ("south", "north"))


@dataclass(frozen=True)
class Layout:
    """Pieces laid out in `rows` x `cols`, row 0 the southmost; this process holds piece
    `rank`, and piece i is held by world rank `ranks[i]` (one piece: this process alone)."""

    rows: int
    cols: int
    rank: int
    ranks: tuple[int, ...]

    @property
    def place(self) -> tuple[int, int]:
        return divmod(self.rank, self.cols)

    def neighbour(self, direction: str) -> int | None:
        row, col = self.place
        if direction == "south":
            return None if row == 0 else self.ranks[(row - 1) * self.cols + col]
        if direction == "north":
            return None if row == self.rows - 1 else self.ranks[(row + 1) * self.cols + col]
        step = -1 if direction == "west" else 1  # periodic in x
        return self.ranks[row * self.cols + (col + step) % self.cols]

    def piece(self) -> tuple[slice, slice]:
        """This rank's piece of the global arrays, halos included."""
        ny, nx = NY // self.rows, NX // self.cols
        row, col = self.place
        return slice(row * ny, row * ny + ny + 2), slice(col * nx, col * nx + nx + 2)


@partial(jax.jit, static_argnums=(1,))
def exchange(arr: jax.Array, layout: Layout) -> jax.Array:
    """Fill `arr`'s halos from the neighbours, clockwise, as mpi4jax's example does."""
    for to, source_side in ORDER:
        dest, source = layout.neighbour(to), layout.neighbour(source_side)
        if dest is None and source is None:
            continue
        recv_arr = jnp.empty_like(arr[RECV[source_side]])
        send_arr = arr[SEND[to]]
        if dest is None:
            recv_arr = dp.recv(recv_arr, source=source)  # mpi4jax.recv(..., comm=comm)
            arr = arr.at[RECV[source_side]].set(recv_arr)
        elif source is None:
            dp.send(send_arr, dest=dest)  # mpi4jax.send(send_arr, dest=dest, comm=comm)
        else:
            recv_arr = dp.sendrecv(send_arr, recv_arr, source=source, dest=dest)
            arr = arr.at[RECV[source_side]].set(recv_arr)
    return arr


State = tuple[jax.Array, jax.Array, jax.Array]


@partial(jax.jit, static_argnums=(1,))
def step(state: State, layout: Layout) -> State:
    """One forward-backward step: h at cell centres, u on east faces, v on north faces."""
    h, u, v = state
    inner = (slice(1, -1), slice(1, -1))
    u = u.at[inner].add(DT * (CORIOLIS * v[inner] - GRAVITY * (h[1:-1, 2:] - h[inner]) / DX))
    v = v.at[inner].add(DT * (-CORIOLIS * u[inner] - GRAVITY * (h[2:, 1:-1] - h[inner]) / DY))
    u = exchange(u, layout)
    if layout.place[0] == layout.rows - 1:
        v = v.at[-2, :].set(0.0)  # the north wall
    v = exchange(v, layout)
    divergence = (u[inner] - u[1:-1, :-2]) / DX + (v[inner] - v[:-2, 1:-1]) / DY
    h = h.at[inner].add(-DT * DEPTH * divergence)
    return exchange(h, layout), u, v


@partial(jax.jit, static_argnums=(1, 2))
def multistep(state: State, layout: Layout, steps: int) -> State:
    return jax.lax.fori_loop(0, steps, lambda _, s: step(s, layout), state)


def initial(layout: Layout) -> State:
    """A bump of water off the centre and a weak eastward jet, cut to this rank's piece."""
    y = (np.arange(NY + 2) - 0.5) * DY
    x = (np.arange(NX + 2) - 0.5) * DX
    yy, xx = np.meshgrid(y, x, indexing="ij")
    bump = np.exp(-(((xx - 0.3 * NX * DX) ** 2) + (yy - 0.6 * NY * DY) ** 2) / (3 * DX) ** 2)
    h = DEPTH + 2.0 * bump
    u = 0.5 * np.exp(-(((yy - 0.4 * NY * DY) / (2 * DY)) ** 2))
    v = np.zeros_like(h)
    piece = layout.piece()
    return tuple(exchange(jnp.asarray(a[piece], jnp.float32), layout) for a in (h, u, v))  # type: ignore[return-value]


def whole(pieces: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The channel's cells from every rank's piece (rank order, halos cut off)."""
    ny, nx = NY // rows, NX // cols
    out = np.empty((pieces.shape[1], NY, NX), pieces.dtype)
    for r in range(rows * cols):
        row, col = divmod(r, cols)
        out[:, row * ny : (row + 1) * ny, col * nx : (col + 1) * nx] = pieces[r][:, 1:-1, 1:-1]
    return out


def one_piece() -> Layout:
    """The whole channel as this process's one piece: its neighbours east and west are itself."""
    return Layout(1, 1, 0, (dp.rank(),))


def layouts(size: int) -> list[tuple[int, int]]:
    return [(rows, size // rows) for rows in range(1, size + 1) if size % rows == 0]


def solve(layout: Layout, steps: int) -> np.ndarray:
    h, u, v = multistep(initial(layout), layout, steps)
    return np.stack([np.asarray(h), np.asarray(u), np.asarray(v)])


@pytest.fixture(scope="module")
def alone() -> np.ndarray:
    """The program as one piece in this process: no other rank takes part."""
    return whole(solve(one_piece(), STEPS)[None], 1, 1)


@pytest.mark.heavy
@pytest.mark.parametrize("index", [0, 1], ids=["rows-first", "cols-first"])
def test_the_halo_exchange_matches_one_process(
    index: int, rank: int, size: int, alone: np.ndarray
) -> None:
    choices = layouts(size)
    rows, cols = choices[index if index == 0 else -1]
    split = solve(Layout(rows, cols, rank, tuple(range(size))), STEPS)
    gathered = np.asarray(dp.allgather(split[None]))
    result = whole(gathered, rows, cols)
    start = whole(np.stack([np.stack(initial(one_piece()))]), 1, 1)
    assert np.abs(alone - start).max() > 0.1  # the wave moved: the halos carried it
    np.testing.assert_allclose(result, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.heavy
def test_the_halo_exchange_runs_eagerly_too(rank: int, size: int) -> None:
    """`jax.disable_jit()`: the same calls on concrete arrays, the eager path."""
    rows, cols = layouts(size)[-1]
    with jax.disable_jit():
        split = solve(Layout(rows, cols, rank, tuple(range(size))), 3)
        reference = solve(one_piece(), 3)
    result = whole(np.asarray(dp.allgather(split[None])), rows, cols)
    np.testing.assert_allclose(result, whole(reference[None], 1, 1), rtol=1e-6, atol=1e-6)
