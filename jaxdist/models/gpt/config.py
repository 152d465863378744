"""The GPT decoder's config section (`model:` with `model.name=gpt`) and how it runs (`model.impl`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from jaxdist.config import MODEL_NAME, ModelSection, ParamSize, Section
from jaxdist.config.base import positive_or_auto
from jaxdist.models.layers.latent_attention import LatentConfig
from jaxdist.models.layers.moe import MoEConfig


class ImplConfig(Section):
    """How the model runs: layer stacking, recomputation, kernels and loss chunking.

    None of these changes the math beyond float rounding; they trade compile time, memory and speed
    (docs/performance.md says what each was measured to do). For a kernel switch, auto uses it where
    it is possible and known to be faster, xla never, the explicit value always (or errors).
    """

    scan_layers: bool = Field(
        True, description="true: layers stacked in a lax.scan (fast compile, needed by pipelines); false: unrolled")
    remat: Literal["none", "mlp", "full", "dots"] = Field(
        "none", description="recomputed in the backward: nothing, the MLP activation, whole blocks, or all but matmuls")
    attention: Literal["auto", "xla", "cudnn"] = Field("auto", description="attention implementation")
    norm_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="residual add + norm as one Pallas kernel (kernels/fused_norm.py)")
    gelu_grad_impl: Literal["auto", "xla", "cublaslt"] = Field(
        "auto", description="GELU's gradient in the MLP backward matmul's cuBLASLt epilogue (kernels/gelu_matmul.py)")
    grouped_matmul_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="a mixture's experts as jax's Mosaic GPU grouped-matmul kernels (kernels/grouped_matmul.py)")
    logits_dtype: Literal["float32", "compute"] = Field(
        "float32", description="dtype of the output projection's logits (the softmax is float32 either way)")
    loss_chunk: int = Field(
        0, ge=0, description="> 0: the loss projects this many positions at a time, never the full logits")
    loss_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="the chunked loss's softmax and gradient as one Pallas kernel (needs loss_chunk > 0)")

    @model_validator(mode="after")
    def _combinations(self) -> ImplConfig:
        if self.loss_impl == "pallas" and not self.loss_chunk:
            raise ValueError("model.impl.loss_impl=pallas needs model.impl.loss_chunk > 0 (the kernel runs inside the "
                             "chunked loss)")
        return self


class UnrolledImplConfig(ImplConfig):
    """`model.impl` of a family whose layers are of two kinds (windowed and global, dense and routed):
    as `ImplConfig`, the layers unrolled by default, as no one stack can scan them."""

    scan_layers: bool = Field(
        False, description="true: layers stacked in a lax.scan (only where every layer is alike); false: unrolled")


class RopeScaling(Section):
    """RoPE's frequencies slowed for a longer context. Llama 3's (`rope_type: llama3` in a Hugging
    Face config): wavelengths above `original_length / low_freq_factor` are divided by `factor`,
    those below `original_length / high_freq_factor` kept, those between blended. Linear (`linear`,
    Gemma 3's global layers): every frequency divided by `factor`, as if positions were."""

    kind: Literal["none", "llama3", "linear"] = Field(
        "none", description="none: plain RoPE; llama3: Llama 3.1's scaling; linear: every frequency / factor")
    factor: float = Field(8.0, gt=0, description="how much the low frequencies are slowed")
    low_freq_factor: float = Field(1.0, gt=0, description="original_length / this: the longest kept wavelength's bound")
    high_freq_factor: float = Field(4.0, gt=0, description="original_length / this: the shortest scaled wavelength's bound")
    original_length: int = Field(8192, gt=0, description="the context length the model was first trained at")

    @model_validator(mode="after")
    def _factors(self) -> RopeScaling:
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"model.rope_scaling.low_freq_factor={self.low_freq_factor}")
        return self


