"""Hugging Face model folders in and out: config.json, safetensors shards (with their index) and
the tokenizer files they ship.

In: `model.init_from: hf:FOLDER` takes the architecture from config.json (`resolve`) and a fresh
run's parameters from the shards (`load_params`). Each parameter is made straight into its sharded
layout: the devices of this process ask for their slices, and only the layers those slices hold are
read, one parameter at a time, so no host ever holds a whole copy of the model.

Out: `jaxdist export RUN_DIR OUT --format hf` (`export`) writes a folder `transformers` loads with
`AutoModelForCausalLM.from_pretrained(OUT)`. Which tensors map to which parameters is models/hf.py's.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.checkpoint import safetensors_file
from jaxdist.config import Config
from jaxdist.config.files import from_dict
from jaxdist.errors import UserError, check_writable
from jaxdist.models import hf as hf_models

PREFIX = "hf:"
# What a folder ships beside the weights that a user of the model needs: the tokenizer and how to sample.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Buffers some published checkpoints hold that are no parameters: RoPE's frequencies, GPT-2's causal masks.
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size


def folder_of(init_from: str) -> Path:
    """The folder `model.init_from` names (`hf:FOLDER`)."""
    return Path(init_from[len(PREFIX):]).expanduser()


def read_config(folder: Path) -> dict:
    """A model folder's config.json; a `UserError` for a folder without one or a file that is no JSON object."""
    where = f"model.init_from=hf:{folder}"
    if not folder.is_dir():
        raise UserError(f"{where}: no such folder")
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{where}: the folder has no config.json (a Hugging Face model folder holds config.json "
                        f"and its safetensors weights)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: config.json holds no JSON object")
    return config


def resolve(cfg: Config) -> Config:
    """`cfg` with the model section that `model.init_from`'s config.json describes; unchanged without one.

    The folder decides the architecture (and `model.name`); `seq_len` and how the model runs
    (`model.impl`) stay the config's. A key set in the config that disagrees with the folder is a
    `UserError`: the weights would not fit it.
    """
    model = cfg.model
    init_from = getattr(model, "init_from", None)
    if init_from is None:
        return cfg
    folder = folder_of(init_from)
    found = hf_models.model_keys(read_config(folder), f"model.init_from={init_from}: config.json")
    Shards(folder)  # an index without its shards stops here, before anything is built
    mine = model.model_dump(mode="json")
    for key in sorted(model.model_fields_set & found.keys()):
        if mine[key] != found[key]:
            raise UserError(f"model.{key}={mine[key]} disagrees with {folder}/config.json, which makes it "
                            f"{found[key]}; leave model.{key} out (the folder decides it)")
    kept = {key: value for key, value in mine.items() if key not in found}
    try:
        merged = from_dict({**cfg.model_dump(mode="json"), "model": {**kept, **found}})
    except UserError as err:
        raise UserError(f"{err} (with the model keys of {folder}/config.json)") from None
    return cfg.model_copy(update={"model": merged.model})


