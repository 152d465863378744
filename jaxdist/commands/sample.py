"""`jaxdist sample RUN_DIR --prompt TEXT`: continues a prompt with a run's checkpointed model.

The config is the checkpoint's own (the run's model, data and tokenizer), with the command line's
overrides on top (e.g. another mesh for these devices); the parameters are read from the checkpoint
and placed by the config's rules. Sampling keeps a KV cache (train/generate.py).
"""

from __future__ import annotations

import argparse
import math

from jaxdist.commands import arguments
from jaxdist.errors import UserError

HELP = "continue a prompt with a run's checkpointed language model (KV cache)"
LOCAL_PATHS = (("run_dir", "RUN_DIR"),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory with checkpoints/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the run's config, e.g. mesh.fsdp=8")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--tokens", type=arguments.COUNT, default=100,
                        help="tokens to generate (at most up to model.seq_len)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the likeliest tokens up to "
                                                                 "this probability (1: all)")
    parser.add_argument("--rows", type=arguments.COUNT, default=1, help="continuations to sample")
    parser.add_argument("--seed", type=arguments.INDEX, default=0)
    parser.add_argument("--step", type=arguments.INDEX, help="checkpoint step (default: the newest)")


def run(args: argparse.Namespace) -> None:
    """Prints the sampled text of each of `--rows` rows and a line on the speed (tokens/s of the
    compiled generation)."""
    from pathlib import Path

    import jax
    import numpy as np

    from jaxdist import config, models
    from jaxdist.checkpoint.export import check_saved_model, checkpoint_path, keyed_like, read_variables, saved_config
    from jaxdist.data import loader
    from jaxdist.models import dtypes
    from jaxdist.parallel import layout as layout_lib
    from jaxdist.train import generate
    from jaxdist.train.state import abstract_model, model_state_shardings, param_shardings

    check_options(args.prompt, args.temperature, args.top_p, args.seed)
    rows = args.rows
    step, params, model_state, meta = read_variables(args.run_dir, args.step)
    cfg = config.with_overrides(saved_config(meta, checkpoint_path(args.run_dir, step)), args.overrides)
    entry = models.get(cfg.model.name)
    if not entry.samples_text:
        raise UserError(f"sample: RUN_DIR={args.run_dir} trained model.name={cfg.model.name}, which makes no text")
    tokenizer = loader.tokenizer(cfg)
    ids = np.asarray(tokenizer.encode(args.prompt), np.int32)
    if not len(ids):
        raise UserError("sample --prompt: the prompt is empty; give at least one character")
    if len(ids) >= cfg.model.seq_len:
        raise UserError(f"sample --prompt: the prompt is {len(ids)} tokens, and model.seq_len={cfg.model.seq_len} "
                        f"leaves no room to continue it")
    layout = layout_lib.from_config(cfg, None, entry.activations)
    abstract = abstract_model(entry.create(cfg), cfg.seed)
    check_saved_model(params, abstract.params, checkpoint_path(args.run_dir, step))
    params, model_state = keyed_like(params, abstract.params), keyed_like(model_state, abstract.state)
    # Rows are split over the batch shards: a mesh of more shards than rows samples some rows it drops.
    computed = -(-rows // layout.batch_shards) * layout.batch_shards
    _check_rows_fit(abstract, rows, computed, len(ids), min(cfg.model.seq_len, len(ids) + args.tokens), cfg.model.vocab,
                    layout.mesh)
    def put(tree, shardings):
        return jax.tree.map(lambda array, sharding: jax.make_array_from_callback(
            array.shape, sharding, lambda index: array[index]), tree, shardings)

    placed = put(params, param_shardings(abstract, layout.rules, layout.mesh))
    model_state = put(model_state, model_state_shardings(abstract, layout.rules, layout.mesh))
    cast = None if entry.read_in_compute_dtype is None else generate.compute_dtype_params(
        entry.read_in_compute_dtype, dtypes.policy(cfg.precision).compute_dtype)
    sampling = generate.Sampling(args.tokens, args.temperature, args.top_p, computed, args.seed)
    out = generate.timed_sample(abstract.graphdef, placed, ids, cfg.model.seq_len, sampling, layout.mesh,
                                layout.rules, cast, model_state)
    kept = out.tokens[:rows]
    made = (kept.shape[1] - len(ids)) * rows
    texts = [tokenizer.decode(row) for row in kept]
    speed = (f"{made} tokens in {out.seconds:.2f} s ({made / out.seconds:,.0f} tokens/s, {rows} row(s), step "
             f"{step} of {Path(args.run_dir)})")
    if jax.process_index() == 0:
        print("\n----\n".join(texts) + "\n" + speed)


def check_options(prompt: str, temperature: float, top_p: float, seed: int) -> None:
    """Raises `UserError` for an option sampling cannot use, before anything is read: a temperature
    that is not finite or is negative (NaN would sample garbage), a top-p outside (0, 1], a seed
    outside 32 bits (as `seed` in a config), a prompt that is not text (bytes of the command line
    that are not UTF-8)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"sample --temperature {temperature}: use a finite number, 0 (greedy) or more")
    if not 0 < top_p <= 1:
        raise UserError(f"sample --top-p {top_p}: use a probability in (0, 1]")
    if not 0 <= seed < 2**32:
        raise UserError(f"sample --seed {seed}: use an integer from 0 to {2**32 - 1}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        # Python keeps a command line's byte that is not UTF-8 as the lone surrogate U+DC00 + byte.
        char = ord(prompt[err.start])
        what = f"byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise UserError(f"sample --prompt: it is not UTF-8 text ({what} at character {err.start}); pass UTF-8 "
                        f"text") from None


def _check_rows_fit(abstract, rows: int, computed: int, prompt_length: int, length: int, vocab: int, mesh) -> None:
    """Refuses `--rows` whose sampling this process's devices cannot hold their part of (on a CPU,
    this host's memory), before anything is allocated."""
    from jaxdist import runtime
    from jaxdist.train.generate import sampling_bytes

    available, where = runtime.memory_of(mesh.local_devices)
    share = len(mesh.local_devices) / mesh.devices.size
    per_row = sampling_bytes(abstract, 1, prompt_length, length, vocab) * share
    most = max(int(available // per_row) - (computed - rows), 0)
    runtime.check_memory(int(sampling_bytes(abstract, computed, prompt_length, length, vocab) * share),
                         f"sample --rows {rows}: sampling {computed:,} rows (their KV cache and the prompt's logits)",
                         f"pass at most --rows {most}", available, where)
