"""Hugging Face model folders in and out: config.json, safetensors shards (with their index) and
the tokenizer files they ship.

In: `model.init_from: hf:FOLDER` takes the architecture from config.json (`resolve`) and a fresh
run's parameters from the shards (`load_params`). Each parameter is made straight into its sharded
layout: the devices of this process ask for their slices, and only the layers those slices hold are
read, one parameter at a time, so no host ever holds a whole copy of the model.

Out: `jaxdist export RUN_DIR OUT --format hf` (`export`) writes a folder `transformers` loads with
`AutoModelForCausalLM.from_pretrained(OUT)`. Which tensors map to which parameters is the model
family's Hugging Face adapter's (models/hf_mapping.py finds it).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import atomic
from jaxdist.checkpoint import safetensors_file
from jaxdist.config import Config
from jaxdist.config.base import HF_PREFIX
from jaxdist.config.files import from_dict
from jaxdist.data import sources
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.errors import UserError, check_local, check_writable, warn
from jaxdist.models import hf_mapping

# What a folder ships beside the weights that a user of the model needs: the tokenizer and how to sample.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Buffers some published checkpoints hold that are no parameters: RoPE's frequencies, GPT-2's causal masks.
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size
# A model's name on the Hugging Face Hub: a name, or its owner's and its own (meta-llama/Llama-3.2-1B).
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def folder_of(init_from: str) -> Path:
    """The folder `model.init_from` names (`hf:FOLDER`); a `UserError` where it names object storage."""
    name = init_from.removeprefix(HF_PREFIX)
    check_local(name, f"model.init_from={init_from}")
    return Path(name).expanduser()


def read_config(folder: Path) -> dict:
    """A model folder's config.json; a `UserError` for a missing folder (saying how to fetch one that
    names a model on the Hub), a folder without config.json or a file that is no JSON object."""
    where = f"model.init_from=hf:{folder}"
    if not folder.is_dir():
        raise UserError(f"{where}: no such folder{_how_to_fetch(folder)}")
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


def _how_to_fetch(folder: Path) -> str:
    """Where a missing folder's name reads as a model's on the Hugging Face Hub (`gpt2`,
    `meta-llama/Llama-3.2-1B`), how to fetch it into a folder first: jaxdist downloads nothing."""
    name = str(folder)
    if not _HUB_NAME.fullmatch(name) or name.startswith("."):
        return ""
    local = f"models/{folder.name}"
    return (f"; jaxdist reads local folders and downloads nothing: if {name} is a model on the Hugging Face Hub, "
            f"fetch it first with `hf download {name} --local-dir {local}` (pip install huggingface_hub), then set "
            f"model.init_from=hf:{local}")


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
    found = hf_mapping.model_keys(read_config(folder), f"model.init_from={init_from}: config.json")
    Shards(folder)  # an index without its shards stops here, before anything is built
    mine = model.model_dump(mode="json")
    for key in sorted(model.model_fields_set & found.keys()):
        if isinstance(found[key], dict):  # a section (model.moe): the keys the folder sets, the rest the config's
            for inner in sorted(getattr(model, key).model_fields_set & found[key].keys()):
                _agrees(f"{key}.{inner}", mine[key][inner], found[key][inner], folder)
        else:
            _agrees(key, mine[key], found[key], folder)
    # What the config set itself, not its section's defaults: the folder's family has defaults of its own.
    kept = {key: value for key, value in model.model_dump(mode="json", exclude_unset=True).items() if key not in found}
    sections = {key: {**mine[key], **value} for key, value in found.items() if isinstance(value, dict)}
    try:
        merged = from_dict({**cfg.model_dump(mode="json"), "model": {**kept, **found, **sections}})
    except UserError as err:
        raise UserError(f"{err} (with the model keys of {folder}/config.json)") from None
    return cfg.model_copy(update={"model": merged.model})


def _agrees(key: str, mine, found, folder: Path) -> None:
    if mine != found:
        raise UserError(f"model.{key}={mine} disagrees with {folder}/config.json, which makes it {found}; leave "
                        f"model.{key} out (the folder decides it)")


class Shards:
    """A folder's safetensors tensors by name, across its shards (`model.safetensors.index.json`).

    Every shard's header is read and checked when the folder is opened, and the index may name only
    files inside the folder: a crafted folder is one line before anything is built from it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._open: dict[str, safetensors_file.File] = {}
        where = f"model.init_from=hf:{folder}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _weight_map(index, where)
        elif (folder / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in self._file("model.safetensors").keys()}
        else:
            raise UserError(f"{where}: no model.safetensors or model.safetensors.index.json (jaxdist reads "
                            f"safetensors weights; save the model with safe_serialization)")
        missing = sorted({file for file in weight_map.values() if not (folder / file).is_file()})
        if missing:
            raise UserError(f"{where}: {len(missing)} shard(s) the index names are missing: {', '.join(missing[:3])}")
        for file in sorted(set(weight_map.values())):
            self._file(file)
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


