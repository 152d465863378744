"""The GPT's two layer-stack forms (stacked + scanned, per-layer + unrolled) compute one function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.models.gpt import GPT


@pytest.mark.parametrize("variant", [
    {}, {"norm": "rmsnorm", "positions": "rope", "activation": "swiglu", "tied_embeddings": True},
    {"remat": "full"},
])
def test_unrolled_per_layer_params_equal_the_scanned_stack(variant):
    base = dict(vocab=64, d_model=32, layers=3, heads=4, seq_len=16, **variant)
    with nnx.use_eager_sharding(False):
        unrolled = GPT(ModelConfig(**base, scan_layers=False), rngs=nnx.Rngs(0))
        scanned = GPT(ModelConfig(**base, scan_layers=True), rngs=nnx.Rngs(1))
    per_layer = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    stacked = dict(per_layer)
    stacked["blocks"] = jax.tree.map(lambda *layers: jnp.stack(layers), *[per_layer["blocks"][i] for i in range(3)])
    target = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(target, stacked)
    nnx.update(scanned, target)

    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-6)
    assert jax.tree.leaves(target)[0].shape[0] == 3  # the scanned form really is stacked