class Shards:
    """A folder's safetensors tensors by name, across its shards (`model.safetensors.index.json`)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._open: dict[str, safetensors_file.File] = {}
        where = f"model.init_from=hf:{folder}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{where}: {index.name} has no readable weight_map ({err})") from None
        elif (folder / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in self._file("model.safetensors").keys()}
        else:
            raise UserError(f"{where}: no model.safetensors or model.safetensors.index.json (jaxdist reads "
                            f"safetensors weights; save the model with safe_serialization)")
        missing = sorted({file for file in weight_map.values() if not (folder / file).is_file()})
        if missing:
            raise UserError(f"{where}: {len(missing)} shard(s) the index names are missing: {', '.join(missing[:3])}")
        self.weight_map: dict[str, str] = weight_map

    def _file(self, name: str) -> safetensors_file.File:
        if name not in self._open:
            try:
                self._open[name] = safetensors_file.File(self.folder / name)
            except safetensors_file.SafetensorsError as err:
                raise UserError(f"model.init_from=hf:{self.folder}: {err}") from None
        return self._open[name]

    def name(self, name: str) -> str:
        """`name` as the folder spells it: some (GPT-2's own) leave out the `transformer.` prefix."""
        if name in self.weight_map:
            return name
        bare = name.removeprefix("transformer.")
        if bare in self.weight_map:
            return bare
        raise UserError(f"model.init_from=hf:{self.folder}: the weights have no tensor {name}")

    def get(self, name: str) -> np.ndarray:
        name = self.name(name)
        file = self._file(self.weight_map[name])
        if name not in file.keys():
            raise UserError(f"model.init_from=hf:{self.folder}: the index puts {name} in {file.path.name}, which "
                            f"does not hold it")
        try:
            return file.get(name)
        except safetensors_file.SafetensorsError as err:
            raise UserError(f"model.init_from=hf:{self.folder}: {err}") from None

    def unused(self, used: set[str]) -> list[str]:
        return sorted(name for name in self.weight_map
                      if name not in used and not name.endswith(_BUFFERS))


def load_params(cfg: Config, abstract_params: Any, shardings: Any) -> Any:
    """The parameters of `model.init_from`'s weights, each made in its sharding (a pure dict like
    `abstract_params`, of `jax.Array`s). A tensor missing, or of a shape that does not fit the model,
    is a `UserError` naming it."""
    model = cfg.model
    shards = Shards(folder_of(model.init_from))
    stacked = model.impl.scan_layers
    params: dict = jax.tree.map(lambda leaf: None, abstract_params)
    used: set[str] = set()
    for tensor in hf_models.tensors(model):
        if tensor.path is None:
            continue
        if not tensor.in_block:
            used.update(shards.name(n) for n in tensor.names)
            leaf = _placed(lambda layer, t=tensor: _read(shards, t, None), _at(abstract_params, tensor.path),
                           _at(shardings, tensor.path), None, tensor)
            _set(params, tensor.path, leaf)
            continue
        for layer in range(model.layers):
            used.update(shards.name(n) for n in hf_models.layer_names(tensor, layer))
        if stacked:
            path = ("blocks", *tensor.path)
            leaf = _placed(lambda layer, t=tensor: _read(shards, t, layer), _at(abstract_params, path),
                           _at(shardings, path), model.layers, tensor)
            _set(params, path, leaf)
        else:
            for layer in range(model.layers):
                path = ("blocks", layer, *tensor.path)
                leaf = _placed(lambda _, t=tensor, i=layer: _read(shards, t, i), _at(abstract_params, path),
                               _at(shardings, path), None, tensor)
                _set(params, path, leaf)
    if len(jax.tree.leaves(params)) != len(jax.tree.leaves(abstract_params)):  # a parameter no tensor maps to
        raise ValueError(f"models/hf.py maps no Hugging Face tensor to some of model.name={model.name}'s parameters")
    extra = shards.unused(used)
    if extra:
        raise UserError(f"model.init_from=hf:{shards.folder}: the weights hold {len(extra)} tensor(s) the model has "
                        f"no place for, e.g. {extra[0]}")
    return params


def _read(shards: Shards, tensor: hf_models.Tensor, layer: int | None) -> np.ndarray:
    names = tensor.names if layer is None else hf_models.layer_names(tensor, layer)
    try:
        return tensor.read([shards.get(name) for name in names])
    except ValueError as err:  # a reshape that does not fit: the folder's shapes are not its config's
        shapes = ", ".join(f"{name} {shards.get(name).shape}" for name in names)
        raise UserError(f"model.init_from=hf:{shards.folder}: {shapes} does not fit the model config.json "
                        f"describes ({err})") from None


def _placed(read_layer, abstract: jax.ShapeDtypeStruct, sharding: NamedSharding, layers: int | None,
            tensor: hf_models.Tensor) -> jax.Array:
    """One parameter made in `sharding` from `read_layer(layer)` (`layers` None: a parameter without
    a layer axis, `read_layer(None)`). The host holds one layer of it at a time: each is placed on
    the devices as it is read and the layers are stacked there, unless the layer axis itself is split
    (over pipeline stages), where each device's slice is cut from the layers it holds."""
    expected = abstract.shape if layers is None else abstract.shape[1:]

    def layer_array(layer: int | None) -> np.ndarray:
        array = read_layer(layer)
        if array.shape != expected:
            raise UserError(f"model.init_from: the tensor(s) {', '.join(tensor.names)} make a parameter of shape "
                            f"{array.shape}, which does not fit the model config.json describes: "
                            f"{'.'.join(map(str, tensor.path))} is {expected} there")
        return array.astype(abstract.dtype)

    if layers is None:
        whole = layer_array(None)
        return jax.make_array_from_callback(abstract.shape, sharding, lambda index: whole[index])
    spec = tuple(sharding.spec) + (None,) * (len(abstract.shape) - len(sharding.spec))
    if spec[0] is None:
        layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))
        placed = []
        for layer in range(layers):
            array = layer_array(layer)
            placed.append(jax.make_array_from_callback(expected, layer_sharding, lambda index, a=array: a[index]))
            del array
        return _stack(len(placed), sharding)(*placed)
    cache: dict[int, np.ndarray] = {}

    def piece(index: tuple[slice, ...]) -> np.ndarray:
        held = range(layers)[index[0]]
        for layer in held:
            if layer not in cache:
                cache[layer] = layer_array(layer)
        return np.stack([cache[layer][index[1:]] for layer in held])

    return jax.make_array_from_callback(abstract.shape, sharding, piece)


