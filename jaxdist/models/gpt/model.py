"""The GPT decoder in flax NNX, which names its dimensions and nothing else.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `head_dim`, `mlp`,
`layers`, `length`); every large activation is constrained by logical names. Where they land on
the mesh is decided by the rules (jaxdist.parallel.rules), never here.

The blocks are created stacked (a leading `layers` axis) and run as a `lax.scan` (fast compile),
or split into a block per layer and run unrolled (often faster on GPU), with optional remat.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.config import PipelineConfig
from jaxdist.models.gpt.config import GPTConfig, ImplConfig
from jaxdist.models.cross_entropy import soft_cap
from jaxdist.models.layers.attention import Attention, Documents, KVCache, documents
from jaxdist.models.layers.common import NORMAL, RESIDUAL, at_least_float32, cast, param
from jaxdist.models.layers.latent_attention import LatentAttention
from jaxdist.models.layers.mlp import Mlp
from jaxdist.models.layers.moe import MoE, Stats
from jaxdist.models.layers.norm import Norm
from jaxdist.parallel import pipeline as pipeline_lib
from jaxdist.parallel import roles
from jaxdist.parallel.rules import constrain


# The parameters the model reads only cast to the compute dtype: the blocks' matmul weights. A copy
# kept in that dtype can stand in for each (train/copies.py). Not the embedding (its rows are
# added to the positions before the cast), the norms, or the head (the chunked loss sums its
# gradient in float32 and hands it back in the head's own dtype).
COMPUTE_DTYPE_PARAMS = frozenset({"qkv", "q", "kv", "out", "up", "gate", "down"})


def read_in_compute_dtype(path: tuple) -> bool:
    """Whether the parameter at this pytree path is one of `COMPUTE_DTYPE_PARAMS`."""
    return bool(path) and getattr(path[-1], "key", None) in COMPUTE_DTYPE_PARAMS


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)), the MLP a mixture of
    experts where `moe` (models/layers/moe.py); with `model.post_norms`, each branch's output normed
    too before it is added (Gemma's). `layer`: its index, for what differs by layer (the window).

    `__call__(x, delta, docs)` takes the residual and the previous block's pending MLP output and returns
    the same pair, and the experts' `Stats` (None without experts): each residual add happens inside
    the norm that follows it (one fused kernel on GPU), so the last block's add is done by the
    caller's final norm. `delta` None: nothing pending; `docs`: the packed documents' attention mask
    and positions (None: one stream per row).
    """

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False,
                 moe: bool = False, layer: int = 0):
        self.norm1 = Norm(cfg, impl, param_dtype, rngs)
        attention = LatentAttention if cfg.latent.kv_rank else Attention
        self.attn = attention(cfg, impl, param_dtype, rngs, fp8, layer)
        if cfg.post_norms:
            self.attn_out_norm = Norm(cfg, impl, param_dtype, rngs)
        self.norm2 = Norm(cfg, impl, param_dtype, rngs)
        if moe:
            self.moe = MoE(cfg, impl, param_dtype, rngs)
        else:
            self.mlp = Mlp(cfg, impl, param_dtype, rngs, fp8)
        if cfg.post_norms:
            self.mlp_out_norm = Norm(cfg, impl, param_dtype, rngs)

    def __call__(self, x: jax.Array, delta: jax.Array | None = None,
                 docs: Documents | None = None) -> tuple[jax.Array, jax.Array, Stats | None]:
        x, h = self.norm1.add(x, delta)
        x, h = self.norm2.add(x, self.attended(self.attn(h, docs)))
        return (x, *self.feed_forward(h, docs))

    def attended(self, y: jax.Array) -> jax.Array:
        """Attention's output `y` as it joins the residual: normed with `model.post_norms`."""
        return self.attn_out_norm(y) if hasattr(self, "attn_out_norm") else y

    def feed_forward(self, h: jax.Array, docs: Documents | None = None) -> tuple[jax.Array, Stats | None]:
        """The MLP's (or the experts') output for the normed residual `h`, as it joins the residual,
        and the experts' `Stats`."""
        if hasattr(self, "moe"):
            out, stats = self.moe(h, None if docs is None else docs.counted)
        else:
            out, stats = self.mlp(h), None
        return (self.mlp_out_norm(out) if hasattr(self, "mlp_out_norm") else out), stats


