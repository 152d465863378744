"""GPT-2 (`GPT2LMHeadModel`) as `model.name=gpt`, both ways: jaxdist's own GPT is GPT-2 with its
biases at zero (and an untied head where it has one)."""

from __future__ import annotations

from typing import Any

from jaxdist.errors import UserError
from jaxdist.models.hf_mapping import (COMMON_OUT, HFAdapter, Reader, Tensor, extras_set, reshaped, same,
                                       transposed)

GPT2 = "GPT2LMHeadModel"

# The keys transformers 5 writes for GPT-2 that the model section does not decide.
_TEMPLATE = {**COMMON_OUT, "model_type": "gpt2", "activation_function": "gelu_new", "add_cross_attention": False,
             "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
             "reorder_and_upcast_attn": False, "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": False,
             "scale_attn_weights": True, "summary_activation": None, "summary_first_dropout": 0.1,
             "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True}


def _model_keys(get: Reader) -> dict[str, Any]:
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


def _computes(model) -> bool:
    return (model.positions == "learned" and model.norm == "layernorm" and model.activation == "gelu"
            and not model.moe.experts and not model.qk_norm)


def _architecture(model) -> str:
    differs = [f"model.{key}={value}" for key, value, holds in (
        ("kv_heads", model.kv_heads, model.key_value_heads == model.heads),
        ("biases", model.biases, model.biases != "qkv"),
        ("head_dim", model.head_dim, model.head_width * model.heads == model.d_model),
        ("sliding_window", model.sliding_window, model.sliding_window is None)) if not holds] + extras_set(model)
    if differs:
        raise UserError(f"export --format hf: GPT-2 has no {', '.join(differs)}; no Hugging Face architecture "
                        f"computes this model")
    return GPT2


def _config_out(model, arch: str) -> dict[str, Any]:
    return {"n_embd": model.d_model, "n_head": model.heads, "n_layer": model.layers, "n_positions": model.position_rows,
            "n_inner": None if model.mlp_dim == 4 * model.d_model else model.mlp_dim,
            "layer_norm_epsilon": model.norm_eps, "tie_word_embeddings": model.tied_embeddings}


def _tensors(model) -> list[Tensor]:
    d, h = model.d_model, model.heads
    hd, m = d // h, model.mlp_dim
    layer = "transformer.h.{layer}."

    def qkv_read(arrays):  # Conv1D weights are (in, out): c_attn's out is q, k, v side by side
        return arrays[0].reshape(d, 3, h, hd).transpose(1, 0, 2, 3)

    def qkv_write(array):
        return [array.transpose(1, 0, 2, 3).reshape(d, 3 * d)]

    out = [
        Tensor(("embed",), ("transformer.wte.weight",), *same(), in_block=False),
        Tensor(("positions",), ("transformer.wpe.weight",), *same(), in_block=False),
        Tensor(("final_norm", "scale"), ("transformer.ln_f.weight",), *same(), in_block=False),
        Tensor(("final_norm", "bias"), ("transformer.ln_f.bias",), *same(), in_block=False),
        Tensor(("norm1", "scale"), (layer + "ln_1.weight",), *same(), in_block=True),
        Tensor(("norm1", "bias"), (layer + "ln_1.bias",), *same(), in_block=True),
        Tensor(("norm2", "scale"), (layer + "ln_2.weight",), *same(), in_block=True),
        Tensor(("norm2", "bias"), (layer + "ln_2.bias",), *same(), in_block=True),
        Tensor(("attn", "qkv"), (layer + "attn.c_attn.weight",), qkv_read, qkv_write, in_block=True),
        Tensor(("attn", "out"), (layer + "attn.c_proj.weight",),
               lambda arrays: arrays[0].reshape(h, hd, d), lambda array: [array.reshape(d, d)], in_block=True),
        Tensor(("mlp", "up"), (layer + "mlp.c_fc.weight",), *same(), in_block=True),
        Tensor(("mlp", "down"), (layer + "mlp.c_proj.weight",), *same(), in_block=True),
    ]
    biases = [(("attn", "qkv_bias"), "attn.c_attn.bias", 3 * d, reshaped((3, h, hd))),
              (("attn", "out_bias"), "attn.c_proj.bias", d, same()),
              (("mlp", "up_bias"), "mlp.c_fc.bias", m, same()),
              (("mlp", "down_bias"), "mlp.c_proj.bias", d, same())]
    for path, name, size, (read, write) in biases:
        if model.biases == "all":
            out.append(Tensor(path, (layer + name,), read, write, in_block=True))
        else:  # a model without them: written as zeros, which GPT-2 adds
            out.append(Tensor(None, (layer + name,), read, write, in_block=True, zero_shape=(size,)))
    if not model.tied_embeddings:
        out.append(Tensor(("head",), ("lm_head.weight",), *transposed(), in_block=False))
    return out


ADAPTER = HFAdapter(
    architectures=(GPT2,), model_keys=_model_keys, computes=_computes, architecture=_architecture,
    config_out=_config_out, tensors=_tensors, templates={GPT2: _TEMPLATE},
    describe="GPT-2 is learned+layernorm+gelu", settings=("positions", "norm", "activation", "biases"))
