"""Sampling from a trained language model: one compiled loop over positions."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxdist.parallel import rules as rules_lib


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "temperature"))
def _generate(graphdef, params, tokens, key, start, length, temperature):
    model = nnx.merge(graphdef, params)

    def next_token(position, carry):
        tokens, key = carry
        logits = model(tokens)[:, position - 1]
        key, sub = jax.random.split(key)
        if temperature == 0:
            chosen = jnp.argmax(logits, axis=-1)
        else:
            chosen = jax.random.categorical(sub, logits / temperature, axis=-1)
        tokens = tokens.at[:, position].set(chosen.astype(tokens.dtype))
        return tokens, key

    tokens, _ = jax.lax.fori_loop(start, length, next_token, (tokens, key))
    return tokens


def sample(
    graphdef: nnx.GraphDef,
    params: Any,
    prompt: np.ndarray,
    new_tokens: int,
    seq_len: int,
    temperature: float,
    seed: int,
    mesh,
    rules: rules_lib.Rules,
    rows: int = 1,
) -> np.ndarray:
    """`rows` continuations of `prompt` (token ids), at most `seq_len` tokens each, prompt included."""
    prompt = np.asarray(prompt, np.int32)[: seq_len - 1]
    length = min(seq_len, len(prompt) + new_tokens)
    tokens = np.zeros((rows, seq_len), np.int32)
    tokens[:, : len(prompt)] = prompt
    with rules_lib.activation_rules(mesh, rules):
        out = _generate(graphdef, params, jnp.asarray(tokens), jax.random.key(seed), len(prompt), length, temperature)
    # On several processes the rows live on other hosts' devices too: gather them everywhere.
    return np.asarray(multihost_utils.process_allgather(out, tiled=True))[:, :length]