def _decode_block(block: Block, x: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
    """One block's step of sampling: `x` the new positions' residual (see `Attention.decode`)."""
    attended, cache = block.attn.decode(block.norm1(x), cache, start)
    x = x + block.attended(attended)
    return x + block.feed_forward(block.norm2(x))[0], cache


def _unstack(stacked: Block, create_block, layers: list[int], window_of) -> list[Block]:
    """The layers of a stacked block as blocks of their own, the i-th built as `create_block(layers[i])`
    builds one (blocks differ only in what is static, their attention's window: `window_of(layer)`)."""
    abstracts = {}
    with nnx.use_eager_sharding(False):
        for layer in layers:
            if window_of(layer) not in abstracts:
                abstracts[window_of(layer)] = nnx.eval_shape(lambda layer=layer: create_block(layer))
    # The stacks whole first: XLA would otherwise fuse each layer's slice into the random draw that
    # makes the stack, one copy of the draw's code per layer, and compile for that much longer.
    values = jax.lax.optimization_barrier(nnx.to_pure_dict(nnx.state(stacked)))
    blocks = []
    for i, layer in enumerate(layers):
        abstract = abstracts[window_of(layer)]
        state = nnx.state(abstract)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda stack: stack[i], values))
        blocks.append(nnx.merge(nnx.graphdef(abstract), state))
    return blocks


