"""Export: a run's trained parameters as one safetensors or npz file, for use outside jaxdist."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import atomic
from jaxdist.checkpoint import safetensors_file
from jaxdist.checkpoint.integrity import is_damage
from jaxdist.checkpoint.names import dotted_name, leaf_shapes
from jaxdist.checkpoint.restore import first_mismatch
from jaxdist.checkpoint.store import Checkpoints, first_line
from jaxdist.config import Config
from jaxdist.config.files import from_dict
from jaxdist.errors import UserError, check_writable


T = TypeVar("T")
# What export reads of a checkpoint's state.
PARTS = ("params", "model_state")


def export_params(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[int, int]:
    """Writes the params of a run's checkpoint (default: the newest) as one safetensors or npz file,
    with the model state (BatchNorm's running averages) where the model has one.

    Keys are the dotted variable paths (`blocks.attn.qkv`, `stem.norm.mean`); a safetensors file's
    metadata holds the step and the resolved config. Arrays keep their dtypes: an npz file cannot
    hold those numpy lacks (bfloat16, float8), so those go to safetensors. Returns (step, number
    of arrays). Only the params and model state are read, but all of them, into this host's
    memory: this is for use elsewhere, not for training. A damaged checkpoint is a `UserError`
    naming the older steps to pass instead.
    """
    out = Path(out)
    if out.suffix not in (".safetensors", ".npz"):
        raise UserError(f"export: OUT={out} must end in .safetensors or .npz")
    check_writable(out, f"export: OUT={out}")  # before reading the params: an unwritable OUT fails fast
    check = (lambda saved: _check_npz_dtypes(out, saved)) if out.suffix == ".npz" else None
    step, parts, meta = read_parts(run_dir, step, check)
    arrays = {dotted_name(path): np.ascontiguousarray(leaf)
              for part in parts.values() for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]}
    with atomic.replacing(out) as partial:  # an older OUT stays whole until the new one is
        if out.suffix == ".npz":
            with open(partial, "wb") as file:  # a file object: np.savez would add .npz to a name
                np.savez(file, **arrays)
        else:
            safetensors_file.write(partial, arrays, {"step": str(step), "config": json.dumps(meta.get("config", {}))})
    return step, len(arrays)


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """The directory of a run's checkpoint `step`, as the store names it in its lines."""
    return Path(run_dir).absolute() / "checkpoints" / str(step)


def saved_config(meta: dict, checkpoint: Path) -> Config:
    """The resolved config a checkpoint's meta holds; a `UserError` naming the key where it is not a
    config (the meta edited or damaged)."""
    config = meta.get("config")
    if not isinstance(config, dict):
        raise UserError(f"checkpoint {checkpoint}: its meta holds no config object; the meta was edited or is damaged")
    try:
        return from_dict(config)
    except UserError as err:
        raise UserError(f"checkpoint {checkpoint}: the config in its meta is not valid ({err}); the meta was edited "
                        f"or is damaged") from None


def check_saved_model(saved_params: Any, abstract_params: Any, checkpoint: Path) -> None:
    """Raises `UserError` where the model a checkpoint's meta describes (`abstract_params`, built from
    its config) is not the one of its saved arrays (`saved_params`): what is built from the meta
    must take its shapes from the arrays, never cut them to the meta's."""
    problem = first_mismatch(leaf_shapes(saved_params), leaf_shapes(abstract_params))
    if problem:
        raise UserError(f"checkpoint {checkpoint}: the model its meta describes does not fit its saved arrays: "
                        f"{problem}; the meta was edited or is damaged")


def keyed_like(saved: Any, like: Any) -> Any:
    """`saved` (a pure dict read from a checkpoint, whose keys orbax writes as strings) with the keys
    of `like` (the model's pure dict, where unrolled blocks are keyed 0, 1, ...)."""
    if not isinstance(like, dict):
        return saved
    return {key: keyed_like(saved[key] if key in saved else saved[str(key)], value) for key, value in like.items()}


def read_params(run_dir: str | Path, step: int | None = None) -> tuple[int, Any, dict]:
    """(step, params as a pure dict of numpy arrays, the checkpoint's metadata) of a run's checkpoint
    (default: the newest), read into this host's memory."""
    step, parts, meta = read_parts(run_dir, step, parts=("params",))
    return step, jax.tree.map(np.asarray, parts["params"]), meta


def read_variables(run_dir: str | Path, step: int | None = None) -> tuple[int, Any, Any, dict]:
    """As `read_params`, with the model's other variables (None where it has none) after the params:
    (step, params, model_state, metadata)."""
    step, parts, meta = read_parts(run_dir, step)
    return step, jax.tree.map(np.asarray, parts["params"]), jax.tree.map(np.asarray, parts.get("model_state")), meta


def read_parts(run_dir: str | Path, step: int | None = None, check: Callable[[dict], None] | None = None,
               parts: tuple[str, ...] = PARTS) -> tuple[int, dict, dict]:
    """(step, {part: pure dict}, metadata) of a run's checkpoint (default: the newest); `check(saved
    shapes)` runs on the metadata before any array is read. A damaged checkpoint is a `UserError`
    naming the older steps to pass instead."""
    def read(store: Checkpoints, step: int) -> tuple[dict, dict]:
        if check is not None:
            check(store.saved_shapes(step))
        return store.read_parts(step, parts)

    step, (found, meta) = read_checkpoint(run_dir, step, read)
    return step, found, meta


def read_checkpoint(run_dir: str | Path, step: int | None, read: Callable[[Checkpoints, int], T]) -> tuple[int, T]:
    """(step, `read(store, step)`) for a run's checkpoint `step` (default: the newest): a run
    directory without checkpoints, a step it lacks or a damaged checkpoint is a `UserError`, the
    last naming the older steps to pass instead."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        raise UserError(f"export: RUN_DIR={run_dir} holds no checkpoints (no directory {directory})")
    with Checkpoints(directory, create=False) as store:
        steps = store.steps()
        if not steps:
            raise UserError(f"export: RUN_DIR={run_dir} holds no complete checkpoint in {directory}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise UserError(f"export: --step {step} is not in {directory}; available: {', '.join(map(str, steps))}")
        try:
            return step, read(store, step)
        except Exception as err:
            if not is_damage(err):
                raise
            older = [str(other) for other in steps if other < step]
            instead = f"pass --step with an older one: {', '.join(older)}" if older else "there is no older one"
            raise UserError(f"export: checkpoint {store.path(step)} is damaged ({first_line(err)}); {instead}") from None


def _check_npz_dtypes(out: Path, saved: dict[str, tuple]) -> None:
    """Refuses an npz export of arrays whose dtype numpy lacks: np.savez would write them as raw
    bytes (`|V2` for bfloat16) that read back as no number at all."""
    foreign = [(name.partition(".")[2], dtype) for name, (_, dtype) in saved.items()
               if name.partition(".")[0] in PARTS and jnp.dtype(dtype).kind == "V"]
    if foreign:
        name, dtype = foreign[0]
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(f"export: OUT={out}: .npz cannot hold {dtype} arrays ({name}{more}), numpy has no such "
                        f"type; export to .safetensors, which keeps them")
