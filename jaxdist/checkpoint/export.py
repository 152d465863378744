"""Export: a run's trained parameters as one safetensors or npz file, for use outside jaxdist."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxdist.checkpoint.store import Checkpoints, dotted_name
from jaxdist.errors import UserError


def export_params(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[int, int]:
    """Writes the params of a run's checkpoint (default: the newest) as one safetensors or npz file,
    with the model state (BatchNorm's running averages) where the model has one.

    Keys are the dotted variable paths (`blocks.attn.qkv`, `stem.norm.mean`); a safetensors file's
    metadata holds the step and the resolved config. Returns (step, number of arrays). Only the
    params and model state are read, but all of them, into this host's memory: this is for use
    elsewhere, not for training.
    """
    out = Path(out)
    if out.suffix not in (".safetensors", ".npz"):
        raise UserError(f"export: OUT={out} must end in .safetensors or .npz")
    if out.is_dir():
        raise UserError(f"export: OUT={out} is a directory; name the file to write")
    existing = next(parent for parent in out.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise UserError(f"export: OUT={out} cannot be written: {existing} is a file, not a directory")
    try:  # before reading the params: an unwritable OUT fails fast
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"export: OUT={out} cannot be written ({err.strerror}: {err.filename})") from None
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
        parts, meta = store.read_parts(step, ("params", "model_state"))
    arrays = {dotted_name(path): np.ascontiguousarray(leaf)
              for part in parts.values() for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]}
    if out.suffix == ".npz":
        np.savez(out, **arrays)
    else:
        from safetensors.numpy import save_file

        save_file(arrays, str(out), metadata={"step": str(step), "config": json.dumps(meta.get("config", {}))})
    return step, len(arrays)
