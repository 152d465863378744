"""Mixture of experts: a router sends each token to `k` of `E` expert MLPs (and to the shared ones).

Routers, in float32 (`MoEConfig.router`):

- softmax (Mixtral, Qwen3-MoE): the top k of softmax(logits), renormalized over the k where asked;
- sigmoid (DeepSeek-V3): the top k of sigmoid(logits) + a per-expert bias, the bias only choosing
  (the weights are the sigmoids, renormalized where asked, times `routed_scale`); the bias balances
  the load without an auxiliary loss: after each step it moves by `bias_rate` towards the experts
  that got fewer tokens than the mean (`RouterBias`, updated outside the gradient). With `groups`,
  the experts fall into that many groups and each token chooses among the `top_groups` groups
  whose two best experts score most (DeepSeek-V3's group-limited routing: 8 groups, 4 chosen).

Dropless by default: each device sorts its tokens' assignments by expert and runs its experts as
one grouped matmul (kernels/grouped_matmul.py), so no token is dropped and the result does not depend on
the layout. With `capacity_factor`, each expert takes at most `capacity_factor x tokens x k / E`
assignments of a call's tokens, in the tokens' order (row, position, then the token's choices in
rank order), the rest dropped: the dropped share is reported.

Expert parallelism: the experts' leading `experts` axis is split over the mesh axes its rule names
(the `expert` axis); the batch is split over them too, so each device routes its own tokens and
sends each assignment to the device holding its expert (one all-to-all there and one back, of
buffers sized for the worst case: all of a device's assignments to one device), where the local
experts run on what they received. The experts' hidden width may be split over `tensor` (one sum
after the down projection). It runs in `jax.shard_map` over the whole mesh, so it composes with
the other axes, the pipeline's stages and the accumulation's batch shards.

Statistics (per layer, sums over the call's counted tokens, so that microbatches, stages and batch
shards add up to the whole batch's): the tokens each expert got, the router's probabilities summed
per expert, the squared log-sum-exp of the logits (z-loss) and the assignments dropped. The
auxiliary loss is computed from them after the layers (`aux_loss`, as Switch and Mixtral define it).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec
from pydantic import Field, model_validator

from jaxdist.config import Section
from jaxdist.kernels import grouped_matmul
from jaxdist.models.layers.common import NORMAL, RESIDUAL, cast, param
from jaxdist.models.loss import Loss
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.rules import constrain

if TYPE_CHECKING:
    from jaxdist.models.gpt.config import GPTConfig, ImplConfig

# The logical names of the experts' parameters: the expert axis, and the experts' hidden width.
EXPERTS, EXPERT_MLP = "experts", "expert_mlp"


class MoEConfig(Section):
    """`model.moe`: a mixture of experts in place of the MLP of some layers (`experts: 0`: none)."""

    experts: int = Field(0, ge=0, description="routed experts per MoE layer (0: every layer has the dense MLP)")
    experts_per_token: int = Field(2, gt=0, description="experts each token is sent to (top k)")
    expert_hidden: int | None = Field(None, gt=0, description="each expert's hidden width; null: the MLP's")
    shared_experts: int = Field(0, ge=0, description="experts every token goes through beside the routed ones")
    first_dense: int = Field(0, ge=0, description="the first layers keep the dense MLP (DeepSeek-V3: 3)")
    every: int = Field(1, gt=0, description="after those, layer i (from 0) is MoE where (i + 1) % every == 0")
    router: Literal["softmax", "sigmoid"] = Field("softmax", description="softmax top-k, or sigmoid with a bias")
    renormalize: bool = Field(True, description="the k weights divided by their sum")
    routed_scale: float = Field(1.0, gt=0, description="the routed experts' output scaled by this (DeepSeek-V3)")
    aux_loss: float = Field(0.0, ge=0, description="load-balancing loss coefficient (Switch; Mixtral's 0.02)")
    z_loss: float = Field(0.0, ge=0, description="router z-loss coefficient (ST-MoE's 0.001)")
    bias_rate: float = Field(0.0, ge=0, description="sigmoid router: the bias step towards a balanced load")
    groups: int = Field(1, gt=0, description="sigmoid router: groups of experts, chosen among first (DeepSeek-V3: 8)")
    top_groups: int = Field(1, gt=0, description="the groups each token's experts come from (DeepSeek-V3: 4)")
    capacity_factor: float | None = Field(
        None, gt=0, description="null: dropless; else each expert takes at most this x tokens x k / experts")

    @model_validator(mode="after")
    def _combinations(self) -> MoEConfig:
        if self.experts and self.experts_per_token > self.experts:
            raise ValueError(f"model.moe.experts_per_token={self.experts_per_token} is more than "
                             f"model.moe.experts={self.experts}")
        if self.bias_rate and self.router != "sigmoid":
            raise ValueError("model.moe.bias_rate balances the sigmoid router's bias: set model.moe.router=sigmoid")
        if self.groups > 1:
            if self.router != "sigmoid" or self.experts % self.groups or self.top_groups > self.groups:
                raise ValueError(f"model.moe.groups={self.groups} groups the sigmoid router's experts: it needs "
                                 f"model.moe.router=sigmoid, model.moe.experts={self.experts} divisible by it and "
                                 f"model.moe.top_groups={self.top_groups} at most it")
            if self.experts // self.groups < 2 or self.experts_per_token > self.top_groups * self.experts // self.groups:
                raise ValueError(f"model.moe.groups={self.groups}: each group is scored by its two best experts, "
                                 f"and model.moe.top_groups={self.top_groups} groups must hold "
                                 f"model.moe.experts_per_token={self.experts_per_token} experts")
        return self

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has experts."""
        return bool(self.experts) and layer >= self.first_dense and (layer + 1) % self.every == 0


