"""model.overlap_grad_reduce (parallel/grad_order.py): each layer's gradient tied into the backward.

The tie is an ordering only: values and gradients must not change, and there must be one barrier
per tied layer (every block but the first, and the head) where XLA's scheduler will see it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from conftest import make_config
from flax import nnx

from jaxdist import loop, models
from jaxdist.config import ModelConfig
from jaxdist.models.gpt import GPT
from jaxdist.parallel import grad_order

from test_fused_norm import _losses


def test_tie_passes_values_and_gradients_through():
    later = {"w": jnp.arange(6.0).reshape(2, 3)}
    x = jnp.array([0.5, -1.0, 2.0])

    def loss(later, x, tied):
        if tied:
            later, x = grad_order.tie(later, x)
        return jnp.sum(jnp.tanh(later["w"] @ x) ** 2) + jnp.sum(x**3)

    plain = jax.grad(loss, argnums=(0, 1))(later, x, False)
    tied = jax.grad(loss, argnums=(0, 1))(later, x, True)
    jax.tree.map(np.testing.assert_array_equal, tied, plain)
    assert loss(later, x, True) == loss(later, x, False)
    backward = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(later, x, True))
    assert backward.count("optimization_barrier") == 1


def test_one_barrier_per_tied_layer_in_the_gpt_backward():
    def barriers(**options):
        cfg = ModelConfig(vocab=64, d_model=32, layers=3, heads=4, seq_len=16, scan_layers=False,
                          loss_chunk=8, **options)
        with nnx.use_eager_sharding(False):
            model = GPT(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        tokens = jnp.zeros((2, 16), jnp.int32)

        def loss(params):
            return models.lm_loss(nnx.merge(graphdef, params), {"inputs": tokens, "targets": tokens})

        return str(jax.make_jaxpr(jax.grad(loss))(params)).count("optimization_barrier")

    assert barriers(overlap_grad_reduce=True) == 3  # blocks 1 and 2, and the head
    assert barriers(overlap_grad_reduce=False) == 0


def test_data_parallel_training_is_unchanged(tmp_path):
    """8-way data parallel: the losses with every layer tied equal XLA's own order."""
    runs = {}
    for overlap in (False, True):
        run_dir = tmp_path / str(overlap)
        loop.train(make_config(run_dir, mesh={"data": 8, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                               model={"scan_layers": False, "overlap_grad_reduce": overlap}))
        runs[overlap] = _losses(run_dir)
    assert len(runs[False]) == 10 and runs[False][-1] < runs[False][0] - 0.5, runs[False]
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-6, atol=0)


def test_overlap_needs_unrolled_layers():
    with pytest.raises(pydantic.ValidationError, match="overlap_grad_reduce needs model.scan_layers=false"):
        ModelConfig(overlap_grad_reduce=True, scan_layers=True)
