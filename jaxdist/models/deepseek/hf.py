"""DeepSeek-V3's Hugging Face architecture, `DeepseekV3ForCausalLM`, as `model.name=deepseek`, both
ways: latent attention, the first `first_k_dense_replace` layers dense, the rest routed by a
sigmoid router with its score-correction bias (a variable of the model, not a parameter), in
`n_group` groups of which `topk_group` are chosen, and `n_shared_experts` shared experts.

DeepSeek lays each head's RoPE part out in interleaved pairs (`rope_interleave`); jaxdist's RoPE
rotates the part's two halves, so those rows of the projections are read with the pairs' first
members first (an order that gives the same logits) and written back interleaved.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxdist.errors import UserError
from jaxdist.models.hf_mapping import (COMMON_OUT, HFAdapter, Reader, Tensor, embedding_and_norms, expert_tensors,
                                       extras_set, linear, same, transposed)

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

_TEMPLATES = {DEEPSEEK_V3: {**COMMON_OUT, "model_type": "deepseek_v3", "attention_bias": False,
                            "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
                            "output_router_logits": False, "pretraining_tp": 1, "num_nextn_predict_layers": 0,
                            "rope_interleave": True}}


# -- config.json in ----------------------------------------------------------------------------------

def _model_keys(get: Reader) -> dict[str, Any]:
    config = get.config
    d, heads, layers = get.int("hidden_size"), get.int("num_attention_heads"), get.int("num_hidden_layers")
    get.require(config.get("hidden_act", "silu") == "silu", f"hidden_act={config.get('hidden_act')!r} (SwiGLU "
                                                            f"needs silu)")
    get.require(not config.get("attention_bias"), "attention_bias set (jaxdist's latent attention has no biases)")
    get.require(not config.get("num_nextn_predict_layers"),
                f"num_nextn_predict_layers={config.get('num_nextn_predict_layers')} (jaxdist trains no multi-token "
                f"prediction module)")
    rope = get.within("rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling")
    kind = rope.value("rope_type", rope.value("type", "default"))
    get.require(kind == "default", f"rope type {kind!r} (jaxdist's DeepSeek has the default RoPE; YaRN is not yet "
                                   f"computed)")
    get.require(config.get("rope_interleave", True) is True, f"rope_interleave={config.get('rope_interleave')!r} "
                                                             f"(jaxdist reads DeepSeek's interleaved RoPE rows)")
    dense = config.get("first_k_dense_replace", 3)
    get.require(isinstance(dense, int) and not isinstance(dense, bool) and 0 <= dense < layers,
                f"first_k_dense_replace={dense!r} (the dense first layers: 0 or more, leaving some with experts)")
    shared = config.get("n_shared_experts") or 0
    get.require(isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0,
                f"n_shared_experts={shared!r} (a count of experts)")
    return {
        "name": "deepseek", "vocab": get.int("vocab_size"), "d_model": d, "layers": layers, "heads": heads,
        "head_dim": get.int("qk_nope_head_dim"), "mlp_hidden": get.int("intermediate_size"),
        "max_positions": get.int("max_position_embeddings"), "norm_eps": get.number("rms_norm_eps", 1e-6),
        "tied_embeddings": get.flag("tie_word_embeddings", False),
        "rope_base": rope.number("rope_theta", get.number("rope_theta", 10000.0)),
        "latent": {"kv_rank": get.int("kv_lora_rank"), "q_rank": get.int_or_none("q_lora_rank"),
                   "rope_dim": get.int("qk_rope_head_dim"), "value_dim": get.int("v_head_dim")},
        "moe": {"experts": get.int("n_routed_experts"), "experts_per_token": get.int("num_experts_per_tok"),
                "expert_hidden": get.int("moe_intermediate_size"),
                "shared_experts": shared, "first_dense": dense, "every": 1, "router": "sigmoid",
                "renormalize": get.flag("norm_topk_prob", True),
                "routed_scale": get.number("routed_scaling_factor", 1.0),
                "groups": get.int_or_none("n_group") or 1, "top_groups": get.int_or_none("topk_group") or 1},
    }


# -- config.json out ---------------------------------------------------------------------------------

def _computes(model) -> bool:
    return bool(model.latent.kv_rank)


def _architecture(model) -> str:
    moe = model.moe
    differs = [f"model.{key}={value}" for key, value, holds in (
        ("norm", model.norm, model.norm == "rmsnorm"), ("activation", model.activation, model.activation == "swiglu"),
        ("rope_scaling.kind", model.rope_scaling.kind, model.rope_scaling.kind == "none"),
        ("moe.experts", moe.experts, moe.experts > 0), ("moe.router", moe.router, moe.router == "sigmoid"),
        ("moe.every", moe.every, moe.every == 1),
        ("moe.capacity_factor", moe.capacity_factor, moe.capacity_factor is None),
        ("latent.norm_eps", model.latent.norm_eps, model.latent.norm_eps == 1e-6),
        ("attention_scale_dim", model.attention_scale_dim, model.attention_scale_dim in (None, model.query_key_width)),
    ) if not holds]
    differs += extras_set(model, ("attention_scale_dim", "latent.kv_rank"))
    if differs:
        raise UserError(f"export --format hf: DeepSeek-V3 is latent attention with rmsnorm, swiglu and sigmoid-routed "
                        f"experts in every layer after the dense first ones, and without {', '.join(differs)}; no "
                        f"Hugging Face architecture computes this model")
    return DEEPSEEK_V3


def _config_out(model, arch: str) -> dict[str, Any]:
    latent, moe = model.latent, model.moe
    return {"hidden_size": model.d_model, "num_attention_heads": model.heads, "num_key_value_heads": model.heads,
            "num_hidden_layers": model.layers, "intermediate_size": model.mlp_dim, "rms_norm_eps": model.norm_eps,
            "max_position_embeddings": model.position_rows, "tie_word_embeddings": model.tied_embeddings,
            "rope_parameters": {"rope_theta": model.rope_base, "rope_type": "default"},
            "q_lora_rank": latent.q_rank, "kv_lora_rank": latent.kv_rank, "qk_nope_head_dim": model.head_width,
            "qk_rope_head_dim": latent.rope_dim, "v_head_dim": model.value_width, "head_dim": latent.rope_dim,
            "qk_head_dim": model.query_key_width, "n_routed_experts": moe.experts,
            "num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": model.expert_hidden,
            "n_shared_experts": moe.shared_experts, "first_k_dense_replace": moe.first_dense,
            "norm_topk_prob": moe.renormalize, "routed_scaling_factor": moe.routed_scale, "n_group": moe.groups,
            "topk_group": moe.top_groups}


# -- tensors -----------------------------------------------------------------------------------------

def _halves_first(rope_dim: int) -> np.ndarray:
    """The RoPE part's rows, interleaved pairs' first members first: 0, 2, 4, ..., 1, 3, 5, ..."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def _per_head(shape: tuple[int, int, int], rope_from: int | None, rope_dim: int):
    """A torch Linear (heads x per_head, inputs) as jaxdist's (inputs, heads, per_head), each head's
    rows from `rope_from` on (the RoPE part; None: none) reordered halves first; and back."""
    inputs, heads, per_head = shape
    order = _halves_first(rope_dim)

    def read(arrays):
        rows = arrays[0].reshape(heads, per_head, inputs)
        if rope_from is not None:
            rows = np.concatenate([rows[:, :rope_from], rows[:, rope_from:][:, order]], axis=1)
        return rows.transpose(2, 0, 1)

    def write(array):
        rows = array.transpose(1, 2, 0)
        if rope_from is not None:
            rows = np.concatenate([rows[:, :rope_from], rows[:, rope_from:][:, np.argsort(order)]], axis=1)
        return [rows.reshape(heads * per_head, inputs)]

    return read, write