class Features(NamedTuple):
    """What the output projection and the loss read of the decoder: the final normed hidden states
    (batch, length, embed), the head (embed, vocab), and the experts' `Stats` stacked over the layers
    with experts (None without)."""

    hidden: jax.Array
    head: jax.Array
    moe: Stats | None


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    """Decoder-only transformer; `__call__(tokens)` gives logits (batch, length, vocab).

    `features(tokens)` gives the two inputs of that last projection separately, for losses that
    never form the full logits (models/cross_entropy.py).

    `cfg` is the architecture, `impl` how it runs (scanned or unrolled layers, remat, kernels, loss
    chunks; default `cfg.impl`). With `pipeline` settings and a stage axis in the mesh, the blocks run
    as a pipeline. With `fp8`, the attention and MLP projections run as FP8 GEMMs (models/fp8.py).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        impl: ImplConfig | None = None,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        pipeline: PipelineConfig | None = None,
        fp8: bool = False,
    ):
        impl = cfg.impl if impl is None else impl
        self.cfg = cfg
        self.impl = impl
        self.deterministic = False  # eval() sets it: the routers' biases stay as they are
        self.compute_dtype = compute_dtype
        self.pipeline = pipeline
        self.embed = param(rngs, NORMAL, (cfg.vocab, cfg.d_model), ("vocab", "embed"), param_dtype, roles.EMBEDDING)
        if cfg.positions == "learned":
            self.positions = param(rngs, NORMAL, (cfg.position_rows, cfg.d_model), ("length", "embed"), param_dtype,
                                    roles.EMBEDDING)

        # The blocks are drawn stacked either way: one random draw per kind of parameter, not one per
        # layer, keeps the init program small (each draw compiles to kernels of its own: see
        # docs/performance.md), and a scanned and an unrolled model start from the same values.
        # Layers with experts and without are two stacks (model.moe: unrolled only), interleaved.
        kinds = [cfg.moe.is_moe(layer) for layer in range(cfg.layers)]

        def stacked_blocks(count: int, moe: bool) -> Block:
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def draw(rngs: nnx.Rngs) -> Block:
                return Block(cfg, impl, param_dtype, rngs, fp8, moe)

            return draw(rngs)

        if impl.scan_layers:
            self.blocks = stacked_blocks(cfg.layers, kinds[0])
        else:
            # Unrolled, separate parameters per layer: each layer's gradient is complete as soon as its
            # backward is done, so its reduction can overlap the rest of the backward pass.
            unstacked = {moe: iter(_unstack(stacked_blocks(kinds.count(moe), moe),
                                            lambda layer, moe=moe: Block(cfg, impl, param_dtype, nnx.Rngs(0), fp8, moe,
                                                                         layer),
                                            [layer for layer, kind in enumerate(kinds) if kind == moe],
                                            cfg.layer_window))
                         for moe in set(kinds)}
            self.blocks = nnx.List([next(unstacked[moe]) for moe in kinds])
        self.final_norm = Norm(cfg, impl, param_dtype, rngs)
        if not cfg.tied_embeddings:
            self.head = param(rngs, NORMAL, (cfg.d_model, cfg.vocab), ("embed", "vocab"), param_dtype)

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        features = self.features(tokens, segments, positions)
        return self.logits(features.hidden, features.head)

    def features(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> Features:
        """The output projection's two inputs, the final normed hidden states (batch, length, embed)
        in the compute dtype and `head_weights()`, and the experts' statistics. Packed rows pass
        `segments` (each token's document in its row, 0 for padding) and `positions` (its place in
        the document): attention stays within a document and positions restart with each."""
        x = self._embed(tokens)
        docs = None if segments is None else documents(segments, positions)
        if self.cfg.positions == "learned":
            if docs is None:
                x = x + at_least_float32(self.positions[: tokens.shape[1]])
            else:
                x = x + jnp.take(at_least_float32(self.positions[...]), docs.positions, axis=0)
        x = constrain(cast(x, self.compute_dtype), RESIDUAL)
        x, delta, stats = self._run_blocks(x, docs, () if segments is None else (segments, positions))
        if stats is not None and self.cfg.moe.bias_rate and not self.deterministic:
            self._balance_routers(stats)
        return Features(self.final_norm.add(x, delta)[1], self.head_weights(), stats)

    def _balance_routers(self, stats: Stats) -> None:
        """Each sigmoid router's bias moved `model.moe.bias_rate` towards the experts that got fewer
        than the mean load of this call's tokens (DeepSeek-V3's balancing without an auxiliary loss)."""
        load = jax.lax.stop_gradient(stats.load)
        step = self.cfg.moe.bias_rate * jnp.sign(load.mean(-1, keepdims=True) - load)
        if self.impl.scan_layers:
            self.blocks.moe.bias[...] = self.blocks.moe.bias[...] + step
            return
        for block, layer_step in zip((block for block in self.blocks if hasattr(block, "moe")), step):
            block.moe.bias[...] = block.moe.bias[...] + layer_step

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty `KVCache` for `batch` rows of up to `length` positions, in the compute dtype (a
        ring of the sliding window's length, where that is shorter and every layer is windowed)."""
        cfg = self.cfg
        if all(not cfg.is_global(layer) for layer in range(cfg.layers)):
            length = min(length, cfg.sliding_window)
        if cfg.latent.kv_rank:  # each token's latent and shared rotated key part (models/layers/latent_attention.py)
            return KVCache(*(jnp.zeros((cfg.layers, batch, length, 1, width), self.compute_dtype)
                             for width in (cfg.latent.kv_rank, cfg.latent.rope_dim)))
        zeros = jnp.zeros((cfg.layers, batch, length, cfg.key_value_heads, cfg.head_width), self.compute_dtype)
        return KVCache(zeros, zeros)

    def decode(self, tokens: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Logits (batch, new, vocab) of `tokens` (batch, new) at positions `start`, `start + 1`, ...,
        attending to the earlier positions held in `cache` (from `init_cache`), and the cache with
        these positions' keys and values added. Sampling calls it once on the prompt, then once per
        token: each position's keys and values are computed once, not again for every later token."""
        x = self._embed(tokens)
        if self.cfg.positions == "learned":
            rows = jax.lax.dynamic_slice_in_dim(self.positions[...], start, tokens.shape[1])
            x = x + at_least_float32(rows)
        x = constrain(cast(x, self.compute_dtype), RESIDUAL)
        if self.impl.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)

            def body(x, layer):
                state, keys, values = layer
                x, layer_cache = _decode_block(nnx.merge(graphdef, state), x, KVCache(keys, values), start)
                return x, layer_cache

            x, cache = jax.lax.scan(body, x, (stacked, cache.keys, cache.values))
            cache = KVCache(*cache)
        else:
            layers = []
            for i, block in enumerate(self.blocks):
                x, layer_cache = _decode_block(block, x, KVCache(cache.keys[i], cache.values[i]), start)
                layers.append(layer_cache)
            cache = KVCache(jnp.stack([c.keys for c in layers]), jnp.stack([c.values for c in layers]))
        return self.logits(self.final_norm(x), self.head_weights()), cache

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """The tokens' embedding rows, in float32 at least (times sqrt(d_model) with `model.embed_scale`)."""
        # The table gathered to the activations' layout first (its `embed` dim whole, as FSDP
        # gathers any weight before use): left split, the lookup's output would have to be split
        # along `embed` and the batch at once, which XLA can only do by replicating it when the
        # batch is split over more axes than the table's (the stage axis, outside a pipeline).
        # Looked up in float32 at least: the lookup's gradient adds every occurrence of a token into
        # its row, which in bfloat16 parameters would lose most of a frequent token's sum.
        rows = jnp.take(constrain(at_least_float32(self.embed[...]), ("vocab", "embed")), tokens, axis=0)
        return rows * jnp.asarray(self.cfg.d_model ** 0.5, rows.dtype) if self.cfg.embed_scale else rows

    def logits(self, hidden: jax.Array, head: jax.Array) -> jax.Array:
        """The output projection: logits (batch, length, vocab) in `logits_dtype` (capped softly at
        `model.logit_softcap`, if set)."""
        logits = jnp.einsum("btd,dv->btv", hidden, cast(head, hidden.dtype), preferred_element_type=self.logits_dtype)
        if self.cfg.logit_softcap is not None:
            logits = soft_cap(logits, self.cfg.logit_softcap).astype(logits.dtype)
        return constrain(logits, ("batch", "length", "vocab"))

    def head_weights(self) -> jax.Array:
        """The output projection (embed, vocab) in the parameter dtype; the embedding transposed when tied."""
        return self.embed[...].T if self.cfg.tied_embeddings else self.head[...]

    @property
    def logits_dtype(self):
        """The dtype the output projection writes its logits in (`model.impl.logits_dtype`)."""
        return jnp.float32 if self.impl.logits_dtype == "float32" else self.compute_dtype

    def _run_blocks(self, x: jax.Array, docs: Documents | None,
                    packed: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array | None, Stats | None]:
        """The residual after the blocks, the last block's output not yet added to it, and the
        experts' `Stats` stacked over the layers with experts (None without). `packed`: packed rows'
        (segments, positions), from which the stacked layers make their `docs` (in a pipeline, each
        microbatch's travel with it through the stages), or ()."""
        if not self.impl.scan_layers:
            delta, stats, runners = None, [], {}
            for block in self.blocks:
                graphdef = nnx.graphdef(block)
                run_block = runners.setdefault(graphdef, self._block_runner(graphdef))
                x, delta, layer_stats = run_block(nnx.state(block), x, delta, docs)
                stats += [] if layer_stats is None else [layer_stats]
            return x, delta, jax.tree.map(lambda *layers: jnp.stack(layers), *stats) if stats else None
        graphdef, stacked = nnx.split(self.blocks)
        run = functools.partial(self._run_layers, graphdef)
        riders = tuple(pipeline_lib.Rider(part, ("batch", "length")) for part in packed)
        x, stats = pipeline_lib.run_layers(run, stacked, x, self.pipeline, RESIDUAL, riders)
        return x, None, stats

    def _run_layers(self, graphdef: nnx.GraphDef, x: jax.Array, layers, *, unroll: bool,
                    riders: tuple[jax.Array, ...] = ()) -> tuple[jax.Array, Stats | None]:
        """Runs the blocks in order: `layers` stacked (one nnx.State, a leading layer dim) scanned, or
        with `unroll` (a pipeline stage's layers) a sequence of per-layer states, one call each,
        passing the pending residual add as unrolled blocks do; and the experts' `Stats` stacked
        over the layers (None without). `riders`: packed rows' (segments, positions), or ()."""
        docs = documents(*riders) if riders else None
        if unroll:
            run_block = self._block_runner(graphdef)
            delta, stats = None, []
            for layer_state in layers:
                x, delta, layer_stats = run_block(layer_state, x, delta, docs)
                stats.append(layer_stats)
            return x + delta, jax.tree.map(lambda *layers: jnp.stack(layers), *stats)

        def body(carry, layer_state):
            x, delta, stats = nnx.merge(graphdef, layer_state)(carry, None, docs)
            return x + delta, stats

        return jax.lax.scan(self._remat(body), x, layers)

    def _block_runner(self, graphdef: nnx.GraphDef):
        """`run(block_state, x, pending_delta, docs)`: one block's call, a jit of its own. The blocks have
        the same shapes, so it is traced (and its kernels lowered) once, or twice with the first
        block's missing residual, not once per layer; XLA inlines the calls: the program is the same."""
        def block(state: nnx.State, carry: jax.Array, pending: jax.Array | None,
                  docs: Documents | None) -> tuple[jax.Array, jax.Array, Stats | None]:
            return nnx.merge(graphdef, state)(carry, pending, docs)

        return jax.jit(self._remat(block))  # named: profiles and HLO read jit(block)

    def _remat(self, fn):
        if self.impl.remat in ("none", "mlp"):
            return fn
        return jax.checkpoint(fn, policy=_REMAT_POLICIES[self.impl.remat], prevent_cse=not self.impl.scan_layers)