class Routing(NamedTuple):
    """Each token's `k` experts (int32) and their weights (float32), and what the statistics read:
    the router's probabilities (softmax or sigmoid, float32) and logits."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits: jax.Array, cfg: MoEConfig, bias: jax.Array | None = None) -> Routing:
    """The routing of tokens whose router logits (tokens, E) are `logits` (float32)."""
    logits = logits.astype(jnp.float32)
    k = cfg.experts_per_token
    if cfg.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, k)
    else:
        probs = jax.nn.sigmoid(logits)
        choice = probs if bias is None else probs + bias.astype(jnp.float32)
        if cfg.groups > 1:
            choice = _within_top_groups(choice, cfg.groups, cfg.top_groups)
        _, experts = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights * cfg.routed_scale, probs, logits)


def _within_top_groups(choice: jax.Array, groups: int, top_groups: int) -> jax.Array:
    """`choice` (tokens, E) with the experts outside each token's `top_groups` best groups (a group's
    score: its two best experts') at -inf."""
    grouped = choice.reshape(*choice.shape[:-1], groups, -1)
    _, best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), top_groups)
    chosen = jax.nn.one_hot(best, groups, dtype=bool).any(-2)  # (tokens, groups)
    return jnp.where(chosen[..., None], grouped, -jnp.inf).reshape(choice.shape)


class Stats(NamedTuple):
    """A MoE layer's sums over the counted tokens of a call: `tokens` (scalar), the assignments each
    expert got (`load`, E), the router's probabilities summed per expert (`probs`, E), the squared
    log-sum-exp of the logits (`z`) and the assignments dropped (`dropped`). They add over parts of
    a batch."""

    tokens: jax.Array
    load: jax.Array
    probs: jax.Array
    z: jax.Array
    dropped: jax.Array


def statistics(routing: Routing, counted: jax.Array, kept: jax.Array, experts: int) -> Stats:
    """The `Stats` of `routing` over the tokens where `counted` (tokens,) is 1; `kept` (tokens, k):
    the assignments an expert took (all, dropless)."""
    counted = counted.astype(jnp.float32)
    chosen = jax.nn.one_hot(routing.experts, experts, dtype=jnp.float32) * counted[:, None, None]
    return Stats(
        tokens=counted.sum(),
        load=chosen.sum((0, 1)),
        probs=(routing.probs * counted[:, None]).sum(0),
        z=(jax.nn.logsumexp(routing.logits, axis=-1) ** 2 * counted).sum(),
        dropped=((1 - kept.astype(jnp.float32)) * counted[:, None]).sum(),
    )


def aux_loss(stats: Stats) -> jax.Array:
    """The load-balancing loss of one layer's `Stats`: E x sum_e f_e P_e, with f_e the tokens sent to
    expert e over all tokens (summed over the k choices, so a balanced router gives k, as Mixtral's
    `load_balancing_loss_func`) and P_e its mean router probability (Switch Transformers, eq. 4)."""
    tokens = jnp.maximum(stats.tokens, 1)[..., None]
    return stats.load.shape[-1] * jnp.sum((stats.load / tokens) * (stats.probs / tokens), axis=-1)


def z_loss(stats: Stats) -> jax.Array:
    """ST-MoE's router z-loss of one layer's `Stats`: the mean over tokens of logsumexp(logits)^2."""
    return stats.z / jnp.maximum(stats.tokens, 1)