def _latent_down(kv_rank: int, rope_dim: int):
    """kv_a_proj_with_mqa (kv_rank + rope_dim, embed) as jaxdist's (embed, kv_rank + rope_dim), the
    shared RoPE part's rows halves first; and back."""
    order = np.concatenate([np.arange(kv_rank), kv_rank + _halves_first(rope_dim)])
    return (lambda arrays: arrays[0][order].T), (lambda array: [array.T[np.argsort(order)]])


def _tensors(model) -> list[Tensor]:
    latent, d, h = model.latent, model.d_model, model.heads
    plain, rope_dim, value, qk = model.head_width, latent.rope_dim, model.value_width, model.query_key_width
    layer = "model.layers.{layer}."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    out = [
        *embedding_and_norms(layer),
        Tensor(("attn", "kv_down"), (attn + "kv_a_proj_with_mqa.weight",), *_latent_down(latent.kv_rank, rope_dim),
               in_block=True),
        Tensor(("attn", "kv_norm"), (attn + "kv_a_layernorm.weight",), *same(), in_block=True),
        Tensor(("attn", "kv_up"), (attn + "kv_b_proj.weight",), *_per_head((latent.kv_rank, h, plain + value), None,
                                                                          rope_dim), in_block=True),
        Tensor(("attn", "out"), (attn + "o_proj.weight",), *linear((h, value, d), inputs=2), in_block=True),
        *(Tensor(("mlp", name), (f"{mlp}{name}_proj.weight",), *transposed(), in_block=True, layers="dense")
          for name in ("up", "gate", "down")),
        *expert_tensors(model, mlp, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
        Tensor(("moe", "bias"), (mlp + "gate.e_score_correction_bias",), *same(), in_block=True, layers="moe",
               state=True),
    ]
    if latent.q_rank:
        out += [Tensor(("attn", "q_down"), (attn + "q_a_proj.weight",), *transposed(), in_block=True),
                Tensor(("attn", "q_norm"), (attn + "q_a_layernorm.weight",), *same(), in_block=True),
                Tensor(("attn", "q_up"), (attn + "q_b_proj.weight",),
                       *_per_head((latent.q_rank, h, qk), plain, rope_dim), in_block=True)]
    else:
        out.append(Tensor(("attn", "q"), (attn + "q_proj.weight",), *_per_head((d, h, qk), plain, rope_dim),
                          in_block=True))
    if model.moe.shared_experts:
        out += [Tensor(("moe", f"shared_{name}"), (f"{mlp}shared_experts.{name}_proj.weight",), *transposed(),
                       in_block=True, layers="moe") for name in ("up", "gate", "down")]
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *transposed(), in_block=False))
    return out


ADAPTER = HFAdapter(
    architectures=(DEEPSEEK_V3,),
    model_keys=_model_keys, computes=_computes, architecture=_architecture, config_out=_config_out,
    tensors=_tensors, templates=_TEMPLATES,
    describe="DeepSeek-V3 is latent attention (model.latent.kv_rank > 0) with sigmoid-routed experts",
    settings=("latent.kv_rank", "moe.router"))
