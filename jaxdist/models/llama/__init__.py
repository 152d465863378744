"""The Llama family (Llama 2 and 3, Qwen2, 2.5 and 3, Mistral, Mixtral, Qwen3-MoE) as
`model.name=llama`: the decoder of gpt/ with Llama's defaults, RMSNorm, RoPE and a SwiGLU MLP.

Grouped-query attention is `model.kv_heads`, RoPE's base `model.rope_base` (Llama 3's frequency
scaling `model.rope_scaling`), the SwiGLU hidden width `model.mlp_hidden`, Qwen2's q/k/v biases
`model.biases=qkv`, Qwen3's q and k norms `model.qk_norm`, Mistral's sliding window `model.sliding_window`,
Mixtral's and Qwen3-MoE's experts `model.moe`.
hf.py maps each published architecture's config.json and tensors onto these keys and parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from jaxdist.config import MODEL_NAME
from jaxdist.models import gpt
from jaxdist.models.llama import hf
from jaxdist.models.registry import register


class LlamaConfig(gpt.GPTConfig):
    """The `model:` section of a Llama-family decoder (`model.name=llama`)."""

    name: Literal["llama"] = Field("llama", description=MODEL_NAME)
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="normalization layer")
    norm_eps: float = Field(1e-6, gt=0, description="the norms' epsilon")
    positions: Literal["learned", "rope"] = Field("rope", description="position encoding")
    activation: Literal["gelu", "swiglu"] = Field("swiglu", description="MLP activation (gelu: its tanh form)")


ENTRY = register(dataclasses.replace(gpt.ENTRY, section=LlamaConfig, hf=hf.ADAPTER))