@functools.lru_cache(maxsize=None)
def _stack(count: int, sharding: NamedSharding):
    return jax.jit(lambda *layers: jnp.stack(layers), out_shardings=sharding)


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


# -- export ------------------------------------------------------------------------------------------

def hf_tensors(model, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of `params` (numpy, a pure dict of the model's parameters)."""
    out: dict[str, np.ndarray] = {}
    stacked = model.impl.scan_layers
    for tensor in hf_models.tensors(model):
        if not tensor.in_block:
            out.update(zip(tensor.names, tensor.write(np.asarray(_at(params, tensor.path))), strict=True))
            continue
        for layer in range(model.layers):
            names = hf_models.layer_names(tensor, layer)
            if tensor.path is None:
                out.update({name: np.zeros(tensor.zero_shape, _at(params, ("embed",)).dtype) for name in names})
                continue
            array = _at(params, ("blocks", *tensor.path))[layer] if stacked else _at(params, ("blocks", layer, *tensor.path))
            out.update(zip(names, tensor.write(np.asarray(array)), strict=True))
    return {name: np.ascontiguousarray(array) for name, array in out.items()}


def write_folder(out: Path, model, params: dict, source: Path | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Writes `params` of `model` (a decoder's section) as a Hugging Face folder: config.json, the
    safetensors shard(s) (an index where there are several), and `source`'s tokenizer and generation
    files (the folder the run started from). Returns the files written."""
    source_config = read_config(source) if source is not None and (source / "config.json").is_file() else None
    config = hf_models.hf_config(model, source_config)
    tensors = hf_tensors(model, params)
    out.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if groups[-1] and size + tensors[name].nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += tensors[name].nbytes
    written = ["config.json"]
    dtype = str(next(iter(tensors.values())).dtype)
    config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(groups) == 1:
        safetensors_file.write(out / "model.safetensors", groups[0], {"format": "pt"})
        written.append("model.safetensors")
    else:
        weight_map = {}
        for i, group in enumerate(groups, 1):
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            safetensors_file.write(out / file, group, {"format": "pt"})
            weight_map.update({name: file for name in group})
            written.append(file)
        index = {"metadata": {"total_parameters": sum(a.size for a in tensors.values()),
                              "total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append("model.safetensors.index.json")
    for name in SIDE_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(name)
    return written


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[int, list[str]]:
    """`jaxdist export RUN_DIR OUT --format hf`: a run's checkpoint (default: the newest) as a Hugging
    Face folder OUT. Returns (step, files written)."""
    from jaxdist.checkpoint.export import read_params

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"export --format hf: OUT={out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"export --format hf: OUT={out} is not empty; name a new or empty folder")
    check_writable(out.parent if not out.exists() else out, f"export: OUT={out}", directory=True)
    step, params, meta = read_params(run_dir, step)
    cfg = Config.model_validate(meta.get("config", {}))
    hf_models.export_architecture(cfg.model)  # one line before anything is written
    source = folder_of(cfg.model.init_from) if getattr(cfg.model, "init_from", None) else None
    return step, write_folder(out, cfg.model, params, source)
