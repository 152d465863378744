"""Hugging Face's models in jaxdist's terms: how a family's adapter says which architectures it reads
and writes, maps a config.json to `model:` keys and back, and each published tensor to the
parameter it becomes, both ways; and the lookups that find a folder's or a model's adapter.

Each family owns its adapter, in its own files (`ModelEntry.hf`, e.g. models/llama/hf.py); this
module names none of them. Pure functions on dicts and numpy arrays; reading and writing the files
is checkpoint/hf_folder.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist.errors import UserError
from jaxdist.models.registry import MODELS

# The keys transformers 5 writes for every architecture, with values the model section does not decide.
COMMON_OUT = {"dtype": "float32", "pad_token_id": None, "use_cache": True, "initializer_range": 0.02}

# Settings of the decoder that change its math and that only some architectures compute, each with
# the value that leaves it out.
DECODER_EXTRAS = {"norm_plus_one": False, "post_norms": False, "embed_scale": False, "attention_softcap": None,
                  "logit_softcap": None, "attention_scale_dim": None, "global_every": None, "local_rope_base": None,
                  "latent.kv_rank": 0}


def extras_set(model, allowed: tuple[str, ...] = ()) -> list[str]:
    """`model.KEY=VALUE` for each of `DECODER_EXTRAS` that `model` sets and `allowed` does not name."""
    return [f"model.{key}={_setting(model, key)}" for key, off in DECODER_EXTRAS.items()
            if key not in allowed and _setting(model, key) != off]


@dataclass(frozen=True)
class HFAdapter:
    """How a family's models are Hugging Face models, both ways.

    In: `model_keys(reader)` makes the `model:` keys (name included) of a config.json naming one of
    `architectures` (its values read through `reader`, a `Reader`), refusing with one line
    (`reader.require`) every setting that would change the math and that the family lacks.
    Out: `computes(section)` says whether the family's tensor layout fits a model section;
    `architecture(section)` names the one architecture that computes it, or raises a `UserError`
    saying why none of the family's does; `config_out(section, arch)` the config.json keys the
    section decides (added to `templates[arch]`, the keys transformers writes beside them).
    Both ways: `tensors(section)` every tensor of the model's Hugging Face form.
    `describe` says in a phrase what the family's architectures compute, and `settings` which of a
    section's fields decide it, for the line that refuses a model no adapter computes.
    """

    architectures: tuple[str, ...]
    model_keys: Callable[[Reader], dict[str, Any]]
    computes: Callable[[Any], bool]
    architecture: Callable[[Any], str]
    config_out: Callable[[Any, str], dict[str, Any]]
    tensors: Callable[[Any], list[Tensor]]
    templates: dict[str, dict[str, Any]]
    describe: str
    settings: tuple[str, ...]


def adapters() -> list[HFAdapter]:
    """The registered models' adapters, in registration order."""
    found: list[HFAdapter] = []
    for entry in MODELS.values():
        if entry.hf is not None and entry.hf not in found:
            found.append(entry.hf)
    return found


def architecture(hf_config: dict, where: str) -> tuple[HFAdapter, str]:
    """The one architecture a config.json names and the adapter that reads it; a `UserError` where
    no registered family reads it."""
    named = hf_config.get("architectures") or []
    covered = {arch: adapter for adapter in adapters() for arch in adapter.architectures}
    if not isinstance(named, list) or len(named) != 1 or not isinstance(named[0], str) or named[0] not in covered:
        raise UserError(f"{where}: architectures={named} is not one jaxdist imports; it reads {', '.join(covered)}")
    return covered[named[0]], named[0]


def architecture_or_none(config: dict) -> str | None:
    """The one architecture a config.json names, unchecked; None where it names none or several."""
    named = config.get("architectures") or []
    return named[0] if isinstance(named, list) and len(named) == 1 else None


def model_keys(hf_config: dict, where: str) -> dict[str, Any]:
    """The `model:` keys (name included) that describe the model of a Hugging Face config.json.

    Every setting that would change the math and that the model does not have is refused with one
    line (`UserError`) rather than ignored.
    """
    adapter, arch = architecture(hf_config, where)
    return adapter.model_keys(Reader(hf_config, where, arch))


