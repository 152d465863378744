"""The Gemma family (Gemma 2 and 3, text) as `model.name=gemma`: the decoder of gpt/ with Gemma's
defaults: RMSNorm, RoPE, GeGLU, the embedding tied and scaled by sqrt(d_model), and every block's
attention and MLP outputs normed before they join the residual (`model.post_norms`).

Windowed and global layers alternate (`model.sliding_window`, one global layer in every
`model.global_every`), so the blocks are unrolled by default (`model.impl.scan_layers=false`);
Gemma 2 caps its attention and output logits softly (`model.attention_softcap`,
`model.logit_softcap`), Gemma 3 norms q and k instead (`model.qk_norm`) and gives its windowed
layers a RoPE base of their own (`model.local_rope_base`). Both scale the attention logits by
`model.attention_scale_dim` (query_pre_attn_scalar). hf.py maps Gemma2ForCausalLM and
Gemma3ForCausalLM onto these keys and parameters; the norms scale by 1 + w as Gemma's do
(`model.norm_plus_one`), so their parameters are the published ones.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from jaxdist.config import MODEL_NAME
from jaxdist.models import gpt
from jaxdist.models.gemma import hf
from jaxdist.models.gpt.config import UnrolledImplConfig
from jaxdist.models.registry import register


class GemmaConfig(gpt.GPTConfig):
    """The `model:` section of a Gemma-family decoder (`model.name=gemma`)."""

    name: Literal["gemma"] = Field("gemma", description=MODEL_NAME)
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="normalization layer")
    norm_eps: float = Field(1e-6, gt=0, description="the norms' epsilon")
    positions: Literal["learned", "rope"] = Field("rope", description="position encoding")
    activation: Literal["gelu", "swiglu", "geglu"] = Field(
        "geglu", description="MLP activation (gelu: its tanh form; geglu: a gate through it, Gemma's)")
    tied_embeddings: bool = Field(True, description="the output projection reuses the token embedding")
    embed_scale: bool = Field(True, description="the embedding's rows multiplied by sqrt(d_model) (Gemma)")
    norm_plus_one: bool = Field(
        True, description="the norms scale by 1 + w, w their parameter, starting at 0 (Gemma's); false: by w")
    post_norms: bool = Field(
        True, description="attention's and the MLP's outputs normed before they join the residual (Gemma 2 and 3)")
    impl: UnrolledImplConfig = Field(UnrolledImplConfig(), description="how the model runs (the same math)")


ENTRY = register(dataclasses.replace(gpt.ENTRY, section=GemmaConfig, hf=hf.ADAPTER))