def with_penalty(loss: Loss, stats: Stats, cfg: MoEConfig, layers: list[int]) -> Loss:
    """`loss` with the experts' auxiliary and z losses (each the mean over the MoE layers, times its
    coefficient) added per unit of weight, and the experts' metrics. `stats` are the call's, stacked
    over the MoE layers, `layers` their numbers in the model."""
    aux, z = aux_loss(stats).mean(), z_loss(stats).mean()
    penalty = cfg.aux_loss * aux + cfg.z_loss * z
    metrics = _metrics(jax.lax.stop_gradient(stats), jax.lax.stop_gradient(aux), jax.lax.stop_gradient(z), layers,
                       loss.weight)
    return Loss(loss.total + loss.weight * penalty, loss.weight, {**loss.metrics, **metrics})


def _metrics(stats: Stats, aux: jax.Array, z: jax.Array, layers: list[int], weight: jax.Array) -> dict[str, jax.Array]:
    """The experts' metrics as weighted sums (reported divided by the weight): the losses, the share
    of assignments dropped, and per layer the most and least loaded expert against the mean load."""
    load = stats.load / jnp.maximum(stats.load.mean(-1, keepdims=True), 1e-9)
    most, least = load.max(-1), load.min(-1)
    assigned = jnp.maximum(stats.load.sum() + stats.dropped.sum(), 1)
    metrics = {"moe_aux_loss": aux, "moe_z_loss": z, "moe_dropped": stats.dropped.sum() / assigned,
               "moe_load_max": most.max(), "moe_load_min": least.min()}
    for i, layer in enumerate(layers):
        metrics[f"moe_load_max_{layer}"], metrics[f"moe_load_min_{layer}"] = most[i], least[i]
    return {name: value * weight for name, value in metrics.items()}


def capacity(cfg: MoEConfig, tokens: int) -> int:
    """The most assignments an expert takes of a call's `tokens` tokens under `capacity_factor`."""
    return max(1, math.ceil(cfg.capacity_factor * tokens * cfg.experts_per_token / cfg.experts))


class RouterBias(nnx.Variable):
    """The sigmoid router's per-expert bias (DeepSeek-V3's auxiliary-loss-free balancing): it only
    chooses experts, and moves after each step, not by the gradient."""


class Dispatch(NamedTuple):
    """Where a MoE layer runs on the mesh: the mesh axes of the tokens' batch and sequence dims, of
    the experts (`experts`) and of their hidden width (`hidden`). Empty outside a step's rules."""

    batch: tuple[str, ...] = ()
    seq: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()

    @classmethod
    def active(cls) -> tuple[Dispatch, object | None]:
        """The dispatch under the enclosing `rules.activation_rules`, and its mesh (None outside)."""
        active = rules_lib.active()
        if active is None:
            return cls(), None
        mesh, rules = active
        return cls(tuple(rules.activations.get("batch", ())), tuple(rules.activations.get("seq", ())),
                   tuple(rules.params.get(EXPERTS, ())), tuple(rules.params.get(EXPERT_MLP, ()))), mesh


def _expert_mlp(x: jax.Array, groups: jax.Array, weights: tuple[jax.Array, ...], impl: str) -> jax.Array:
    """The experts' MLP on rows sorted by expert, `groups[e]` rows each (rows after them give 0):
    `weights` (up, down) of a GELU MLP or (up, gate, down) of a SwiGLU one, each (experts, ...);
    `impl` the grouped matmul's (`model.impl.grouped_matmul_impl`)."""
    up, *gate, down = weights
    h = grouped_matmul.grouped(x, up, groups, impl)
    if gate:
        h = jax.nn.silu(grouped_matmul.grouped(x, gate[0], groups, impl)) * h
    else:
        h = jax.nn.gelu(h, approximate=True)
    return grouped_matmul.grouped(h, down, groups, impl)


