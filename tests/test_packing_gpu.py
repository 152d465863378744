"""On a GPU, packed documents' attention mask holds under both attention implementations: cuDNN's
fused attention and XLA's give each document of a packed row the losses it has alone (bfloat16).

Skipped where JAX finds no GPU (CI's machines); run it on a GPU host with
`make test-gpu` (or `JAXDIST_GPU_TESTS=1 pytest tests/test_packing_gpu.py -s`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist import models
from jaxdist.config import Config
from jaxdist.data.stream import PackedDocuments

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
SEP = 0


def _losses(model, batch) -> np.ndarray:
    logits = model(*(None if batch.get(k) is None else jnp.asarray(batch[k]) for k in ("inputs", "segments", "positions")))
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                      jnp.asarray(batch["targets"])))


@pytest.mark.parametrize("attention", ["cudnn", "xla"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_packed_documents_attend_only_within_themselves(name, attention):
    cfg = Config.model_validate({
        "model": {"name": name, "vocab": 512, "d_model": 256, "layers": 2, "heads": 4, "seq_len": 256,
                  "impl": {"attention": attention}, **({"kv_heads": 2} if name == "llama" else {})},
        "precision": {"compute": "bfloat16"}})
    with nnx.use_eager_sharding(False):
        model = models.get(name).create(cfg)(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 512, length), SEP) for length in (40, 97, 12, 180, 64, 33, 250)]
    source = PackedDocuments(np.concatenate(docs).astype(np.int32), 256, SEP)
    rows = [source[i] for i in range(len(source))]
    packed = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    losses = _losses(model, packed)
    worst = 0.0
    for doc in docs:
        alone = _losses(model, {"inputs": doc[None, :-1], "targets": doc[None, 1:]})[0]
        row, at = next((r, at) for r in range(len(rows)) if (at := _starts(packed["inputs"][r], doc[:-1])) is not None)
        worst = max(worst, float(np.abs(losses[row, at:at + len(alone)] - alone).max()))
    print(f"{name} {attention}: {len(docs)} documents in {len(rows)} rows, worst |packed - alone| = {worst:.2e}")
    # bfloat16 activations: the same document in another row is summed in another order.
    assert worst < 0.05


def _starts(tokens: np.ndarray, doc: np.ndarray) -> int | None:
    for at in range(len(tokens) - len(doc) + 1):
        if np.array_equal(tokens[at:at + len(doc)], doc):
            return at
    return None
