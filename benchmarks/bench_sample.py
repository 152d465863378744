"""Sampling speed: tokens/s with the KV cache against recomputing the whole prefix for every token.

    PYTHONPATH=. python benchmarks/bench_sample.py gpt_406m [key=value ...] [--rows 1,8] [--new 256]

Builds the recipe's model with random weights (the speed does not depend on them), samples `--new`
tokens after a 16-token prompt, greedy, and prints one JSON line per row count and a table last.
The recompute is what sampling did before the cache: one forward over every position so far per token.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdist
from jaxdist import config as config_lib
from jaxdist import models
from jaxdist.models import dtypes
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import generate
from jaxdist.train.trainer import Trainer


@functools.partial(jax.jit, static_argnames=("graphdef", "start", "length"))
def _recompute(graphdef, params, tokens, start, length):
    model = nnx.merge(graphdef, params)

    def next_token(position, tokens):
        logits = model(tokens)[:, position - 1]
        return tokens.at[:, position].set(jnp.argmax(logits, -1).astype(tokens.dtype))

    return jax.lax.fori_loop(start, length, next_token, tokens)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--new", type=int, default=256)
    args, overrides = parser.parse_known_args(argv)
    jaxdist.use_cpu_devices()
    cfg = config_lib.load(args.config, ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", *overrides])
    trainer = Trainer.from_config(cfg, devices=jax.devices()[:1])
    prompt = (np.arange(16, dtype=np.int32) * 7919) % cfg.model.vocab
    length = len(prompt) + args.new
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        cast = generate.compute_dtype_params(models.get(cfg.model.name).read_in_compute_dtype,
                                             dtypes.policy(cfg.precision).compute_dtype)
        cached = generate.timed_sample(trainer.graphdef, trainer.params, prompt, cfg.model.seq_len,
                                       generate.Sampling(args.new, 0.0, rows=rows), trainer.mesh, trainer.rules, cast,
                                       trainer.state.model_state)
        tokens = np.zeros((rows, cfg.model.seq_len), np.int32)
        tokens[:, : len(prompt)] = prompt
        with rules_lib.activation_rules(trainer.mesh, trainer.rules):
            compiled = _recompute.lower(trainer.graphdef, trainer.params, jnp.asarray(tokens), len(prompt),
                                        length).compile()
            start = time.perf_counter()
            again = np.asarray(jax.block_until_ready(compiled(trainer.params, jnp.asarray(tokens))))[:, :length]
            recompute_s = time.perf_counter() - start
        row = {"config": args.config, "rows": rows, "new_tokens": args.new, "device": jax.devices()[0].device_kind,
               "cache_tokens_per_s": round(rows * args.new / cached.seconds, 1),
               "recompute_tokens_per_s": round(rows * args.new / recompute_s, 1),
               "greedy_identical": bool(np.array_equal(cached.tokens, again))}
        print(json.dumps(row), flush=True)
        results.append(row)
    print(f"{'rows':>5} {'cache tok/s':>12} {'recompute tok/s':>16} {'speed-up':>9} identical")
    for row in results:
        print(f"{row['rows']:>5} {row['cache_tokens_per_s']:>12,.0f} {row['recompute_tokens_per_s']:>16,.0f} "
              f"{row['cache_tokens_per_s'] / row['recompute_tokens_per_s']:>8.1f}x {row['greedy_identical']}")


if __name__ == "__main__":
    main(sys.argv[1:])