def _grouped(x: jax.Array, local_ids: jax.Array, local_experts: int, weights, impl: str) -> jax.Array:
    """The local experts' outputs for rows `x` (rows, d) each bound for expert `local_ids` (rows,)
    (`local_experts`: no expert, the row gives 0): sorted by expert, run grouped, unsorted."""
    order = jnp.argsort(local_ids, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    groups = jnp.bincount(local_ids, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    out = _expert_mlp(_permuted(x, order, inverse), groups, weights, impl)
    return _permuted(out, inverse, order)


@jax.custom_vjp
def _permuted(x: jax.Array, permutation: jax.Array, inverse: jax.Array) -> jax.Array:
    """`x[permutation]` whose gradient is the cotangent's rows put back by `inverse`, a gather: the
    transpose autodiff gives a gather is a scatter-add, which XLA's GPU backend runs with atomics."""
    return x[permutation]


def _permuted_forward(x, permutation, inverse):
    return x[permutation], (permutation, inverse)


def _permuted_backward(residuals, cotangent):
    permutation, inverse = residuals
    zero = np.zeros(permutation.shape, jax.dtypes.float0)
    return cotangent[inverse], zero, zero


_permuted.defvjp(_permuted_forward, _permuted_backward)


def _local(x, experts, weights, mlp: tuple[jax.Array, ...], *, dispatch: Dispatch, num_experts: int, impl: str):
    """One device's part of the routed experts (inside `jax.shard_map` over the whole mesh): `x`
    (b, l, d) its tokens, `experts`/`weights` (b, l, k) their assignments (`num_experts` where
    dropped), `mlp` its experts' weights (E / ep, ...), as `_expert_mlp` takes them."""
    b, l, d = x.shape
    k = experts.shape[-1]
    tokens = x.reshape(b * l, d)
    chosen = experts.reshape(-1)  # the assignments, token by token: assignment j is token j // k's
    rows = jnp.repeat(jnp.arange(b * l), k)  # each assignment's token
    local_experts = mlp[0].shape[0]
    ep = num_experts // local_experts
    if ep == 1:
        out = _grouped(jnp.repeat(tokens, k, axis=0), chosen, local_experts, mlp, impl)
    elif set(dispatch.experts) <= set(dispatch.batch):
        out = _exchanged(tokens, rows, chosen, local_experts, ep, dispatch.experts, mlp, impl)
    else:  # every expert device holds the same tokens: each computes its experts' part, summed after
        here = jax.lax.axis_index(dispatch.experts) * local_experts
        mine = (chosen >= here) & (chosen < here + local_experts)
        out = _grouped(jnp.repeat(tokens, k, axis=0), jnp.where(mine, chosen - here, local_experts), local_experts,
                       mlp, impl)
        out = jax.lax.psum(out, dispatch.experts)
    if dispatch.hidden:
        out = jax.lax.psum(out, dispatch.hidden)
    # Each token's k outputs are adjacent: weighed and summed, no scatter.
    combined = (out.astype(jnp.float32).reshape(b * l, k, -1) * weights.reshape(b * l, k, 1)).sum(1)
    return combined.astype(x.dtype).reshape(b, l, d)


def _exchanged(tokens, rows, chosen, local_experts: int, ep: int, axes: tuple[str, ...], mlp, impl: str) -> jax.Array:
    """The routed outputs of this device's assignments (in their order) when the experts are split
    over `axes` (`ep` devices) and so are the tokens: each assignment sent to its expert's device and
    back, in buffers of every assignment this device has (the most one device can receive of it)."""
    count = chosen.shape[0]
    kept = chosen < ep * local_experts
    device = jnp.where(kept, chosen // local_experts, ep)  # ep: dropped, sent nowhere
    order = jnp.argsort(device, stable=True)
    starts = jnp.cumsum(jnp.bincount(device, length=ep + 1)) - jnp.bincount(device, length=ep + 1)
    slot = jnp.zeros(count, jnp.int32).at[order].set(jnp.arange(count, dtype=jnp.int32) - starts[device[order]])
    send = jnp.zeros((ep + 1, count, tokens.shape[-1]), tokens.dtype).at[device, slot].set(tokens[rows])[:ep]
    send_ids = jnp.full((ep + 1, count), local_experts, jnp.int32).at[device, slot].set(
        chosen - device * local_experts)[:ep]
    received = jax.lax.all_to_all(send, axes, 0, 0)
    received_ids = jax.lax.all_to_all(send_ids, axes, 0, 0)
    out = _grouped(received.reshape(ep * count, -1), received_ids.reshape(-1), local_experts, mlp, impl)
    back = jax.lax.all_to_all(out.reshape(ep, count, -1), axes, 0, 0)
    return jnp.where(kept[:, None], back[jnp.minimum(device, ep - 1), slot], 0)


class MoE(nnx.Module):
    """The routed experts (and the shared ones) of one layer: `__call__(x, counted)` gives the
    output (batch, length, embed) and the layer's `Stats`; `counted` (batch, length) marks the tokens
    that count (None: all), the others routed to no expert."""

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs):
        moe = cfg.moe
        self.cfg, self.impl = moe, impl.grouped_matmul_impl
        hidden = moe.expert_hidden or cfg.mlp_dim
        experts, d = moe.experts, cfg.d_model
        self.router = param(rngs, NORMAL, (d, experts), ("embed", None), param_dtype)
        down_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.up = param(rngs, NORMAL, (experts, d, hidden), (EXPERTS, "embed", EXPERT_MLP), param_dtype)
        if cfg.activation == "swiglu":
            self.gate = param(rngs, NORMAL, (experts, d, hidden), (EXPERTS, "embed", EXPERT_MLP), param_dtype)
        self.down = param(rngs, down_init, (experts, hidden, d), (EXPERTS, EXPERT_MLP, "embed"), param_dtype)
        if moe.router == "sigmoid":
            self.bias = RouterBias(jnp.zeros((experts,), jnp.float32), out_sharding=(None,))
        if moe.shared_experts:
            shared = hidden * moe.shared_experts
            self.shared_up = param(rngs, NORMAL, (d, shared), ("embed", "mlp"), param_dtype)
            if cfg.activation == "swiglu":
                self.shared_gate = param(rngs, NORMAL, (d, shared), ("embed", "mlp"), param_dtype)
            self.shared_down = param(rngs, down_init, (shared, d), ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array, counted: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        routing = route(logits, self.cfg, self.bias[...] if hasattr(self, "bias") else None)
        counted = jnp.ones(x.shape[:2], jnp.float32) if counted is None else counted.astype(jnp.float32)
        kept = self._kept(routing, counted)
        stats = statistics(Routing(*(a.reshape(-1, a.shape[-1]) for a in routing)), counted.reshape(-1),
                           kept.reshape(-1, kept.shape[-1]), self.cfg.experts)
        experts = jnp.where(kept, routing.experts, self.cfg.experts)
        out = self._routed(x, experts, routing.weights)
        if hasattr(self, "shared_up"):
            out = out + self._shared(x)
        return constrain(out, RESIDUAL), stats

    def _kept(self, routing: Routing, counted: jax.Array) -> jax.Array:
        """(batch, length, k): the assignments an expert takes. Tokens that do not count take none;
        under `capacity_factor` each expert takes its first `capacity` assignments in token order."""
        kept = jnp.broadcast_to(counted[..., None] > 0, routing.experts.shape)
        if self.cfg.capacity_factor is None:
            return kept
        limit = capacity(self.cfg, int(counted.size))
        chosen = jax.nn.one_hot(routing.experts, self.cfg.experts, dtype=jnp.int32) * kept[..., None]
        flat = chosen.reshape(-1, self.cfg.experts)  # in (row, position, choice) order
        before = jnp.cumsum(flat, axis=0) - flat  # the expert's assignments ahead of this one
        return kept & ((before * flat).sum(-1) < limit).reshape(kept.shape)

    def _routed(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        dispatch, mesh = Dispatch.active()
        names = ("up", "gate", "down") if hasattr(self, "gate") else ("up", "down")
        mlp = tuple(cast(getattr(self, name)[...], x.dtype) for name in names)
        local = functools.partial(_local, dispatch=dispatch, num_experts=self.cfg.experts, impl=self.impl)
        if mesh is None:
            return local(x, experts, weights, mlp)
        tokens = PartitionSpec(rules_lib.spec_entry(dispatch.batch), rules_lib.spec_entry(dispatch.seq), None)
        expert, hidden = rules_lib.spec_entry(dispatch.experts), rules_lib.spec_entry(dispatch.hidden)
        weight_specs = tuple(PartitionSpec(expert, hidden, None) if name == "down" else PartitionSpec(expert, None, hidden)
                             for name in names)
        run = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, weight_specs), out_specs=tokens,
                            check_vma=False)
        # Rows that the batch shards do not divide (a sampled row on several devices) are padded with
        # rows routed to no expert.
        rows, shards = x.shape[0], math.prod(mesh.shape[axis] for axis in dispatch.batch)
        padding = ((0, -rows % shards), (0, 0), (0, 0))
        return run(jnp.pad(x, padding), jnp.pad(experts, padding, constant_values=self.cfg.experts),
                   jnp.pad(weights, padding), mlp)[:rows]

    def _shared(self, x: jax.Array) -> jax.Array:
        up = jnp.einsum("btd,dm->btm", x, cast(self.shared_up[...], x.dtype))
        if hasattr(self, "shared_gate"):
            up = jax.nn.silu(jnp.einsum("btd,dm->btm", x, cast(self.shared_gate[...], x.dtype))) * up
        else:
            up = jax.nn.gelu(up, approximate=True)
        up = constrain(up, ("batch", "length", "mlp"))
        return jnp.einsum("btm,md->btd", up, cast(self.shared_down[...], x.dtype))
