"""Hugging Face's decoders in jaxdist's terms: a config.json as `model:` keys, and each published
tensor as the jaxdist parameter it becomes, both ways.

Covered: `LlamaForCausalLM`, `MistralForCausalLM` (no sliding window), `Qwen2ForCausalLM`,
`Qwen3ForCausalLM` and the mixtures of experts `MixtralForCausalLM` and `Qwen3MoeForCausalLM` as
`model.name=llama`; `GPT2LMHeadModel` as `model.name=gpt`. Pure functions on dicts and numpy
arrays; reading and writing the files is checkpoint/hf_folder.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist.errors import UserError

MIXTRAL, QWEN3, QWEN3_MOE = "MixtralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", QWEN3, MIXTRAL, QWEN3_MOE)
GPT2 = "GPT2LMHeadModel"
ARCHITECTURES = (*LLAMA_FAMILY, GPT2)


def architecture(hf_config: dict, where: str) -> str:
    """The one architecture a config.json names, if jaxdist covers it; a `UserError` otherwise."""
    named = hf_config.get("architectures") or []
    if not isinstance(named, list) or len(named) != 1 or named[0] not in ARCHITECTURES:
        raise UserError(f"{where}: architectures={named} is not one jaxdist imports; it reads "
                        f"{', '.join(ARCHITECTURES)}")
    return named[0]


def model_keys(hf_config: dict, where: str) -> dict[str, Any]:
    """The `model:` keys (name included) that describe the model of a Hugging Face config.json.

    Every setting that would change the math and that the decoder does not have is refused with one
    line (`UserError`) rather than ignored.
    """
    arch = architecture(hf_config, where)
    get = _Reader(hf_config, where, arch)
    if arch == GPT2:
        return _gpt2_keys(get)
    d, heads = get.int("hidden_size"), get.int("num_attention_heads")
    head_dim = get.int_or_none("head_dim")
    get.require(hf_config.get("hidden_act", "silu") == "silu", f"hidden_act={hf_config.get('hidden_act')!r} (SwiGLU "
                                                               f"needs silu)")
    get.require(not hf_config.get("mlp_bias") and not hf_config.get("attention_bias"),
                "attention_bias or mlp_bias set (jaxdist's Llama has Qwen2's q/k/v biases only)")
    get.require(not hf_config.get("use_sliding_window") and (arch not in ("MistralForCausalLM", MIXTRAL)
                                                             or hf_config.get("sliding_window") is None),
                f"sliding_window={hf_config.get('sliding_window')} (jaxdist attends to the whole sequence)")
    keys = {
        "name": "llama", "vocab": get.int("vocab_size"), "d_model": d, "layers": get.int("num_hidden_layers"),
        "heads": heads, "kv_heads": get.int("num_key_value_heads", heads), "mlp_hidden": get.int("intermediate_size"),
        "max_positions": get.int("max_position_embeddings"), "norm": "rmsnorm",
        "norm_eps": get.number("rms_norm_eps", 1e-6), "positions": "rope", "activation": "swiglu",
        "biases": "qkv" if arch == "Qwen2ForCausalLM" else "none",
        "tied_embeddings": get.flag("tie_word_embeddings", False),
    }
    if head_dim is not None and head_dim * heads != d:
        keys["head_dim"] = head_dim
    if arch in (QWEN3, QWEN3_MOE):
        keys["qk_norm"] = True
    if arch in (MIXTRAL, QWEN3_MOE):
        keys["moe"] = _moe_keys(get, keys["layers"])
    keys.update(_rope_keys(get))
    return keys


def _moe_keys(get: _Reader, layers: int) -> dict[str, Any]:
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


def _gpt2_keys(get: _Reader) -> dict[str, Any]:
    config = get.config
    get.require(config.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                f"activation_function={config.get('activation_function')!r} (jaxdist's GELU is the tanh form, gelu_new)")
    get.require(not config.get("scale_attn_by_inverse_layer_idx") and config.get("scale_attn_weights", True),
                "attention scaled other than by 1/sqrt(head_dim)")
    d = get.int("n_embd")
    return {
        "name": "gpt", "vocab": get.int("vocab_size"), "d_model": d, "layers": get.int("n_layer"),
        "heads": get.int("n_head"), "mlp_hidden": get.int_or_none("n_inner") or 4 * d,
        "max_positions": get.int("n_positions"), "norm": "layernorm",
        "norm_eps": get.number("layer_norm_epsilon", 1e-5), "positions": "learned", "activation": "gelu",
        "biases": "all", "tied_embeddings": get.flag("tie_word_embeddings", True),
    }


def _rope_keys(get: _Reader) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; published folders (and transformers 4) `rope_theta` and
    # `rope_scaling`.
    key = "rope_parameters" if get.config.get("rope_parameters") is not None else "rope_scaling"
    rope = get.within(key)
    base = rope.number("rope_theta", get.number("rope_theta", 10000.0))
    kind = rope.value("rope_type", rope.value("type", "default"))
    if kind == "default":
        return {"rope_base": base}
    get.require(kind == "llama3", f"rope type {kind!r} (jaxdist has default and llama3)")
    return {"rope_base": base, "rope_scaling": {
        "kind": "llama3", "factor": rope.number("factor"), "low_freq_factor": rope.number("low_freq_factor"),
        "high_freq_factor": rope.number("high_freq_factor"),
        "original_length": rope.int("original_max_position_embeddings")}}


class _Reader:
    """Reads a config.json's values, each checked for its type: a missing one or one of the wrong type
    is a `UserError` naming the key (`prefix` + key, for an object inside) and the file (`where`)."""

    def __init__(self, config: dict, where: str, arch: str, prefix: str = ""):
        self.config, self.where, self.arch, self.prefix = config, where, arch, prefix

    def value(self, key: str, default: Any = None) -> Any:
        if key not in self.config and default is None:
            raise UserError(f"{self.where}: has no {self.prefix + key!r}, which a {self.arch} config needs")
        return self.config.get(key, default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.value(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{self.where}: {self.prefix}{key}={value!r} is not a positive integer")
        return value

    def int_or_none(self, key: str) -> int | None:
        """A positive integer where the key is set, None where it is absent or null."""
        return None if self.config.get(key) is None else self.int(key)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.value(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise UserError(f"{self.where}: {self.prefix}{key}={value!r} is not a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.where}: {self.prefix}{key}={value!r} is not true or false")
        return value

    def within(self, key: str) -> _Reader:
        """A reader of the object at `key` (none, or null: an empty one)."""
        value = self.config.get(key) or {}
        if not isinstance(value, dict):
            raise UserError(f"{self.where}: {self.prefix}{key}={value!r} is not an object")
        return _Reader(value, self.where, self.arch, f"{self.prefix}{key}.")

    def require(self, holds: bool, what: str) -> None:
        if not holds:
            raise UserError(f"{self.where}: {what}: jaxdist cannot reproduce this model")


# -- config.json out ---------------------------------------------------------------------------------

# The keys transformers 5 writes for each architecture, with the values that the model section does
# not decide (an imported folder's own values win where the export has them).
_COMMON_OUT = {"dtype": "float32", "pad_token_id": None, "use_cache": True, "initializer_range": 0.02}
_LLAMA_OUT = {**_COMMON_OUT, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
_TEMPLATES = {
    "LlamaForCausalLM": {**_LLAMA_OUT, "model_type": "llama", "attention_bias": False, "mlp_bias": False,
                         "pretraining_tp": 1},
    "Qwen2ForCausalLM": {**_LLAMA_OUT, "model_type": "qwen2", "bos_token_id": None, "eos_token_id": None,
                         "max_window_layers": 28, "sliding_window": None, "use_sliding_window": False},
    QWEN3: {**_LLAMA_OUT, "model_type": "qwen3", "attention_bias": False, "bos_token_id": None, "eos_token_id": None,
            "max_window_layers": 28, "sliding_window": None, "use_sliding_window": False},
    MIXTRAL: {**_LLAMA_OUT, "model_type": "mixtral", "output_router_logits": False, "router_aux_loss_coef": 0.001,
              "router_jitter_noise": 0.0, "sliding_window": None},
    QWEN3_MOE: {**_LLAMA_OUT, "model_type": "qwen3_moe", "attention_bias": False, "bos_token_id": None,
                "eos_token_id": None, "output_router_logits": False, "router_aux_loss_coef": 0.001,
                "sliding_window": None, "use_sliding_window": False},
    GPT2: {**_COMMON_OUT, "model_type": "gpt2", "activation_function": "gelu_new", "add_cross_attention": False,
           "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
           "reorder_and_upcast_attn": False, "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": False,
           "scale_attn_weights": True, "summary_activation": None, "summary_first_dropout": 0.1,
           "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True},
}


def export_architecture(model) -> str:
    """The Hugging Face architecture that computes what `model` (a decoder's section) computes; a
    `UserError` where none does."""
    llama_like = model.positions == "rope" and model.norm == "rmsnorm" and model.activation == "swiglu"
    if model.moe.experts:
        if llama_like and model.biases == "none":
            return _mixture_architecture(model)
    elif model.qk_norm:
        if llama_like and model.biases == "none":
            return QWEN3
    elif model.positions == "learned" and model.norm == "layernorm" and model.activation == "gelu" \
            and model.key_value_heads == model.heads and model.biases != "qkv" \
            and model.head_width * model.heads == model.d_model:
        return GPT2  # jaxdist's own GPT too: GPT-2 with zero biases (and an untied head where it has one)
    elif llama_like and model.biases != "all":
        return "Qwen2ForCausalLM" if model.biases == "qkv" else "LlamaForCausalLM"
    raise UserError(f"export --format hf: no Hugging Face architecture computes this model (positions="
                    f"{model.positions}, norm={model.norm}, activation={model.activation}, biases={model.biases}, "
                    f"qk_norm={model.qk_norm}, moe.experts={model.moe.experts}); GPT-2 is learned+layernorm+gelu, "
                    f"the Llama family rope+rmsnorm+swiglu (Qwen3 with qk_norm, Mixtral and Qwen3-MoE with experts, "
                    f"no biases)")


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


def hf_config(model, source: dict | None = None) -> dict[str, Any]:
    """The config.json `transformers` loads `model` (a decoder's section) from; values of `source` (the
    imported folder's config.json, if any) kept where the section does not decide them (token ids)."""
    arch = export_architecture(model)
    out = {**_TEMPLATES[arch]}
    if source and architecture_or_none(source) == arch:
        out.update({key: source[key] for key in out if key in source and key != "dtype"})
    if arch == GPT2:
        out.update(n_embd=model.d_model, n_head=model.heads, n_layer=model.layers, n_positions=model.position_rows,
                   n_inner=None if model.mlp_dim == 4 * model.d_model else model.mlp_dim,
                   layer_norm_epsilon=model.norm_eps, tie_word_embeddings=model.tied_embeddings)
    else:
        out.update(hidden_size=model.d_model, num_attention_heads=model.heads, num_hidden_layers=model.layers,
                   num_key_value_heads=model.key_value_heads, intermediate_size=model.mlp_dim,
                   rms_norm_eps=model.norm_eps,
                   max_position_embeddings=model.position_rows, tie_word_embeddings=model.tied_embeddings,
                   rope_parameters=_rope_out(model))
        out["head_dim"] = model.head_dim if arch == MIXTRAL else model.head_width  # Mixtral's null: hidden / heads
        if arch == "Qwen2ForCausalLM":
            out.pop("head_dim")
        if arch in ("Qwen2ForCausalLM", QWEN3):
            out["layer_types"] = ["full_attention"] * model.layers
        if arch in (MIXTRAL, QWEN3_MOE):
            out.update(_moe_out(model, arch))
    out.update(architectures=[arch], vocab_size=model.vocab)
    return dict(sorted(out.items()))


def _moe_out(model, arch: str) -> dict[str, Any]:
    moe = model.moe
    out = {"num_local_experts": moe.experts, "num_experts_per_tok": moe.experts_per_token}
    if moe.aux_loss:
        out["router_aux_loss_coef"] = moe.aux_loss
    if arch == MIXTRAL:
        return {**out, "intermediate_size": model.expert_hidden}
    return {**out, "moe_intermediate_size": model.expert_hidden, "norm_topk_prob": moe.renormalize,
            "mlp_only_layers": list(range(moe.first_dense)), "decoder_sparse_step": moe.every}


def architecture_or_none(config: dict) -> str | None:
    named = config.get("architectures") or []
    return named[0] if len(named) == 1 else None


def _rope_out(model) -> dict[str, Any]:
    scaling = model.rope_scaling
    if scaling.kind == "none":
        return {"rope_theta": model.rope_base, "rope_type": "default"}
    return {"rope_theta": model.rope_base, "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_length}


# -- tensors -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One jaxdist parameter and the Hugging Face tensors it is made of.

    `path`: its keys in the params dict, below `blocks` (and the layer, where unstacked) for a block's;
    `names`: the Hugging Face names, `{layer}` standing for the layer's index; `read(arrays)` makes
    the parameter (one layer's, for a block's) from those tensors, `write(array)` the tensors back.
    `path` None: a tensor the Hugging Face model has and jaxdist's lacks (GPT-2's biases, for a
    model without them), written as zeros of `zero_shape`. `layers`: the blocks that have it, all,
    or in a mixture of experts only those with experts (`moe`) or only those without (`dense`).
    """

    path: tuple[str, ...] | None
    names: tuple[str, ...]
    read: Callable[[list[np.ndarray]], np.ndarray]
    write: Callable[[np.ndarray], list[np.ndarray]]
    in_block: bool
    zero_shape: tuple[int, ...] | None = None
    layers: str = "all"


def blocks_with(tensor: Tensor, model) -> list[int]:
    """The layers (from 0) whose blocks have `tensor`."""
    if tensor.layers == "all":
        return list(range(model.layers))
    return [layer for layer in range(model.layers) if model.moe.is_moe(layer) == (tensor.layers == "moe")]


def tensors(model) -> list[Tensor]:
    """Every tensor of `model`'s (a decoder section's) Hugging Face form, in jaxdist's terms."""
    # A mixture or q and k norms: the Llama family's names, whichever of its members routes as it does.
    if not (model.moe.experts or model.qk_norm) and export_architecture(model) == GPT2:
        return _gpt2_tensors(model)
    return _llama_tensors(model)


def _linear(shape: tuple[int, ...], inputs: int = 1) -> tuple[Callable, Callable]:
    """A torch Linear's (out, in) weight as jaxdist's `shape`, whose first `inputs` dims are the input
    ((embed, heads, head_dim) for q; (heads, head_dim, embed) for o_proj), and back."""
    def read(arrays):
        return arrays[0].T.reshape(shape)

    def write(array):
        return [array.reshape(math.prod(shape[:inputs]), -1).T]

    return read, write


def _stacked_linears(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """Linear weights (`_linear`) stacked on a leading axis, one per tensor (q, k, v as qkv)."""
    read_one, write_one = _linear(shape)
    return (lambda arrays: np.stack([read_one([a]) for a in arrays]),
            lambda array: [write_one(part)[0] for part in array])


def _reshaped(shape: tuple[int, ...], count: int = 1) -> tuple[Callable, Callable]:
    def read(arrays):
        return np.stack([a.reshape(shape) for a in arrays]) if count > 1 else arrays[0].reshape(shape)

    def write(array):
        return [part.reshape(-1) for part in array] if count > 1 else [array.reshape(-1)]

    return read, write


def _same() -> tuple[Callable, Callable]:
    return (lambda arrays: arrays[0]), (lambda array: [array])


def _transposed() -> tuple[Callable, Callable]:
    return (lambda arrays: arrays[0].T), (lambda array: [array.T])


def _llama_tensors(model) -> list[Tensor]:
    d, h, kv, hd = model.d_model, model.heads, model.key_value_heads, model.head_width
    layer = "model.layers.{layer}."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    out = [
        Tensor(("embed",), ("model.embed_tokens.weight",), *_same(), in_block=False),
        Tensor(("final_norm", "scale"), ("model.norm.weight",), *_same(), in_block=False),
        Tensor(("norm1", "scale"), (layer + "input_layernorm.weight",), *_same(), in_block=True),
        Tensor(("norm2", "scale"), (layer + "post_attention_layernorm.weight",), *_same(), in_block=True),
        Tensor(("attn", "out"), (attn + "o_proj.weight",), *_linear((h, hd, d), inputs=2), in_block=True),
        Tensor(("mlp", "up"), (mlp + "up_proj.weight",), *_transposed(), in_block=True, layers="dense"),
        Tensor(("mlp", "gate"), (mlp + "gate_proj.weight",), *_transposed(), in_block=True, layers="dense"),
        Tensor(("mlp", "down"), (mlp + "down_proj.weight",), *_transposed(), in_block=True, layers="dense"),
    ]
    if model.moe.experts:
        out += _expert_tensors(model, layer)
    if model.qk_norm:
        out += [Tensor(("attn", f"{x}_norm"), (attn + f"{x}_norm.weight",), *_same(), in_block=True) for x in "qk"]
    qkv_names = tuple(attn + f"{x}_proj.weight" for x in "qkv")
    bias_names = tuple(attn + f"{x}_proj.bias" for x in "qkv")
    if kv == h:
        out.append(Tensor(("attn", "qkv"), qkv_names, *_stacked_linears((d, h, hd)), in_block=True))
        if model.biases == "qkv":
            out.append(Tensor(("attn", "qkv_bias"), bias_names, *_reshaped((h, hd), 3), in_block=True))
    else:
        out.append(Tensor(("attn", "q"), qkv_names[:1], *_linear((d, h, hd)), in_block=True))
        out.append(Tensor(("attn", "kv"), qkv_names[1:], *_stacked_linears((d, kv, hd)), in_block=True))
        if model.biases == "qkv":
            out.append(Tensor(("attn", "q_bias"), bias_names[:1], *_reshaped((h, hd)), in_block=True))
            out.append(Tensor(("attn", "kv_bias"), bias_names[1:], *_reshaped((kv, hd), 2), in_block=True))
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *_transposed(), in_block=False))
    return out