def _weight_map(index: Path, where: str) -> dict[str, str]:
    """An index's tensor -> file map; a `UserError` for one that is not an object of names, or that
    names a file outside the folder (an absolute path, or one that climbs out with `..`)."""
    try:
        read = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: {index.name} is not valid JSON ({err})") from None
    weight_map = read.get("weight_map") if isinstance(read, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(x, str) for item in weight_map.items() for x in item):
        raise UserError(f"{where}: {index.name}: its weight_map is not an object of tensor names to file names")
    outside = sorted(file for file in set(weight_map.values())
                     if not file or PurePosixPath(file).is_absolute() or ".." in PurePosixPath(file).parts)
    if outside:
        raise UserError(f"{where}: {index.name} names {outside[0]}, which is not a file name inside the folder")
    return weight_map


def load_params(cfg: Config, abstract_params: Any, shardings: Any) -> Any:
    """The parameters of `model.init_from`'s weights, each made in its sharding (a pure dict like
    `abstract_params`, of `jax.Array`s). A tensor missing, or of a shape that does not fit the model,
    is a `UserError` naming it."""
    return _load(cfg, abstract_params, shardings, state=False)


def load_state(cfg: Config, abstract_state: Any, shardings: Any) -> Any:
    """As `load_params`, the model's other variables that the weights hold (DeepSeek-V3's router
    biases; `Tensor.state`)."""
    return _load(cfg, abstract_state, shardings, state=True)


def _load(cfg: Config, abstract_params: Any, shardings: Any, state: bool) -> Any:
    model = cfg.model
    shards = Shards(folder_of(model.init_from))
    stacked = model.impl.scan_layers
    params: dict = jax.tree.map(lambda leaf: None, abstract_params)
    used: set[str] = set()
    for tensor in hf_mapping.tensors(model):
        if tensor.path is None:
            continue
        used.update(shards.name(name) for name in hf_mapping.folder_names(tensor, model))
        if tensor.state != state:  # the other tree's
            continue
        if not tensor.in_block:
            leaf = _placed(lambda layer, t=tensor: _read(shards, t, None), leaf_at(abstract_params, tensor.path),
                           leaf_at(shardings, tensor.path), None, tensor)
            _set(params, tensor.path, leaf)
            continue
        layers = hf_mapping.blocks_with(tensor, model)
        if not layers:
            continue
        if stacked:  # every layer has it: model.impl.scan_layers stacks only blocks of one kind
            path = ("blocks", *tensor.path)
            leaf = _placed(lambda layer, t=tensor: _read(shards, t, layer), leaf_at(abstract_params, path),
                           leaf_at(shardings, path), model.layers, tensor)
            _set(params, path, leaf)
        else:
            for layer in layers:
                path = ("blocks", layer, *tensor.path)
                leaf = _placed(lambda _, t=tensor, i=layer: _read(shards, t, i), leaf_at(abstract_params, path),
                               leaf_at(shardings, path), None, tensor)
                _set(params, path, leaf)
    if len(jax.tree.leaves(params)) != len(jax.tree.leaves(abstract_params)):  # a variable no tensor maps to
        raise ValueError(f"model.name={model.name}'s Hugging Face adapter maps no tensor to some of its "
                         f"{'variables' if state else 'parameters'}")
    extra = shards.unused(used)
    if extra:
        raise UserError(f"model.init_from=hf:{shards.folder}: the weights hold {len(extra)} tensor(s) the model has "
                        f"no place for, e.g. {extra[0]}")
    return params


