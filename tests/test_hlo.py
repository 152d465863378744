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


# One reduce-scatter of 20 float32 over 2 devices as XLA writes it asynchronously: in an HLO dump, an
# `async-start` calling a computation that holds the plain op; in `compiled.as_text()` on GPU, the
# same op printed as `reduce-scatter-start` with its attributes inline.
_ASYNC_WRAPPED = """HloModule m

%add (p0: f32[], p1: f32[]) -> f32[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  ROOT %sum = f32[] add(%p0, %p1)
}

%async_computation (param_0: f32[20]) -> f32[10] {
  %param_0 = f32[20]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[10]{0} reduce-scatter(%param_0), channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[20]) -> f32[10] {
  %x = f32[20]{0} parameter(0)
  %reduce-scatter-start = ((f32[20]{0}), f32[10]{0}) async-start(%x), calls=%async_computation
  ROOT %reduce-scatter-done = f32[10]{0} async-done(%reduce-scatter-start)
}
"""

_ASYNC_SUGARED = """HloModule m

%add (p0: f32[], p1: f32[]) -> f32[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  ROOT %sum = f32[] add(%p0, %p1)
}

ENTRY %main (x: f32[20]) -> f32[10] {
  %x = f32[20]{0} parameter(0)
  %reduce-scatter-start = ((f32[20]{0}), f32[10]{0}) reduce-scatter-start(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  ROOT %reduce-scatter-done = f32[10]{0} reduce-scatter-done(%reduce-scatter-start)
}
"""


def test_async_collectives_count_once_in_either_printed_form():
    for text in (_ASYNC_WRAPPED, _ASYNC_SUGARED):
        assert hlo.bytes_per_call(text) == {"reduce-scatter": {"f32": 80}}, text
        assert [op.opcode.removesuffix("-start") for op in hlo.collectives(text, hlo.REDUCTIONS)] == ["reduce-scatter"]


def test_waited_collectives_are_the_synchronous_ones_with_loops_counted():
    """XLA on GPU keeps a collective asynchronous where it schedules work beside it; CPU's are all
    synchronous, which the step waits for."""
    for text in (_ASYNC_WRAPPED, _ASYNC_SUGARED):
        assert hlo.waited_collectives(text) == {"reduce-scatter": (0, 1)}, text
    assert hlo.waited_collectives(_sum_over_devices(250, jnp.float32)) == {"all-reduce": (1, 1)}
    assert hlo.waited_collectives(_sum_over_devices(250, jnp.float32, steps=3)) == {"all-reduce": (3, 3)}


def test_a_tuple_element_operand_counts_that_element_only():
    """`%call#0`: XLA's shorthand for element 0 of a tuple; here a matmul's result beside its s8 workspace."""
    text = """HloModule m

%add (p0: bf16[], p1: bf16[]) -> bf16[] {
  %p0 = bf16[] parameter(0)
  %p1 = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%p0, %p1)
}

ENTRY %main (x: bf16[4,8], y: bf16[8,16]) -> bf16[2,16] {
  %x = bf16[4,8]{1,0} parameter(0)
  %y = bf16[8,16]{1,0} parameter(1)
  %custom-call.1 = (bf16[4,16]{1,0}, /*index=1*/s8[4194304]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul"
  ROOT %reduce-scatter.1 = bf16[2,16]{1,0} reduce-scatter(%custom-call.1#0), channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}
"""
    assert hlo.bytes_per_call(text) == {"reduce-scatter": {"bf16": 128}}


def test_custom_calls_name_their_target_and_op_and_count_loop_trips():
    def host_double(x):
        return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def looped(x):
        return jax.lax.fori_loop(0, 3, lambda i, acc: host_double(acc), x)

    text = jax.jit(looped).lower(jnp.ones(4)).compile().as_text()
    [call] = hlo.custom_calls(text)
    assert "callback" in call.target and "pure_callback" in call.op_name
    assert call.executions == 3