class GPTConfig(ModelSection):
    """The `model:` section of a decoder-only transformer language model (`model.name=gpt`).

    The same decoder covers GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) and,
    as `model.name=llama`, the Llama family (RMSNorm, RoPE, SwiGLU, grouped-query attention).
    """

    name: Literal["gpt"] = Field("gpt", description=MODEL_NAME)
    vocab: int | Literal["auto"] = Field(
        256, description="vocabulary size; auto: the configured data's (resolved before the model is built)")
    d_model: int = Field(256, gt=0, description="width of the residual stream")
    layers: int = Field(4, gt=0, description="number of transformer blocks")
    heads: int = Field(8, gt=0, description="attention heads (must divide d_model unless head_dim is set)")
    head_dim: int | None = Field(None, gt=0, description="each head's width; null: d_model / heads (Qwen3: wider)")
    kv_heads: int | None = Field(
        None, gt=0, description="key and value heads, shared by groups of query heads (must divide heads); "
                                "null: as many as heads")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width as a multiple of d_model")
    mlp_hidden: int | None = Field(None, gt=0, description="MLP hidden width; null: int(d_model x mlp_ratio)")
    seq_len: int = Field(256, gt=0, description="tokens per sequence")
    max_positions: int | None = Field(
        None, gt=0, description="rows of the learned position table (at least seq_len); null: seq_len")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="normalization layer")
    norm_eps: float = Field(1e-5, gt=0, description="the norms' epsilon")
    positions: Literal["learned", "rope"] = Field("learned", description="position encoding")
    rope_base: float = Field(10000.0, gt=0, description="RoPE's base period (rope_theta)")
    rope_scaling: RopeScaling = Field(RopeScaling(), description="RoPE's frequency scaling")
    activation: Literal["gelu", "swiglu", "geglu"] = Field(
        "gelu", description="MLP activation (gelu: its tanh form; geglu: a gate through it, Gemma's)")
    qk_norm: bool = Field(False, description="each head's q and k RMS-normed before RoPE (Qwen3, Gemma 3)")
    sliding_window: int | None = Field(
        None, gt=0, description="each query attends to this many tokens, itself and the ones just before it, in "
                                "every layer (Mistral's sliding window) or those global_every leaves; null: to all "
                                "earlier tokens")
    global_every: int | None = Field(
        None, gt=0, description="with sliding_window: every this-many-th layer attends to all earlier tokens (Gemma "
                                "2: 2, Gemma 3: 6); null: every layer windowed")
    local_rope_base: float | None = Field(
        None, gt=0, description="the windowed layers' RoPE base, unscaled, where global_every sets global layers "
                                "apart (Gemma 3); null: rope_base and rope_scaling, as the others")
    norm_plus_one: bool = Field(
        False, description="the norms scale by 1 + w, w their parameter, starting at 0 (Gemma's); false: by w")
    post_norms: bool = Field(
        False, description="attention's and the MLP's outputs normed before they join the residual (Gemma 2 and 3)")
    embed_scale: bool = Field(False, description="the embedding's rows multiplied by sqrt(d_model) (Gemma)")
    attention_scale_dim: int | None = Field(
        None, gt=0, description="attention logits scaled by 1/sqrt(this) (Gemma's query_pre_attn_scalar); null: "
                                "1/sqrt(head_dim)")
    attention_softcap: float | None = Field(
        None, gt=0, description="attention logits capped softly: c x tanh(logit / c) (Gemma 2: 50); null: none")
    logit_softcap: float | None = Field(
        None, gt=0, description="output logits capped softly: c x tanh(logit / c) (Gemma 2: 30); null: none")
    biases: Literal["none", "qkv", "all"] = Field(
        "none", description="additive biases: none; on the q, k and v projections (Qwen2); on every projection (GPT-2)")
    tied_embeddings: bool = Field(False, description="the output projection reuses the token embedding")
    init_from: str | None = Field(
        None, description="hf:FOLDER: a fresh run starts from a Hugging Face model's weights, and takes the "
                          "architecture from its config.json")
    moe: MoEConfig = Field(MoEConfig(), description="a mixture of experts in some layers' place of the MLP")
    latent: LatentConfig = Field(LatentConfig(), description="multi-head latent attention in place of the q, k, v "
                                                             "projections (DeepSeek-V3)")
    impl: ImplConfig = Field(ImplConfig(), description="how the model runs (the same math)")

    @field_validator("vocab", mode="before")
    @classmethod
    def _vocab(cls, value: Any) -> Any:
        return positive_or_auto("model.vocab", value, "ids", "vocabulary")

    @model_validator(mode="after")
    def _shapes(self) -> GPTConfig:
        if self.head_dim is None and self.d_model % self.heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        if self.heads % self.key_value_heads:
            raise ValueError(f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}")
        if self.positions == "learned" and self.position_rows < self.seq_len:
            raise ValueError(f"model.max_positions={self.max_positions} is below model.seq_len={self.seq_len}: the "
                             f"learned position table needs a row per position")
        if self.init_from is not None and not self.init_from.startswith("hf:"):
            raise ValueError(f"model.init_from={self.init_from!r}: write hf:FOLDER, a Hugging Face model folder")
        if self.positions == "rope" and self.head_width % 2:
            raise ValueError(f"model.positions=rope needs an even head dimension, not {self.head_width}")
        if self.mlp_dim < 1:
            raise ValueError(f"model.mlp_ratio={self.mlp_ratio} makes the MLP's hidden width int(model.d_model x "
                             f"model.mlp_ratio) = {self.mlp_dim}; it needs at least 1: model.mlp_ratio >= "
                             f"1/{self.d_model}")
        chunk = self.impl.loss_chunk
        if chunk and self.seq_len % chunk:
            raise ValueError(f"model.impl.loss_chunk={chunk} does not divide model.seq_len={self.seq_len}; use a "
                             f"divisor of {self.seq_len}, or 0 for the unchunked loss")
        self._feature_combinations()
        if self.impl.gelu_grad_impl == "cublaslt" and self.activation != "gelu":
            raise ValueError(f"model.impl.gelu_grad_impl=cublaslt needs model.activation=gelu, not {self.activation}")
        moe = self.moe
        if moe.experts and not any(moe.is_moe(layer) for layer in range(self.layers)):
            raise ValueError(f"model.moe.first_dense={moe.first_dense} and model.moe.every={moe.every} leave none of "
                             f"the model.layers={self.layers} layers with experts")
        if moe.experts and self.impl.scan_layers and not all(moe.is_moe(layer) for layer in range(self.layers)):
            raise ValueError(f"model.moe.first_dense={moe.first_dense}, model.moe.every={moe.every}: layers with and "
                             f"without experts are not one stack to scan; set model.impl.scan_layers=false")
        return self

    def _feature_combinations(self) -> None:
        """What windows, soft caps and latent attention need of the rest of the section."""
        if self.global_every is not None and self.sliding_window is None:
            raise ValueError(f"model.global_every={self.global_every} sets windowed layers apart from global ones; it "
                             f"needs model.sliding_window")
        if self.global_every is not None and self.impl.scan_layers:
            raise ValueError(f"model.global_every={self.global_every}: windowed and global layers are not one stack to "
                             f"scan; set model.impl.scan_layers=false")
        if self.local_rope_base is not None and self.global_every is None:
            raise ValueError(f"model.local_rope_base={self.local_rope_base} is the windowed layers' RoPE base apart "
                             f"from the global ones'; it needs model.global_every")
        if self.attention_softcap is not None and self.impl.attention == "cudnn":
            raise ValueError(f"model.attention_softcap={self.attention_softcap}: cuDNN's attention does not cap its "
                             f"logits; set model.impl.attention=xla or auto")
        if self.logit_softcap is not None and self.impl.loss_impl == "pallas":
            raise ValueError(f"model.logit_softcap={self.logit_softcap}: the Pallas loss kernel does not cap the "
                             f"logits; set model.impl.loss_impl=xla or auto")
        if self.latent.kv_rank:
            unlike = [f"model.{key}={value}" for key, value, holds in (
                ("kv_heads", self.kv_heads, self.key_value_heads == self.heads),
                ("sliding_window", self.sliding_window, self.sliding_window is None),
                ("qk_norm", self.qk_norm, not self.qk_norm), ("biases", self.biases, self.biases == "none"),
                ("positions", self.positions, self.positions == "rope"),
                ("latent.value_dim", self.latent.value_dim, self.value_width <= self.query_key_width)) if not holds]
            if unlike:
                raise ValueError(f"model.latent.kv_rank={self.latent.kv_rank}: latent attention has every head's keys "
                                 f"and values (values no wider than model.head_dim + model.latent.rope_dim), RoPE, no "
                                 f"window, q/k norms or biases; not {', '.join(unlike)}")
        if self.activation == "geglu" and self.moe.experts:
            raise ValueError("model.activation=geglu: the experts run SwiGLU or GELU; a mixture of experts needs one "
                             "of those")

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends to every earlier token: no sliding window, or every
        `global_every`-th layer under one."""
        if self.sliding_window is None:
            return True
        return self.global_every is not None and (layer + 1) % self.global_every == 0

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every earlier token)."""
        return None if self.is_global(layer) else self.sliding_window

    @property
    def mlp_dim(self) -> int:
        return self.mlp_hidden or int(self.d_model * self.mlp_ratio)

    @property
    def value_width(self) -> int:
        """Each head's value width: `model.latent.value_dim` under latent attention, else `head_width`."""
        return (self.latent.value_dim or self.head_width) if self.latent.kv_rank else self.head_width

    @property
    def query_key_width(self) -> int:
        """Each head's query and key width: `head_width`, plus the RoPE part under latent attention."""
        return self.head_width + (self.latent.rope_dim if self.latent.kv_rank else 0)

    @property
    def head_width(self) -> int:
        """Each attention head's width: `model.head_dim`, else d_model / heads."""
        return self.head_dim or self.d_model // self.heads

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def position_rows(self) -> int:
        return self.max_positions or self.seq_len

    @property
    def layer_stack(self) -> int:
        return self.layers

    @property
    def stacked_layers(self) -> bool:
        return self.impl.scan_layers

    @property
    def wants_native_kernels(self) -> bool:
        """The MLP's GELU gradient in cuBLASLt's epilogue (`model.impl.gelu_grad_impl` auto or cublaslt, with GELU)."""
        return self.impl.gelu_grad_impl != "xla" and self.activation == "gelu"

    @property
    def tokens_per_example(self) -> int:
        return self.seq_len

    def param_sizes(self) -> list[ParamSize]:
        # Not the stacked `layers`: that dim exists only with model.impl.scan_layers, and the layout's pipeline
        # check checks model.layers against mesh.stage.
        sizes = [
            ParamSize("embed", "model.d_model", self.d_model, self.d_model, "the embedding dimension of every weight"),
            ParamSize("heads", "model.heads", self.heads, self.heads, "the attention heads of every attention weight"),
            ParamSize("mlp", "model.mlp_hidden", self.mlp_hidden, self.mlp_dim, "the MLP's hidden width")
            if self.mlp_hidden else ParamSize("mlp", "model.mlp_ratio", self.mlp_ratio, self.mlp_dim,
                                              "the MLP's hidden width int(model.d_model x model.mlp_ratio)"),
            ParamSize("head_dim", "model.head_dim", self.head_dim, self.head_width, "each attention head's width")
            if self.head_dim else ParamSize("head_dim", "model.d_model", self.d_model, self.head_width,
                                            "the head dimension model.d_model / model.heads"),
        ]
        if self.vocab != "auto":
            sizes.append(ParamSize("vocab", "model.vocab", self.vocab, self.vocab,
                                   "the vocabulary of the token embedding and the output head"))
        if self.key_value_heads != self.heads:
            sizes.append(ParamSize("kv_heads", "model.kv_heads", self.kv_heads, self.key_value_heads,
                                   "the key and value heads of grouped-query attention"))
        if self.positions == "learned":
            key, value = ("model.max_positions", self.max_positions) if self.max_positions else ("model.seq_len", self.seq_len)
            sizes.append(ParamSize("length", key, value, self.position_rows,
                                   "the positions of the learned position embedding"))
        if self.moe.experts:
            hidden = self.moe.expert_hidden or self.mlp_dim
            sizes += [ParamSize("experts", "model.moe.experts", self.moe.experts, self.moe.experts,
                                "the experts of every MoE layer"),
                      ParamSize("expert_mlp", "model.moe.expert_hidden", self.moe.expert_hidden, hidden,
                                "each expert's hidden width")]
        return sizes

    @property
    def expert_hidden(self) -> int:
        """Each expert's hidden width (`model.moe.expert_hidden`, else the MLP's)."""
        return self.moe.expert_hidden or self.mlp_dim

    def summary(self) -> dict[str, Any]:
        return {"d": self.d_model, "layers": self.layers, "seq": self.seq_len}