def _read(shards: Shards, tensor: hf_mapping.Tensor, layer: int | None) -> np.ndarray:
    names = tensor.names if layer is None else hf_mapping.layer_names(tensor, layer)
    try:
        return tensor.read([shards.get(name) for name in names])
    except ValueError as err:  # a reshape that does not fit: the folder's shapes are not its config's
        shapes = ", ".join(f"{name} {shards.get(name).shape}" for name in names)
        raise UserError(f"model.init_from=hf:{shards.folder}: {shapes} does not fit the model config.json "
                        f"describes ({err})") from None


def _placed(read_layer, abstract: jax.ShapeDtypeStruct, sharding: NamedSharding, layers: int | None,
            tensor: hf_mapping.Tensor) -> jax.Array:
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


def leaf_at(tree: Any, path: tuple) -> Any:
    """The leaf of a params dict at `path` (its keys, e.g. ("blocks", "attn", "qkv"))."""
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


# -- export ------------------------------------------------------------------------------------------

def hf_tensors(model, leaf: Callable[[tuple], np.ndarray],
               state_leaf: Callable[[tuple], np.ndarray] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors of a model's parameters, name by name: `leaf(path)` gives the
    parameter at `path` of the params dict (numpy); it is asked for each parameter once, in turn.
    `state_leaf(path)` the same of the model's other variables, for those the weights hold."""
    stacked = model.impl.scan_layers
    dtype = None
    for tensor in hf_mapping.tensors(model):
        if tensor.state:
            if state_leaf is None:
                raise ValueError(f"{tensor.names[0]} is one of the model's other variables: pass state_leaf")
            tensor_leaf = state_leaf
        else:
            tensor_leaf = leaf
        if not tensor.in_block:
            array = tensor_leaf(tensor.path)
            dtype = array.dtype
            yield from zip(tensor.names, tensor.write(array), strict=True)
            continue
        layers = hf_mapping.blocks_with(tensor, model)
        whole = tensor_leaf(("blocks", *tensor.path)) if stacked and tensor.path is not None and layers else None
        for layer in layers:
            names = hf_mapping.layer_names(tensor, layer)
            if tensor.path is None:  # GPT-2's biases for a model without them
                yield from ((name, np.zeros(tensor.zero_shape, dtype)) for name in names)
                continue
            array = whole[layer] if stacked else tensor_leaf(("blocks", layer, *tensor.path))
            yield from zip(names, tensor.write(array), strict=True)


def write_folder(out: Path, model, tensors: Iterator[tuple[str, np.ndarray]], source: Path | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, write: bool = True) -> list[str]:
    """Writes the `tensors` (`hf_tensors`) of `model` (a decoder's section) as a Hugging Face folder:
    config.json, the safetensors shard(s) (an index where there are several), and `source`'s
    tokenizer and generation files (the folder the run started from). Each shard is written as soon as
    it is full: the host holds one shard, not the model. `write` False: consume the tensors (each
    process's part in gathering them) and write nothing. Returns the files written."""
    groups: list[str] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, np.ndarray] = {}
    size = total_size = total_count = 0
    dtype = None

    def flush() -> None:
        file = f"part-{len(groups) + 1:05d}.safetensors"
        if write:
            safetensors_file.write(out / file, pending, {"format": "pt"})
        weight_map.update({name: file for name in pending})
        groups.append(file)
        pending.clear()

    if write:
        out.mkdir(parents=True, exist_ok=True)
    for name, array in tensors:
        array = np.ascontiguousarray(array)
        dtype = dtype or str(array.dtype)
        if pending and size + array.nbytes > max_shard_bytes:
            flush()
            size = 0
        pending[name] = array
        size += array.nbytes
        total_size += array.nbytes
        total_count += array.size
    flush()
    if not write:
        return []
    source_config = read_config(source) if source is not None and (source / "config.json").is_file() else None
    config = {**hf_mapping.hf_config(model, source_config), "dtype": dtype}
    atomic.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
    for temporary, final in zip(groups, names, strict=True):
        (out / temporary).rename(out / final)
    written = ["config.json", *names]
    if len(groups) > 1:
        final_of = dict(zip(groups, names, strict=True))
        index = {"metadata": {"total_parameters": total_count, "total_size": total_size},
                 "weight_map": {name: final_of[file] for name, file in sorted(weight_map.items())}}
        atomic.write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.append("model.safetensors.index.json")
    for name in SIDE_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(name)
    return written


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[int, list[str]]:
    """`jaxdist export RUN_DIR OUT --format hf`: a run's checkpoint (default: the newest) as a Hugging
    Face folder OUT. Returns (step, files written).

    In one process the parameters are read into its memory. In several (`jaxdist launch -n N --
    export ...`, or a job's processes), each reads its shards of them, split over every device (FSDP),
    and they gather one parameter at a time: process 0 writes, holding one parameter and one
    safetensors shard at a time. Collective there: every process must call it.
    """
    from jaxdist import models
    from jaxdist.checkpoint.export import check_saved_model, checkpoint_path, keyed_like, read_variables, saved_config
    from jaxdist.train.state import abstract_model

    out = Path(out)
    err = None
    if jax.process_index() == 0:
        try:
            _check_out(out)
        except UserError as caught:
            err = caught
    # Process 0 writes: the others learn whether OUT will do, and stop with it if not.
    if jax.process_count() > 1 and int(multihost_utils.broadcast_one_to_all(np.int32(err is not None))) and err is None:
        raise UserError(f"export --format hf: process 0 cannot write OUT={out} (its line says why)")
    if err is not None:
        raise err
    if jax.process_count() == 1:
        step, params, model_state, meta = read_variables(run_dir, step)
        cfg = saved_config(meta, checkpoint_path(run_dir, step))
        hf_mapping.export_architecture(cfg.model)  # one line before anything is written
        abstract = abstract_model(models.get(cfg.model.name).create(cfg), cfg.seed)
        check_saved_model(params, abstract.params, checkpoint_path(run_dir, step))
        params, model_state = keyed_like(params, abstract.params), keyed_like(model_state, abstract.state)
        tensors = hf_tensors(cfg.model, lambda path: leaf_at(params, path), lambda path: leaf_at(model_state, path))
        files = write_folder(out, cfg.model, tensors, _source(cfg))
    else:
        step, files, cfg = _export_spread(run_dir, out, step)
    if tokenizer_lib.HUGGINGFACE_FILE not in files:
        warn(missing_tokenizer(cfg, out))
    return step, files


