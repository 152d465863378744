"""Reading compiled HLO: collective bytes per call, by dtype, with loops counted."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.observe import hlo


def _sum_over_devices(n: int, dtype, steps: int | None = None):
    """A compiled program that all-reduces an (8, n) array over 8 devices, `steps` times in a loop."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    split = NamedSharding(mesh, PartitionSpec("data"))

    def total(x):
        return x.sum(0)

    def looped(x):
        return jax.lax.fori_loop(0, steps, lambda i, acc: acc + (x * i).sum(0), jnp.zeros(x.shape[1:], x.dtype))

    fn = total if steps is None else looped
    x = jax.device_put(jnp.ones((8, n), dtype), split)
    return jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec())).lower(x).compile().as_text()


def test_bytes_per_call_counts_operand_bytes_by_dtype():
    assert hlo.bytes_per_call(_sum_over_devices(1000, jnp.float32)) == {"all-reduce": {"f32": 4000}}
    assert hlo.bytes_per_call(_sum_over_devices(1000, jnp.int32)) == {"all-reduce": {"s32": 4000}}


def test_bytes_per_call_multiplies_by_loop_trip_counts():
    assert hlo.bytes_per_call(_sum_over_devices(250, jnp.float32, steps=3)) == {"all-reduce": {"f32": 3 * 1000}}