def adapter_of(model) -> HFAdapter:
    """The adapter whose tensor layout fits `model` (a model section); a `UserError` where none does.
    Asked: the adapters of the families whose sections are `model`'s, or build on it."""
    related = [adapter for adapter in adapters() if any(
        entry.hf is adapter and (isinstance(model, entry.section) or issubclass(entry.section, type(model)))
        for entry in MODELS.values())]
    if not related:
        raise UserError(f"export --format hf: model.name={model.name} has no Hugging Face form; export its "
                        f"parameters as one file (--format file)")
    for adapter in related:
        if adapter.computes(model):
            return adapter
    settings = dict.fromkeys(name for adapter in related for name in adapter.settings)
    values = ", ".join(f"{name}={_setting(model, name)}" for name in settings)
    raise UserError(f"export --format hf: no Hugging Face architecture computes this model ({values}); "
                    f"{'; '.join(adapter.describe for adapter in related)}")


def _setting(model, name: str) -> Any:
    value = model
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def export_architecture(model) -> str:
    """The Hugging Face architecture that computes what `model` (a model section) computes; a
    `UserError` where none does."""
    return adapter_of(model).architecture(model)


def hf_config(model, source: dict | None = None) -> dict[str, Any]:
    """The config.json `transformers` loads `model` (a model section) from; values of `source` (the
    imported folder's config.json, if any) kept where the section does not decide them (token ids)."""
    adapter = adapter_of(model)
    arch = adapter.architecture(model)
    out = {**adapter.templates[arch]}
    if source and architecture_or_none(source) == arch:
        out.update({key: source[key] for key in out if key in source and key != "dtype"})
    out.update(adapter.config_out(model, arch))
    out.update(architectures=[arch], vocab_size=model.vocab)
    return dict(sorted(out.items()))


def tensors(model) -> list[Tensor]:
    """Every tensor of `model`'s (a model section's) Hugging Face form, in jaxdist's terms."""
    return adapter_of(model).tensors(model)