def missing_tokenizer(cfg: Config, out: Path) -> str:
    """What to tell the user whose export OUT of a run of `cfg` holds no tokenizer: why the run had
    none to copy, and how to add one."""
    said = f"export --format hf: {out} holds no tokenizer"
    source = _source(cfg)
    if source is not None:
        return (f"{said}: {source}, the folder the run started from, has no {tokenizer_lib.HUGGINGFACE_FILE}; copy "
                f"the model's tokenizer files ({tokenizer_lib.HUGGINGFACE_FILE}, tokenizer_config.json) into {out}")
    prepare = (f"to export one, prepare the data with a Hugging Face tokenizer (jaxdist data prepare INPUTS --out DIR "
               f"--tokenizer PATH/{tokenizer_lib.HUGGINGFACE_FILE}) and train on it")
    name, file = _data_tokenizer(cfg)
    if name == tokenizer_lib.HuggingFaceTokenizer.name:
        return f"{said}: the run's data was tokenized with {file}; copy it into {out}"
    if name == tokenizer_lib.ByteTokenizer.name:
        return f"{said}: the run's tokens are UTF-8 bytes, which no {tokenizer_lib.HUGGINGFACE_FILE} describes; {prepare}"
    if name == tokenizer_lib.SentencePieceTokenizer.name:
        return f"{said}: the run's data was tokenized with a SentencePiece model ({file}); {prepare}"
    return (f"{said}: the run started from no Hugging Face folder, and its data (data.path={cfg.data.path}) names no "
            f"tokenizer; copy the {tokenizer_lib.HUGGINGFACE_FILE} its token ids come from into {out}")


