"""The GPT's two layer-stack forms (stacked + scanned, per-layer + unrolled) start equal and compute one function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_walk import equations

from jaxdist.models import gpt
from jaxdist.models.gpt import GPT, GPTConfig, ImplConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("variant", "remat"), [
    ({}, "none"), ({"norm": "rmsnorm", "positions": "rope", "activation": "swiglu", "tied_embeddings": True}, "none"),
    ({}, "full"),
])
def test_unrolled_and_scanned_models_start_equal_and_compute_one_function(variant, remat):
    cfg = GPTConfig(vocab=64, d_model=32, layers=3, heads=4, seq_len=16, **variant)
    with nnx.use_eager_sharding(False):
        unrolled = GPT(cfg, ImplConfig(scan_layers=False, remat=remat), rngs=nnx.Rngs(0))
        scanned = GPT(cfg, ImplConfig(scan_layers=True, remat=remat), rngs=nnx.Rngs(0))
    per_layer = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    stacked = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    assert jax.tree.leaves(stacked["blocks"])[0].shape[0] == 3  # the scanned form really is stacked
    for i in range(3):
        jax.tree.map(np.testing.assert_array_equal, per_layer["blocks"][i],
                     jax.tree.map(lambda stack: stack[i], stacked["blocks"]))
    assert not np.array_equal(per_layer["blocks"][0]["attn"]["qkv"], per_layer["blocks"][1]["attn"]["qkv"])
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in per_layer.items() if k != "blocks"},
                 {k: v for k, v in stacked.items() if k != "blocks"})

    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_init_programs_random_draws_do_not_grow_with_depth(scan_layers):
    """Each draw compiles to kernels of its own: a draw per layer made the unrolled 406M model's
    init take longer to compile on a GPU than its train step."""
    def draws(layers: int) -> int:
        cfg = GPTConfig(vocab=64, d_model=32, layers=layers, heads=4, seq_len=16)

        def init():
            with nnx.use_eager_sharding(False):
                return nnx.state(GPT(cfg, ImplConfig(scan_layers=scan_layers), rngs=nnx.Rngs(0)), nnx.Param)

        return sum(eqn.primitive.name == "random_bits" for eqn, _ in equations(jax.make_jaxpr(init)().jaxpr))

    assert draws(2) == draws(6) > 0


def _loss_grads_and_temp_bytes(remat: str, activation: str):
    """(loss, gradients, temp bytes of the compiled value-and-grad) of a small unrolled GPT."""
    cfg = GPTConfig(vocab=64, d_model=32, layers=4, heads=4, seq_len=64, mlp_ratio=8, activation=activation)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(cfg, ImplConfig(scan_layers=False, remat=remat), rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(2), (8, 65), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss = lambda p: gpt.loss(nnx.merge(graphdef, p), batch).mean  # noqa: E731
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    loss, grads = compiled(params)
    return float(loss), grads, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_remat_mlp_recomputes_the_activation_with_the_same_gradients(activation):
    loss, grads, temp = _loss_grads_and_temp_bytes("none", activation)
    loss_mlp, grads_mlp, temp_mlp = _loss_grads_and_temp_bytes("mlp", activation)
    assert loss_mlp == loss
    for got, want in zip(jax.tree.leaves(grads_mlp), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if activation == "swiglu":
        # XLA on CPU already fuses GELU into its consumer; SwiGLU's product is kept unless
        # recomputed: one batch x length x mlp float32 array per layer (8 x 64 x 256 x 4 B).
        assert temp - temp_mlp >= 4 * 8 * 64 * 256 * 4, (temp, temp_mlp)


@pytest.mark.parametrize("impl", [{}, {"remat": "full"}], ids=["plain", "remat_full"])
def test_unrolled_blocks_are_traced_once_not_once_per_layer(monkeypatch, impl):
    """The blocks share shapes: a 6-layer step traces a block twice (the first without a pending
    residual add, then the rest), forward and gradient, so start-up does not grow with depth."""
    from jaxdist.models import gpt

    traces = []
    block_call = gpt.Block.__call__

    def counted(self, x, delta=None, docs=None):
        traces.append(delta is None)
        return block_call(self, x, delta, docs)

    monkeypatch.setattr(gpt.Block, "__call__", counted)
    cfg = GPTConfig(vocab=64, d_model=32, layers=6, heads=4, seq_len=16)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(cfg, ImplConfig(scan_layers=False, **impl), rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((4, 17), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    jax.make_jaxpr(jax.value_and_grad(lambda p: gpt.loss(nnx.merge(graphdef, p), batch).mean))(params)
    assert sorted(traces) == [False, True]


def test_attention_sums_its_input_gradients_each_new_product_first(monkeypatch):
    """The q, k and v projections' input gradients are summed with each new product as the first
    operand, the order in which XLA folds every sum into a matmul on GPU (cuBLAS's beta), with the
    same values as autodiff's order, and the same matmuls saved under the `dots` remat policy."""
    from jaxdist.models.layers import attention as attention_lib

    cfg = GPTConfig(vocab=64, d_model=32, layers=1, heads=4, seq_len=16)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(attention_lib.Attention(cfg, ImplConfig(attention="xla"), jnp.float32, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    weights = jax.random.normal(jax.random.key(2), (2, 16, 32))

    def input_grad(x):
        return jax.grad(lambda x: jnp.sum(nnx.merge(graphdef, params)(x) * weights))(x)

    program = list(equations(jax.make_jaxpr(input_grad)(x).jaxpr))
    producers = {out: eqn.primitive.name for eqn, _ in program for out in eqn.outvars}
    sums = [eqn for eqn, _ in program if eqn.primitive.name in ("add", "add_any") and eqn.outvars[0].aval.shape == x.shape]
    assert len(sums) == 2  # three products, two sums
    assert [producers.get(eqn.invars[0]) for eqn in sums] == ["dot_general", "dot_general"]

    def matmuls_under_remat_dots():  # the projections stay outside the custom VJP: the policy still saves them
        attention = jax.checkpoint(nnx.merge(graphdef, params), policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        program = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(attention(x) * weights)))(x).jaxpr
        return sum(eqn.primitive.name == "dot_general" for eqn, _ in equations(program))

    summed, matmuls = input_grad(x), matmuls_under_remat_dots()
    monkeypatch.setattr(attention_lib, "_fan_out", lambda x, count: (x,) * count)  # autodiff's own order
    np.testing.assert_array_equal(summed, input_grad(x))
    assert matmuls == matmuls_under_remat_dots()


LATENT = {"kv_rank": 16, "rope_dim": 8}


@pytest.mark.parametrize("keys, message", [
    ({"latent": LATENT, "sliding_window": 8}, "not model.sliding_window=8"),
    ({"latent": LATENT, "kv_heads": 2}, "not model.kv_heads=2"),
    ({"latent": {**LATENT, "value_dim": 64}}, "not model.latent.value_dim=64"),
    ({"global_every": 2, "sliding_window": 8, "impl": {"scan_layers": True}},
     "windowed and global layers are not one stack to scan"),
    ({"global_every": 2}, "model.global_every=2 sets windowed layers apart from global ones; it needs "
                          "model.sliding_window"),
    ({"attention_softcap": 50.0, "impl": {"attention": "cudnn"}}, "cuDNN's attention does not cap its logits"),
    ({"logit_softcap": 30.0, "impl": {"loss_chunk": 8, "loss_impl": "pallas"}}, "the Pallas loss kernel does not cap"),
])
def test_what_latent_attention_windows_and_caps_cannot_combine_is_refused(keys, message):
    """Latent attention with a window, grouped heads or values wider than the keys; global layers
    without a window or scanned; soft caps with the kernels that cannot apply them."""
    with pytest.raises(ValueError, match=message):
        GPTConfig.model_validate({"positions": "rope", "seq_len": 16, **keys})
    GPTConfig.model_validate({"positions": "rope", "seq_len": 16, "latent": LATENT})  # latent attention alone holds
