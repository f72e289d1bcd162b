"""A rank with two JAX CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2).

Reduces a gradient on one device and one sharded over both, under jit, with the default route
(the callback: the FFI call's and mpi4jax's ordered effects take one device); asks for
route="mpi4jax" and route="ffi" and expects the refusals at trace time. Prints one line per
check; exits non-zero on a wrong result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import dataparallel as dp

dp.initialize()
assert jax.local_device_count() == 2, jax.local_devices()
rank, size = dp.rank(), dp.size()
total = size * (size + 1) / 2
opt = dp.DistributedOptimizer(optax.identity(), op="sum")
grads = {"w": jnp.full(8, rank + 1.0)}
mesh = Mesh(np.array(jax.local_devices()), ("d",))
sharded = {"w": jax.device_put(grads["w"], NamedSharding(mesh, PartitionSpec("d")))}
for name, tree in (("one device", grads), ("sharded", sharded)):
    out, _ = jax.jit(opt.update)(tree, opt.init(tree))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full(8, total))
    print(f"rank {rank}: {name} ok")
for route in ("mpi4jax", "ffi"):
    explicit = dp.DistributedOptimizer(optax.identity(), op="sum", route=route)
    try:
        jax.jit(explicit.update)(grads, explicit.init(grads))
    except RuntimeError as error:
        print(f"rank {rank}: refused: {error}")
    else:
        raise SystemExit(f"route={route!r} with two devices was not refused")
dp.finalize()
