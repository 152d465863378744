"""The DeepSeek-V3 family as `model.name=deepseek`: the decoder of gpt/ with multi-head latent
attention (`model.latent`, models/layers/latent_attention.py), RMSNorm, RoPE and SwiGLU, the first
`model.moe.first_dense` layers dense and the rest a mixture of experts (models/layers/moe.py: a
sigmoid router with its balancing bias, group-limited routing, shared experts).

The dense and routed layers are two kinds of block, so the blocks are unrolled by default
(`model.impl.scan_layers=false`). hf.py maps DeepseekV3ForCausalLM onto these keys and parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from jaxdist.config import MODEL_NAME
from jaxdist.models import gpt
from jaxdist.models.deepseek import hf
from jaxdist.models.gpt.config import UnrolledImplConfig
from jaxdist.models.registry import register


class DeepseekConfig(gpt.GPTConfig):
    """The `model:` section of a DeepSeek-V3-family decoder (`model.name=deepseek`)."""

    name: Literal["deepseek"] = Field("deepseek", description=MODEL_NAME)
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="normalization layer")
    norm_eps: float = Field(1e-6, gt=0, description="the norms' epsilon")
    positions: Literal["learned", "rope"] = Field("rope", description="position encoding")
    activation: Literal["gelu", "swiglu", "geglu"] = Field(
        "swiglu", description="MLP activation (gelu: its tanh form; geglu: a gate through it, Gemma's)")
    impl: UnrolledImplConfig = Field(UnrolledImplConfig(), description="how the model runs (the same math)")


ENTRY = register(dataclasses.replace(gpt.ENTRY, section=DeepseekConfig, hf=hf.ADAPTER))
