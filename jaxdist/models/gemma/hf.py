"""The Gemma family's Hugging Face architectures as `model.name=gemma`, both ways: `Gemma2ForCausalLM`
(soft-capped logits, windowed and global layers in turn) and `Gemma3ForCausalLM` (Gemma 3's text
model: q and k normed, one global layer in `global_every`, the windowed layers' RoPE base apart).

Gemma's norms scale by `1 + w`, as jaxdist's do with `model.norm_plus_one`: their tensors are
the parameters, both ways.
"""

from __future__ import annotations

from typing import Any

from jaxdist.errors import UserError
from jaxdist.models.hf_mapping import (COMMON_OUT, HFAdapter, Reader, Tensor, attention_projections, extras_set,
                                       same, transposed)

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
WINDOWED, GLOBAL = "sliding_attention", "full_attention"

_OUT = {**COMMON_OUT, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh"}
_TEMPLATES = {
    GEMMA2: {**_OUT, "model_type": "gemma2", "use_bidirectional_attention": None},
    GEMMA3: {**_OUT, "model_type": "gemma3_text", "use_bidirectional_attention": False},
}
# The extras of the decoder (hf_mapping.DECODER_EXTRAS) that Gemma's architectures compute.
_EXTRAS = ("norm_plus_one", "post_norms", "embed_scale", "attention_softcap", "logit_softcap", "attention_scale_dim",
           "global_every", "local_rope_base")


# -- config.json in ----------------------------------------------------------------------------------

def _model_keys(get: Reader) -> dict[str, Any]:
    config, arch = get.config, get.arch
    d, heads = get.int("hidden_size"), get.int("num_attention_heads")
    layers = get.int("num_hidden_layers")
    activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
    get.require(activation in ("gelu_pytorch_tanh", "gelu_new"), f"hidden_activation={activation!r} (jaxdist's "
                                                                 f"GeGLU gates through GELU's tanh form)")
    get.require(not config.get("attention_bias"), "attention_bias set (jaxdist's Gemma has no biases)")
    get.require(not config.get("use_bidirectional_attention"), "use_bidirectional_attention set (jaxdist's "
                                                               "attention is causal)")
    head_dim = get.int("head_dim", d // heads)
    keys = {
        "name": "gemma", "vocab": get.int("vocab_size"), "d_model": d, "layers": layers, "heads": heads,
        "kv_heads": get.int("num_key_value_heads", heads), "mlp_hidden": get.int("intermediate_size"),
        "max_positions": get.int("max_position_embeddings"), "norm_eps": get.number("rms_norm_eps", 1e-6),
        "tied_embeddings": get.flag("tie_word_embeddings", True),
    }
    if head_dim * heads != d:
        keys["head_dim"] = head_dim
    scale_dim = get.int("query_pre_attn_scalar", head_dim)
    if scale_dim != head_dim:
        keys["attention_scale_dim"] = scale_dim
    for key, ours in (("attn_logit_softcapping", "attention_softcap"), ("final_logit_softcapping", "logit_softcap")):
        if config.get(key) is not None:
            keys[ours] = get.number(key)
    if arch == GEMMA3:
        keys["qk_norm"] = True
    keys.update(_window_keys(get, layers))
    keys.update(_rope_keys(get, keys.get("global_every") is not None))
    return keys


def _window_keys(get: Reader, layers: int) -> dict[str, Any]:
    """`sliding_window` and `global_every` of the config's `layer_types` (older folders: Gemma 2's
    alternation, Gemma 3's `sliding_window_pattern`)."""
    config = get.config
    kinds = config.get("layer_types")
    if kinds is None:
        every = 2 if get.arch == GEMMA2 else get.int("sliding_window_pattern", 6)
        kinds = [GLOBAL if (layer + 1) % every == 0 else WINDOWED for layer in range(layers)]
    get.require(isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {WINDOWED, GLOBAL},
                f"layer_types={kinds!r} (one of {WINDOWED!r}, {GLOBAL!r} per layer)")
    if WINDOWED not in kinds:
        return {}
    window = get.int("sliding_window")
    if GLOBAL not in kinds:
        return {"sliding_window": window}
    every = kinds.index(GLOBAL) + 1
    get.require(kinds == [GLOBAL if (layer + 1) % every == 0 else WINDOWED for layer in range(layers)],
                f"layer_types={kinds} (jaxdist's global layers are every k-th: model.global_every)")
    return {"sliding_window": window, "global_every": every}


def _rope_keys(get: Reader, apart: bool) -> dict[str, Any]:
    """`rope_base`, `rope_scaling` and, where windowed layers are `apart` and have a base of their
    own, `local_rope_base`. transformers 5 writes `rope_parameters` (Gemma 3's keyed by layer kind);
    published folders `rope_theta`, `rope_local_base_freq` and `rope_scaling`."""
    config = get.config
    params = config.get("rope_parameters")
    if isinstance(params, dict) and GLOBAL in params:
        full, local = get.within("rope_parameters").within(GLOBAL), get.within("rope_parameters").within(WINDOWED)
    else:
        key = "rope_parameters" if params is not None else "rope_scaling"
        full, local = get.within(key), None
    keys: dict[str, Any] = {"rope_base": full.number("rope_theta", get.number("rope_theta", 10000.0))}
    kind = full.value("rope_type", full.value("type", "default"))
    get.require(kind in ("default", "linear"), f"rope type {kind!r} (jaxdist's Gemma has default and linear)")
    if kind == "linear":
        keys["rope_scaling"] = {"kind": "linear", "factor": full.number("factor")}
    if local is not None:
        local_kind = local.value("rope_type", local.value("type", "default"))
        get.require(local_kind == "default", f"rope type {local_kind!r} for {WINDOWED} layers (jaxdist's windowed "
                                             f"layers' RoPE is unscaled)")
        local_base = local.number("rope_theta", get.number("rope_local_base_freq", 10000.0))
    else:
        local_base = get.number("rope_local_base_freq") if "rope_local_base_freq" in config else None
    if local_base is not None and (local_base != keys["rope_base"] or kind != "default"):
        get.require(apart, f"a RoPE of the windowed layers' own (base {local_base}) where no layer is global")
        keys["local_rope_base"] = local_base
    return keys


# -- config.json out ---------------------------------------------------------------------------------

def _computes(model) -> bool:
    return (model.post_norms and model.activation == "geglu" and model.positions == "rope"
            and model.norm == "rmsnorm")


def _architecture(model) -> str:
    differs = [f"model.{key}={value}" for key, value, holds in (
        ("biases", model.biases, model.biases == "none"), ("moe.experts", model.moe.experts, not model.moe.experts),
        ("embed_scale", model.embed_scale, model.embed_scale), ("norm_plus_one", model.norm_plus_one,
                                                                model.norm_plus_one),
        ("rope_scaling.kind", model.rope_scaling.kind, model.rope_scaling.kind in ("none", "linear"))) if not holds]
    differs += extras_set(model, _EXTRAS)
    arch = GEMMA3 if model.qk_norm else GEMMA2
    if arch == GEMMA2 and (model.local_rope_base is not None or model.rope_scaling.kind != "none"):
        differs.append("a RoPE other than one plain base for every layer (Gemma 2's; Gemma 3 has q and k norms, "
                       "model.qk_norm)")
    if differs:
        raise UserError(f"export --format hf: Gemma 2 and 3 are rope+rmsnorm+geglu with post_norms and a scaled "
                        f"embedding, and without {', '.join(differs)}; no Hugging Face architecture computes this "
                        f"model")
    return arch


def _config_out(model, arch: str) -> dict[str, Any]:
    kinds = [GLOBAL if model.is_global(layer) else WINDOWED for layer in range(model.layers)]
    out = {"hidden_size": model.d_model, "num_attention_heads": model.heads, "num_hidden_layers": model.layers,
           "num_key_value_heads": model.key_value_heads, "intermediate_size": model.mlp_dim,
           "head_dim": model.head_width, "rms_norm_eps": model.norm_eps,
           "max_position_embeddings": model.position_rows, "tie_word_embeddings": model.tied_embeddings,
           "query_pre_attn_scalar": model.attention_scale_dim or model.head_width,
           "sliding_window": model.sliding_window, "layer_types": kinds,
           "attn_logit_softcapping": model.attention_softcap, "final_logit_softcapping": model.logit_softcap}
    full = {"rope_theta": model.rope_base, "rope_type": "default"}
    if model.rope_scaling.kind == "linear":
        full = {**full, "rope_type": "linear", "factor": model.rope_scaling.factor}
    if arch == GEMMA2:
        return {**out, "rope_parameters": full}
    local = full if model.local_rope_base is None else {"rope_theta": model.local_rope_base, "rope_type": "default"}
    # Written by transformers from its `sliding_window_pattern`; `layer_types` decides.
    return {**out, "rope_parameters": {GLOBAL: full, WINDOWED: local},
            "_sliding_window_pattern": model.global_every or 6}


# -- tensors -----------------------------------------------------------------------------------------

def _tensors(model) -> list[Tensor]:
    layer = "model.layers.{layer}."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    norms = {"norm1": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "norm2": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
    out = [
        Tensor(("embed",), ("model.embed_tokens.weight",), *same(), in_block=False),
        Tensor(("final_norm", "scale"), ("model.norm.weight",), *same(), in_block=False),
        *(Tensor((ours, "scale"), (f"{layer}{name}.weight",), *same(), in_block=True)
          for ours, name in norms.items()),
        *attention_projections(model, attn),
        *(Tensor(("mlp", name), (f"{mlp}{name}_proj.weight",), *transposed(), in_block=True)
          for name in ("up", "gate", "down")),
    ]
    if model.qk_norm:
        out += [Tensor(("attn", f"{x}_norm"), (attn + f"{x}_norm.weight",), *same(), in_block=True) for x in "qk"]
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *transposed(), in_block=False))
    return out


ADAPTER = HFAdapter(
    architectures=(GEMMA2, GEMMA3),
    model_keys=_model_keys, computes=_computes, architecture=_architecture, config_out=_config_out,
    tensors=_tensors, templates=_TEMPLATES,
    describe="Gemma 2 and 3 are rope+rmsnorm+geglu with post_norms (Gemma 3 with qk_norm)",
    settings=("positions", "norm", "activation", "post_norms", "qk_norm"))