class Reader:
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

    def within(self, key: str) -> Reader:
        """A reader of the object at `key` (none, or null: an empty one)."""
        value = self.config.get(key) or {}
        if not isinstance(value, dict):
            raise UserError(f"{self.where}: {self.prefix}{key}={value!r} is not an object")
        return Reader(value, self.where, self.arch, f"{self.prefix}{key}.")

    def require(self, holds: bool, what: str) -> None:
        if not holds:
            raise UserError(f"{self.where}: {what}: jaxdist cannot reproduce this model")


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
    `state`: a variable of the model other than its parameters (a sigmoid router's bias), which
    the optimizer does not train.
    """

    path: tuple[str, ...] | None
    names: tuple[str, ...]
    read: Callable[[list[np.ndarray]], np.ndarray]
    write: Callable[[np.ndarray], list[np.ndarray]]
    in_block: bool
    zero_shape: tuple[int, ...] | None = None
    layers: str = "all"
    state: bool = False


def blocks_with(tensor: Tensor, model) -> list[int]:
    """The layers (from 0) whose blocks have `tensor`."""
    if tensor.layers == "all":
        return list(range(model.layers))
    return [layer for layer in range(model.layers) if model.moe.is_moe(layer) == (tensor.layers == "moe")]


def linear(shape: tuple[int, ...], inputs: int = 1) -> tuple[Callable, Callable]:
    """A torch Linear's (out, in) weight as jaxdist's `shape`, whose first `inputs` dims are the input
    ((embed, heads, head_dim) for q; (heads, head_dim, embed) for o_proj), and back."""
    def read(arrays):
        return arrays[0].T.reshape(shape)

    def write(array):
        return [array.reshape(math.prod(shape[:inputs]), -1).T]

    return read, write


def stacked_linears(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """Linear weights (`linear`) stacked on a leading axis, one per tensor (q, k, v as qkv)."""
    read_one, write_one = linear(shape)
    return (lambda arrays: np.stack([read_one([a]) for a in arrays]),
            lambda array: [write_one(part)[0] for part in array])


def reshaped(shape: tuple[int, ...], count: int = 1) -> tuple[Callable, Callable]:
    def read(arrays):
        return np.stack([a.reshape(shape) for a in arrays]) if count > 1 else arrays[0].reshape(shape)

    def write(array):
        return [part.reshape(-1) for part in array] if count > 1 else [array.reshape(-1)]

    return read, write


def same() -> tuple[Callable, Callable]:
    return (lambda arrays: arrays[0]), (lambda array: [array])


def transposed() -> tuple[Callable, Callable]:
    return (lambda arrays: arrays[0].T), (lambda array: [array.T])


def embedding_and_norms(layer: str) -> list[Tensor]:
    """The token embedding, the final norm's scale and each block's two norms' (`{layer}input_layernorm`,
    `{layer}post_attention_layernorm`) as Llama-style decoders in transformers name them."""
    return [Tensor(("embed",), ("model.embed_tokens.weight",), *same(), in_block=False),
            Tensor(("final_norm", "scale"), ("model.norm.weight",), *same(), in_block=False),
            Tensor(("norm1", "scale"), (layer + "input_layernorm.weight",), *same(), in_block=True),
            Tensor(("norm2", "scale"), (layer + "post_attention_layernorm.weight",), *same(), in_block=True)]


def attention_projections(model, attn: str) -> list[Tensor]:
    """The q, k, v and o projections (with Qwen2's q/k/v biases, where `model.biases=qkv`) named as
    most of transformers' decoders name them: `{attn}q_proj.weight`, ..., `{attn}o_proj.weight`."""
    d, h, kv, hd = model.d_model, model.heads, model.key_value_heads, model.head_width
    out = [Tensor(("attn", "out"), (attn + "o_proj.weight",), *linear((h, hd, d), inputs=2), in_block=True)]
    qkv_names = tuple(attn + f"{x}_proj.weight" for x in "qkv")
    bias_names = tuple(attn + f"{x}_proj.bias" for x in "qkv")
    if kv == h:
        out.append(Tensor(("attn", "qkv"), qkv_names, *stacked_linears((d, h, hd)), in_block=True))
        if model.biases == "qkv":
            out.append(Tensor(("attn", "qkv_bias"), bias_names, *reshaped((h, hd), 3), in_block=True))
        return out
    out.append(Tensor(("attn", "q"), qkv_names[:1], *linear((d, h, hd)), in_block=True))
    out.append(Tensor(("attn", "kv"), qkv_names[1:], *stacked_linears((d, kv, hd)), in_block=True))
    if model.biases == "qkv":
        out.append(Tensor(("attn", "q_bias"), bias_names[:1], *reshaped((h, hd)), in_block=True))
        out.append(Tensor(("attn", "kv_bias"), bias_names[1:], *reshaped((kv, hd), 2), in_block=True))
    return out


def expert_tensors(model, block: str, projections: dict[str, str]) -> list[Tensor]:
    """A mixture's router (`{block}gate.weight`) and experts: each expert's three Linear weights
    (`{block}experts.{e}.{projections[name]}.weight`, name one of gate, up, down), stacked on
    jaxdist's leading experts axis."""
    def stacked(name: str) -> tuple[str, ...]:
        return tuple(f"{block}experts.{e}.{projections[name]}.weight" for e in range(model.moe.experts))

    d, hidden = model.d_model, model.expert_hidden
    shapes = {"gate": (d, hidden), "up": (d, hidden), "down": (hidden, d)}
    return [Tensor(("moe", "router"), (block + "gate.weight",), *transposed(), in_block=True, layers="moe"),
            *(Tensor(("moe", name), stacked(name), *stacked_linears(shape), in_block=True, layers="moe")
              for name, shape in shapes.items())]


def folder_names(tensor: Tensor, model) -> list[str]:
    """Every Hugging Face name of `tensor` in a folder of `model`: in each block that has it, or once."""
    if not tensor.in_block:
        return list(tensor.names)
    return [name for layer in blocks_with(tensor, model) for name in layer_names(tensor, layer)]


def layer_names(tensor: Tensor, layer: int) -> list[str]:
    """The Hugging Face names of `tensor` in block `layer` (its names as they are outside a block)."""
    return [name.format(layer=layer) for name in tensor.names]

