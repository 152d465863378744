"""`jaxdist sample RUN_DIR --prompt TEXT`: continue a prompt with a run's checkpointed model.

The config is the checkpoint's own (the run's model, data and tokenizer), with the command line's
overrides on top (e.g. another mesh for these devices); the parameters are read from the checkpoint
and placed by the config's rules. Sampling keeps a KV cache (train/generate.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxdist import config as config_lib
from jaxdist import models
from jaxdist.checkpoint.export import read_params
from jaxdist.config import Config
from jaxdist.data import loader
from jaxdist.errors import UserError
from jaxdist.models import dtypes
from jaxdist.parallel import layout as layout_lib
from jaxdist.train import generate
from jaxdist.train.state import abstract_model, param_shardings


def run(run_dir: str, prompt: str, sampling: generate.Sampling, step: int | None, overrides: list[str]) -> str:
    """The sampled text of each of `sampling.rows` rows and a line on the speed (tokens/s of the
    compiled generation)."""
    if not 0 < sampling.top_p <= 1:
        raise UserError(f"sample --top-p {sampling.top_p}: use a probability in (0, 1]")
    step, params, meta = read_params(run_dir, step)
    cfg = config_lib.with_overrides(Config.model_validate(meta.get("config", {})), overrides)
    entry = models.get(cfg.model.name)
    if not entry.samples_text:
        raise UserError(f"sample: RUN_DIR={run_dir} trained model.name={cfg.model.name}, which makes no text")
    tokenizer = loader.tokenizer(cfg)
    ids = np.asarray(tokenizer.encode(prompt), np.int32)
    if not len(ids):
        raise UserError("sample --prompt: the prompt is empty; give at least one character")
    if len(ids) >= cfg.model.seq_len:
        raise UserError(f"sample --prompt: the prompt is {len(ids)} tokens, and model.seq_len={cfg.model.seq_len} "
                        f"leaves no room to continue it")
    layout = layout_lib.from_config(cfg, None, entry.activations)
    abstract = abstract_model(entry.create(cfg), cfg.seed)
    shardings = param_shardings(abstract, layout.rules, layout.mesh)
    placed = jax.tree.map(lambda array, sharding: jax.make_array_from_callback(
        array.shape, sharding, lambda index: array[index]), params, shardings)
    # Rows are split over the batch shards: a mesh of more shards than rows samples some rows it drops.
    rows = sampling.rows
    computed = -(-rows // layout.batch_shards) * layout.batch_shards
    cast = None if entry.read_in_compute_dtype is None else generate.compute_dtype_params(
        entry.read_in_compute_dtype, dtypes.policy(cfg.precision).compute_dtype)
    out = generate.timed_sample(abstract.graphdef, placed, ids, cfg.model.seq_len,
                                dataclasses.replace(sampling, rows=computed), layout.mesh, layout.rules, cast)
    kept = out.tokens[:rows]
    made = (kept.shape[1] - len(ids)) * rows
    texts = [tokenizer.decode(row) for row in kept]
    speed = (f"{made} tokens in {out.seconds:.2f} s ({made / out.seconds:,.0f} tokens/s, {rows} row(s), step "
             f"{step} of {Path(run_dir)})")
    return "\n----\n".join(texts) + "\n" + speed
