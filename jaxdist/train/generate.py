"""Sampling from a trained language model with a KV cache: the prompt in one pass, then one compiled
step per new token that computes only that token's keys and values (`GPT.decode`)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxdist.parallel import rules as rules_lib
from jaxdist.train.state import merge


def choose(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """The next token of each row of `logits` (batch, vocab): the most likely at temperature 0, else
    drawn from softmax(logits / temperature) cut to the smallest set of tokens whose probability
    reaches `top_p` (nucleus sampling; 1: every token)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens ranked above each
        cutoff = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "temperature", "top_p", "cast"))
def _generate(graphdef, params, model_state, prompt, key, length, temperature, top_p, cast):
    # The weights the model reads only in the compute dtype are cast once, not at every token: a
    # token's step then reads each weight once, in the smaller dtype.
    model = merge(graphdef, params if cast is None else cast(params), model_state)
    rows, prompt_length = prompt.shape
    tokens = jnp.zeros((rows, length), prompt.dtype).at[:, :prompt_length].set(prompt)
    logits, cache = model.decode(prompt, model.init_cache(rows, length), jnp.int32(0))
    key, sub = jax.random.split(key)
    tokens = tokens.at[:, prompt_length].set(choose(logits[:, -1], sub, temperature, top_p).astype(tokens.dtype))

    def next_token(position, carry):
        tokens, cache, key = carry
        last = jax.lax.dynamic_slice_in_dim(tokens, position - 1, 1, axis=1)
        logits, cache = model.decode(last, cache, position - 1)
        key, sub = jax.random.split(key)
        chosen = choose(logits[:, -1], sub, temperature, top_p).astype(tokens.dtype)
        return jax.lax.dynamic_update_slice_in_dim(tokens, chosen[:, None], position, axis=1), cache, key

    tokens, _, _ = jax.lax.fori_loop(prompt_length + 1, length, next_token, (tokens, cache, key))
    return tokens


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How `sample` continues a prompt: `new_tokens` more tokens (up to the model's context), drawn at
    `temperature` (0: the most likely) from the likeliest tokens up to `top_p` of the probability
    (nucleus sampling; 1: every token), for `rows` rows from the key `seed`."""

    new_tokens: int
    temperature: float
    top_p: float = 1.0
    rows: int = 1
    seed: int = 0


class Sampled(NamedTuple):
    """Sampled rows (prompt included) and the generation's seconds, compile excluded."""

    tokens: np.ndarray
    seconds: float


def sample(graphdef: nnx.GraphDef, params: Any, prompt: np.ndarray, seq_len: int, sampling: Sampling, mesh: Mesh,
           rules: rules_lib.Rules, cast: Callable[[Any], Any] | None = None, model_state: Any = None) -> np.ndarray:
    """`sampling.rows` continuations of `prompt` (token ids), at most `seq_len` tokens each, prompt included.
    `cast(params)`: the parameters as the model reads them (`compute_dtype_params`); None: as they are.
    `model_state`: the model's other variables, where it has any (a sigmoid router's biases)."""
    return timed_sample(graphdef, params, prompt, seq_len, sampling, mesh, rules, cast, model_state).tokens


def compute_dtype_params(picks: Callable[[tuple], bool], dtype) -> Callable[[Any], Any]:
    """A `cast` for `sample`: the parameters `picks(path)` names (a model's `read_in_compute_dtype`) in `dtype`."""
    return functools.partial(_cast_picked, picks, jnp.dtype(dtype))


def _cast_picked(picks, dtype, params):
    return jax.tree_util.tree_map_with_path(lambda path, leaf: leaf.astype(dtype) if picks(path) else leaf, params)


def timed_sample(graphdef: nnx.GraphDef, params: Any, prompt: np.ndarray, seq_len: int, sampling: Sampling, mesh: Mesh,
                 rules: rules_lib.Rules, cast: Callable[[Any], Any] | None = None, model_state: Any = None) -> Sampled:
    """`sample`, with the seconds the generation took once compiled (for tokens/s)."""
    prompt = np.asarray(prompt, np.int32)[: seq_len - 1]
    if not len(prompt):
        raise ValueError("sampling needs a prompt of at least one token")
    length = min(seq_len, len(prompt) + sampling.new_tokens)
    prompts = jnp.asarray(np.tile(prompt, (sampling.rows, 1)))
    key = jax.random.key(sampling.seed)
    static = dict(length=length, temperature=sampling.temperature, top_p=sampling.top_p, cast=cast)
    with rules_lib.activation_rules(mesh, rules):
        compiled = _generate.lower(graphdef, params, model_state, prompts, key, **static).compile()
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(params, model_state, prompts, key))
        seconds = time.perf_counter() - start
    # On several processes the rows live on other hosts' devices too: gather them everywhere.
    return Sampled(np.asarray(multihost_utils.process_allgather(out, tiled=True))[:, :length], seconds)


def sampling_bytes(abstract, rows: int, prompt_length: int, length: int, vocab: int) -> int:
    """What sampling `rows` rows of `length` tokens holds at the least: the KV cache (its shape asked
    of the model, nothing allocated), the prompt pass's float32 logits and the tokens."""
    def empty_cache(params, model_state):
        return merge(abstract.graphdef, params, model_state).init_cache(rows, length)

    cache = jax.eval_shape(empty_cache, abstract.params, abstract.state)
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    return cache_bytes + rows * (prompt_length * vocab * 4 + length * 4)
