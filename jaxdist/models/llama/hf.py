"""The Llama family's Hugging Face architectures as `model.name=llama`, both ways: `LlamaForCausalLM`,
`MistralForCausalLM` (its sliding window), `Qwen2ForCausalLM` (q/k/v biases), `Qwen3ForCausalLM`
(q and k norms) and the mixtures of experts `MixtralForCausalLM` and `Qwen3MoeForCausalLM`."""

from __future__ import annotations

from typing import Any

from jaxdist.errors import UserError
from jaxdist.models.hf_mapping import (COMMON_OUT, HFAdapter, Reader, Tensor, attention_projections,
                                       embedding_and_norms, expert_tensors, extras_set, same, transposed)

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"

# The keys transformers 5 writes for each architecture that the model section does not decide.
_OUT = {**COMMON_OUT, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
_QWEN_OUT = {**_OUT, "bos_token_id": None, "eos_token_id": None}
_TEMPLATES = {
    LLAMA: {**_OUT, "model_type": "llama", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    MISTRAL: {**_OUT, "model_type": "mistral"},
    QWEN2: {**_QWEN_OUT, "model_type": "qwen2", "max_window_layers": 28, "sliding_window": None,
            "use_sliding_window": False},
    QWEN3: {**_QWEN_OUT, "model_type": "qwen3", "attention_bias": False, "max_window_layers": 28,
            "sliding_window": None, "use_sliding_window": False},
    MIXTRAL: {**_OUT, "model_type": "mixtral", "output_router_logits": False, "router_aux_loss_coef": 0.001,
              "router_jitter_noise": 0.0, "sliding_window": None},
    QWEN3_MOE: {**_QWEN_OUT, "model_type": "qwen3_moe", "attention_bias": False, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False},
}


# -- config.json in ----------------------------------------------------------------------------------

def _model_keys(get: Reader) -> dict[str, Any]:
    config, arch = get.config, get.arch
    d, heads = get.int("hidden_size"), get.int("num_attention_heads")
    head_dim = get.int_or_none("head_dim")
    get.require(config.get("hidden_act", "silu") == "silu", f"hidden_act={config.get('hidden_act')!r} (SwiGLU "
                                                            f"needs silu)")
    get.require(not config.get("mlp_bias") and not config.get("attention_bias"),
                "attention_bias or mlp_bias set (jaxdist's Llama has Qwen2's q/k/v biases only)")
    # Qwen's windows cover only the layers from `max_window_layers` on; jaxdist's, every layer.
    get.require(not config.get("use_sliding_window"), f"use_sliding_window with max_window_layers="
                                                       f"{config.get('max_window_layers')} (jaxdist's sliding window "
                                                       f"covers every layer: Mistral's)")
    keys = {
        "name": "llama", "vocab": get.int("vocab_size"), "d_model": d, "layers": get.int("num_hidden_layers"),
        "heads": heads, "kv_heads": get.int("num_key_value_heads", heads), "mlp_hidden": get.int("intermediate_size"),
        "max_positions": get.int("max_position_embeddings"), "norm": "rmsnorm",
        "norm_eps": get.number("rms_norm_eps", 1e-6), "positions": "rope", "activation": "swiglu",
        "biases": "qkv" if arch == QWEN2 else "none",
        "tied_embeddings": get.flag("tie_word_embeddings", False),
    }
    if head_dim is not None and head_dim * heads != d:
        keys["head_dim"] = head_dim
    if arch in (MISTRAL, MIXTRAL) and get.int_or_none("sliding_window") is not None:
        keys["sliding_window"] = get.int("sliding_window")
    if arch in (QWEN3, QWEN3_MOE):
        keys["qk_norm"] = True
    if arch in (MIXTRAL, QWEN3_MOE):
        keys["moe"] = _moe_keys(get, keys["layers"])
    keys.update(_rope_keys(get))
    return keys


def _moe_keys(get: Reader, layers: int) -> dict[str, Any]:
    """`model.moe` of a Mixtral or Qwen3-MoE config.json: softmax top-k routers, dropless."""
    config = get.config
    routing = {"experts": get.int("num_experts" if "num_experts" in config else "num_local_experts"),
               "experts_per_token": get.int("num_experts_per_tok"), "router": "softmax", "shared_experts": 0,
               "routed_scale": 1.0}
    if get.arch == MIXTRAL:
        get.require(not config.get("router_jitter_noise"), f"router_jitter_noise={config.get('router_jitter_noise')} "
                                                           f"(jaxdist's routers take no noise)")
        return {**routing, "expert_hidden": get.int("intermediate_size"), "renormalize": True, "first_dense": 0,
                "every": 1}
    dense = config.get("mlp_only_layers") or []
    get.require(isinstance(dense, list) and dense == list(range(len(dense))) and len(dense) < layers,
                f"mlp_only_layers={dense} (jaxdist's dense layers are the first k: model.moe.first_dense)")
    return {**routing, "expert_hidden": get.int("moe_intermediate_size"),
            "renormalize": get.flag("norm_topk_prob", False), "first_dense": len(dense),
            "every": get.int("decoder_sparse_step", 1)}


def _rope_keys(get: Reader) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; published folders (and transformers 4) `rope_theta` and
    # `rope_scaling`.
    key = "rope_parameters" if get.config.get("rope_parameters") is not None else "rope_scaling"
    rope = get.within(key)
    base = rope.number("rope_theta", get.number("rope_theta", 10000.0))
    kind = rope.value("rope_type", rope.value("type", "default"))
    if kind == "default":
        return {"rope_base": base}
    get.require(kind == "llama3", f"rope type {kind!r} (jaxdist's Llama has default and llama3)")
    return {"rope_base": base, "rope_scaling": {
        "kind": "llama3", "factor": rope.number("factor"), "low_freq_factor": rope.number("low_freq_factor"),
        "high_freq_factor": rope.number("high_freq_factor"),
        "original_length": rope.int("original_max_position_embeddings")}}


# -- config.json out ---------------------------------------------------------------------------------

def _computes(model) -> bool:
    llama_like = model.positions == "rope" and model.norm == "rmsnorm" and model.activation == "swiglu"
    return llama_like or bool(model.moe.experts) or model.qk_norm


def _architecture(model) -> str:
    llama_like = model.positions == "rope" and model.norm == "rmsnorm" and model.activation == "swiglu"
    plain = model.biases == "none"
    if extras := extras_set(model):
        raise UserError(f"export --format hf: the Llama family has no {', '.join(extras)}; no Hugging Face "
                        f"architecture of it computes this model")
    if model.sliding_window is not None and llama_like and not (plain and not model.qk_norm):
        raise UserError(f"export --format hf: a sliding window (model.sliding_window={model.sliding_window}) is "
                        f"written as Mistral or Mixtral, which have no q/k norms or biases (model.qk_norm="
                        f"{model.qk_norm}, model.biases={model.biases}); no Hugging Face architecture computes it")
    if llama_like and model.moe.experts and plain:
        return _mixture_architecture(model)
    if llama_like and model.qk_norm and plain:
        return QWEN3
    if llama_like and not (model.moe.experts or model.qk_norm) and model.biases != "all":
        if model.sliding_window is not None:
            return MISTRAL
        return QWEN2 if model.biases == "qkv" else LLAMA
    raise UserError(f"export --format hf: the Llama family is rope+rmsnorm+swiglu without MLP biases, and "
                    f"without any biases where q and k are normed (Qwen3) or experts route (Mixtral, Qwen3-MoE): "
                    f"this model has positions={model.positions}, norm={model.norm}, activation={model.activation}, "
                    f"biases={model.biases}, qk_norm={model.qk_norm}, moe.experts={model.moe.experts}; no Hugging "
                    f"Face architecture computes it")


def _mixture_architecture(model) -> str:
    """Mixtral (every layer routed, renormalized) or Qwen3-MoE (q and k normed), where one computes `model`."""
    moe = model.moe
    differs = [f"model.moe.{key}={value}" for key, value, published in (
        ("router", moe.router, "softmax"), ("shared_experts", moe.shared_experts, 0),
        ("routed_scale", moe.routed_scale, 1.0), ("capacity_factor", moe.capacity_factor, None)) if value != published]
    if model.qk_norm:
        arch = QWEN3_MOE
    else:
        arch = MIXTRAL
        differs += [f"model.moe.{key}={value}" for key, value, published in (
            ("renormalize", moe.renormalize, True), ("first_dense", moe.first_dense, 0), ("every", moe.every, 1))
            if value != published]
    if differs:
        raise UserError(f"export --format hf: {arch} routes otherwise than {', '.join(differs)}; no Hugging Face "
                        f"architecture computes this mixture")
    return arch


def _config_out(model, arch: str) -> dict[str, Any]:
    out = {"hidden_size": model.d_model, "num_attention_heads": model.heads, "num_hidden_layers": model.layers,
           "num_key_value_heads": model.key_value_heads, "intermediate_size": model.mlp_dim,
           "rms_norm_eps": model.norm_eps, "max_position_embeddings": model.position_rows,
           "tie_word_embeddings": model.tied_embeddings, "rope_parameters": _rope_out(model)}
    if arch != QWEN2:
        out["head_dim"] = model.head_dim if arch == MIXTRAL else model.head_width  # Mixtral's null: hidden / heads
    if arch in (QWEN2, QWEN3):
        out["layer_types"] = ["full_attention"] * model.layers
    if arch in (MISTRAL, MIXTRAL):
        out["sliding_window"] = model.sliding_window
    if arch in (MIXTRAL, QWEN3_MOE):
        out.update(_moe_out(model, arch))
    return out


def _moe_out(model, arch: str) -> dict[str, Any]:
    moe = model.moe
    out = {"num_local_experts": moe.experts, "num_experts_per_tok": moe.experts_per_token}
    if moe.aux_loss:
        out["router_aux_loss_coef"] = moe.aux_loss
    if arch == MIXTRAL:
        return {**out, "intermediate_size": model.expert_hidden}
    return {**out, "moe_intermediate_size": model.expert_hidden, "norm_topk_prob": moe.renormalize,
            "mlp_only_layers": list(range(moe.first_dense)), "decoder_sparse_step": moe.every}


def _rope_out(model) -> dict[str, Any]:
    scaling = model.rope_scaling
    if scaling.kind == "none":
        return {"rope_theta": model.rope_base, "rope_type": "default"}
    return {"rope_theta": model.rope_base, "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_length}


# -- tensors -----------------------------------------------------------------------------------------

def _tensors(model) -> list[Tensor]:
    layer = "model.layers.{layer}."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    out = [
        *embedding_and_norms(layer),
        *attention_projections(model, attn),
        Tensor(("mlp", "up"), (mlp + "up_proj.weight",), *transposed(), in_block=True, layers="dense"),
        Tensor(("mlp", "gate"), (mlp + "gate_proj.weight",), *transposed(), in_block=True, layers="dense"),
        Tensor(("mlp", "down"), (mlp + "down_proj.weight",), *transposed(), in_block=True, layers="dense"),
    ]
    if model.moe.experts:
        out += _expert_tensors(model, layer)
    if model.qk_norm:
        out += [Tensor(("attn", f"{x}_norm"), (attn + f"{x}_norm.weight",), *same(), in_block=True) for x in "qk"]
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *transposed(), in_block=False))
    return out


def _expert_tensors(model, layer: str) -> list[Tensor]:
    """A mixture's router and experts (Mixtral's w1, w3, w2 are the gate, up and down projections)."""
    if model.qk_norm:  # Qwen3-MoE's names
        return expert_tensors(model, layer + "mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    return expert_tensors(model, layer + "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"})


ADAPTER = HFAdapter(
    architectures=(LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE),
    model_keys=_model_keys, computes=_computes, architecture=_architecture, config_out=_config_out,
    tensors=_tensors, templates=_TEMPLATES,
    describe="the Llama family is rope+rmsnorm+swiglu (Qwen3 with qk_norm, Mixtral and Qwen3-MoE with experts, "
             "no biases)",
    settings=("positions", "norm", "activation", "biases", "qk_norm", "moe.experts"))
