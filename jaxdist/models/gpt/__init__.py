"""The GPT decoder family: GPT-2's shape (learned positions, LayerNorm, GELU, biases) and, as
`model.name=llama`, the Llama family's. Its config section (config.py), modules (model.py, on the
shared layers of models/layers/), loss (loss.py), Hugging Face adapter (hf.py: GPT-2), FLOP count and random batch, registered here once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flax import nnx

from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.kernels import gelu_matmul, softmax_grad
from jaxdist.models import dtypes as dtypes_lib
from jaxdist.models.gpt import hf
from jaxdist.models.gpt.config import GPTConfig, ImplConfig, RopeScaling
from jaxdist.models.gpt.loss import loss
from jaxdist.models.gpt.model import GPT, Block, read_in_compute_dtype
from jaxdist.models.layers.attention import Attention, Documents, KVCache, documents
from jaxdist.models.layers.common import HEADS, KV_HEADS, RESIDUAL
from jaxdist.models.registry import ModelEntry, register

__all__ = ["GPT", "Attention", "Block", "Documents", "GPTConfig", "ImplConfig", "KVCache", "RESIDUAL", "RopeScaling",
           "create", "documents", "flops_per_token", "loss", "random_tokens"]


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token as the PaLM paper counts them for model FLOPs utilization
    (Chowdhery et al. 2022, appendix B): 6N + 12 x layers x d x seq, N the parameters of the matmuls
    (the output projection included; 12 x layers x d^2 + vocab x d for a GELU MLP of 4 x d without
    grouped-query attention), 12 x layers x d x seq for attention (d: the heads' widths summed, where
    `model.head_dim` makes them other than d_model, half of it the queries' and keys', half the
    values'; seq: the sliding window, in the layers it covers and where it is shorter). A
    mixture's layers count the parameters a token goes through: its k routed experts, the shared
    ones and the router."""
    m = cfg.model
    attention = m.d_model * m.head_width * 2 * (m.heads + m.key_value_heads)
    if m.latent.kv_rank:
        attention = latent_params(m)
    per_hidden = (2 if m.activation == "gelu" else 3) * m.d_model
    mlp = per_hidden * m.mlp_dim
    moe = m.moe
    experts = per_hidden * m.expert_hidden * (moe.experts_per_token + moe.shared_experts) + m.d_model * moe.experts
    feed_forward = sum(experts if moe.is_moe(layer) else mlp for layer in range(m.layers))
    matmul_params = int(m.layers * attention + feed_forward) + m.vocab * m.d_model
    attended = sum(min(m.seq_len, m.layer_window(layer) or m.seq_len) for layer in range(m.layers))
    return 6 * matmul_params + 6 * m.heads * (m.query_key_width + m.value_width) * attended


def latent_params(m: GPTConfig) -> int:
    """The matmul parameters of one layer's latent attention: the queries' (through their latent or
    not), the latent's down and up projections, and the output's."""
    latent, heads = m.latent, m.heads
    queries = (m.d_model * latent.q_rank + latent.q_rank * heads * m.query_key_width if latent.q_rank
               else m.d_model * heads * m.query_key_width)
    return (queries + m.d_model * (latent.kv_rank + latent.rope_dim)
            + latent.kv_rank * heads * (m.head_width + m.value_width) + heads * m.value_width * m.d_model)


def random_tokens(cfg: Config, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """`rows` sequences of uniform random tokens: inputs and the same tokens shifted by one as targets."""
    tokens = rng.integers(0, cfg.model.vocab, (rows, cfg.model.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def create(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
    """The GPT `cfg` describes, as a function of its random keys (in the configured dtypes)."""
    if cfg.model.vocab == "auto":
        raise UserError("model.vocab=auto is not resolved; pass the config through "
                        "jaxdist.data.loader.resolve_model, or set model.vocab to a number")
    dtypes = dtypes_lib.policy(cfg.precision)
    return lambda rngs: GPT(cfg.model, rngs=rngs, param_dtype=dtypes.param_dtype, compute_dtype=dtypes.compute_dtype,
                            pipeline=cfg.pipeline, fp8=dtypes.fp8)


ENTRY = register(ModelEntry(
    section=GPTConfig, create=create, loss=loss,
    flops_per_example=lambda cfg: flops_per_token(cfg) * cfg.model.seq_len,
    random_batch=random_tokens, batch_keys=("inputs", "targets"), read_in_compute_dtype=read_in_compute_dtype,
    samples_text=True, hf=hf.ADAPTER, scales=True,
    activations=(RESIDUAL, HEADS, KV_HEADS, gelu_matmul.PRE_NAMES, gelu_matmul.OUT_NAMES, softmax_grad.LOGITS,
                 ("vocab", "embed"), ("embed", "vocab"), ("batch", "embed", "vocab")),
))