def _data_tokenizer(cfg: Config) -> tuple[str | None, Path | None]:
    """(name, file) of the tokenizer a run's data was made with, as far as it can be read now:
    bytes for the stdlib corpus, the prepared folder's manifest for token shards; (None, None) for
    arrays of ids or a folder no longer readable."""
    if cfg.data.source == "stdlib":
        return tokenizer_lib.ByteTokenizer.name, None
    if cfg.data.source != "arrayrecord":
        return None, None
    folder = Path(cfg.data.mixture[0].path if cfg.data.mixture else cfg.data.path)
    try:
        entry = sources.read_manifest(folder)["tokenizer"]
    except (UserError, KeyError):
        return None, None
    return entry.get("name"), (folder / entry["file"] if "file" in entry else None)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"export --format hf: OUT={out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"export --format hf: OUT={out} is not empty; name a new or empty folder")
    check_writable(out.parent if not out.exists() else out, f"export: OUT={out}", directory=True)


def _source(cfg: Config) -> Path | None:
    return folder_of(cfg.model.init_from) if getattr(cfg.model, "init_from", None) else None


def _export_spread(run_dir: str | Path, out: Path, step: int | None) -> tuple[int, list[str], Config]:
    """`export` in several processes: each reads its shards, they gather a parameter at a time.
    Returns (step, files written, the run's config)."""
    from jaxdist import models
    from jaxdist.checkpoint.export import read_checkpoint, saved_config
    from jaxdist.parallel import layout as layout_lib
    from jaxdist.train.state import abstract_model, model_state_shardings, param_shardings, with_shardings

    def read(store, step: int) -> tuple[Config, Any, Any]:
        cfg = saved_config(store.meta(step), store.path(step))
        hf_mapping.export_architecture(cfg.model)
        spread = cfg.model_copy(update={
            "mesh": cfg.mesh.model_copy(update={"data": 1, "stage": 1, "fsdp": -1, "tensor": 1}),
            "rules": cfg.rules.model_copy(update={"preset": "fsdp"})})
        entry = models.get(cfg.model.name)
        placed = layout_lib.from_config(spread, None, entry.activations)
        abstract = abstract_model(entry.create(spread), spread.seed)
        target = with_shardings(abstract.params, param_shardings(abstract, placed.rules, placed.mesh))
        model_state = None
        if abstract.state is not None:
            model_state = store.read_placed(step, "model_state", with_shardings(
                abstract.state, model_state_shardings(abstract, placed.rules, placed.mesh)))
        return cfg, store.read_placed(step, "params", target), model_state

    step, (cfg, params, model_state) = read_checkpoint(run_dir, step, read)

    def gathered(tree: Any) -> Callable[[tuple], np.ndarray]:
        return lambda path: np.asarray(multihost_utils.process_allgather(leaf_at(tree, path), tiled=True))

    writer = jax.process_index() == 0
    files = write_folder(out, cfg.model, hf_tensors(cfg.model, gathered(params), gathered(model_state)), _source(cfg),
                         write=writer)
    multihost_utils.sync_global_devices("jaxdist_export_hf")  # the folder is whole before any process returns
    return step, files, cfg