def _expert_tensors(model, layer: str) -> list[Tensor]:
    """A mixture's router and experts: each expert's three Linear weights, stacked on jaxdist's
    leading experts axis (Mixtral's w1, w3, w2 are the gate, up and down projections)."""
    if model.qk_norm:  # Qwen3-MoE's names
        block, projections = layer + "mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    else:  # Mixtral's
        block, projections = layer + "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}

    def stacked(name: str) -> tuple[str, ...]:
        return tuple(f"{block}experts.{e}.{projections[name]}.weight" for e in range(model.moe.experts))

    d, hidden = model.d_model, model.expert_hidden
    shapes = {"gate": (d, hidden), "up": (d, hidden), "down": (hidden, d)}
    return [Tensor(("moe", "router"), (block + "gate.weight",), *_transposed(), in_block=True, layers="moe"),
            *(Tensor(("moe", name), stacked(name), *_stacked_linears(shape), in_block=True, layers="moe")
              for name, shape in shapes.items())]


def _gpt2_tensors(model) -> list[Tensor]:
    d, h = model.d_model, model.heads
    hd, m = d // h, model.mlp_dim
    layer = "transformer.h.{layer}."
    biased = model.biases == "all"

    def qkv_read(arrays):  # Conv1D weights are (in, out): c_attn's out is q, k, v side by side
        return arrays[0].reshape(d, 3, h, hd).transpose(1, 0, 2, 3)

    def qkv_write(array):
        return [array.transpose(1, 0, 2, 3).reshape(d, 3 * d)]

    out = [
        Tensor(("embed",), ("transformer.wte.weight",), *_same(), in_block=False),
        Tensor(("positions",), ("transformer.wpe.weight",), *_same(), in_block=False),
        Tensor(("final_norm", "scale"), ("transformer.ln_f.weight",), *_same(), in_block=False),
        Tensor(("final_norm", "bias"), ("transformer.ln_f.bias",), *_same(), in_block=False),
        Tensor(("norm1", "scale"), (layer + "ln_1.weight",), *_same(), in_block=True),
        Tensor(("norm1", "bias"), (layer + "ln_1.bias",), *_same(), in_block=True),
        Tensor(("norm2", "scale"), (layer + "ln_2.weight",), *_same(), in_block=True),
        Tensor(("norm2", "bias"), (layer + "ln_2.bias",), *_same(), in_block=True),
        Tensor(("attn", "qkv"), (layer + "attn.c_attn.weight",), qkv_read, qkv_write, in_block=True),
        Tensor(("attn", "out"), (layer + "attn.c_proj.weight",),
               lambda arrays: arrays[0].reshape(h, hd, d), lambda array: [array.reshape(d, d)], in_block=True),
        Tensor(("mlp", "up"), (layer + "mlp.c_fc.weight",), *_same(), in_block=True),
        Tensor(("mlp", "down"), (layer + "mlp.c_proj.weight",), *_same(), in_block=True),
    ]
    biases = [(("attn", "qkv_bias"), "attn.c_attn.bias", 3 * d, _reshaped((3, h, hd))),
              (("attn", "out_bias"), "attn.c_proj.bias", d, _same()),
              (("mlp", "up_bias"), "mlp.c_fc.bias", m, _same()),
              (("mlp", "down_bias"), "mlp.c_proj.bias", d, _same())]
    for path, name, size, (read, write) in biases:
        if biased:
            out.append(Tensor(path, (layer + name,), read, write, in_block=True))
        else:
            out.append(Tensor(None, (layer + name,), read, write, in_block=True, zero_shape=(size,)))
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *_transposed(), in_block=False))
    return out


def layer_names(tensor: Tensor, layer: int) -> list[str]:
    """The Hugging Face names of `tensor` in block `layer` (its names as they are outside a block)."""
    return [name.format(layer=layer) for name in tensor.names]

