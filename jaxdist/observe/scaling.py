"""What a recipe moves over which link on N hosts, on paper, and the layout to pick: what
`jaxdist scale` prints.

Everything here is arithmetic on the parameter count (taken from the model itself, built
abstractly) and stated hardware numbers; nothing runs on a device. Per step and per GPU:

- data axis: the gradient all-reduce of the GPU's parameter shard: 2(n-1)/n x bytes. Gradients
  cross as the compiled steps send them: the matmul weights' in the compute dtype (the dtype their
  matmuls make them in) and the rest (embedding, head, norms) in the parameter dtype;
- fsdp axis: all-gathers of the weights the model reads, in the compute dtype where compute-dtype
  copies stand in for them (`precision.compute_copies`), twice per step under
  `train.fsdp_gather: per_layer` (forward and backward: an upper bound, since XLA on GPU kept the
  forward's for the backward) and once under `per_step`; and a reduce-scatter of the gradients:
  (gathers x gathered bytes + gradient bytes) x (n-1)/n;
- tensor axis: two all-reduces per layer forward and two backward (Megatron), plus the embedding
  lookup's, of one activation (batch x length x d_model, compute dtype): 2(n-1)/n x bytes each.

An axis spread over hosts and GPUs (say data = 16 hosts x 8 GPUs) is reduced hierarchically, as
NCCL does: inside the host over NVLink, then across hosts on 1/(GPUs in the group per host) of the
bytes. Which part of each axis crosses hosts follows `mesh.split_across_hosts`, as training does.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxdist import models
from jaxdist.config import MESH_AXES, Config
from jaxdist.errors import UserError
from jaxdist.observe.metrics import PEAK_FLOPS_BF16
from jaxdist.parallel import compression
from jaxdist.parallel.mesh import split_across_hosts
from jaxdist.train.state import abstract_model

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Stated numbers for an H100 SXM host (override for other machines)."""

    gpus_per_host: int = 8
    gpu_memory: float = 80 * GB
    nvlink_bw: float = 450 * GB  # per GPU, one direction (NVLink 4: 900 GB/s both ways)
    network_bw: float = 50 * GB  # per GPU, one direction (one 400 Gb/s InfiniBand NIC per GPU)
    storage_bw: float = 2 * GB  # checkpoint write bandwidth per host (parallel filesystem client)
    peak_flops: float = PEAK_FLOPS_BF16["H100"]
    # The 406M recipe's first versions on one H100/H200 (benchmarks/reports/2026-11-26-first-one-gpu.md).
    mfu: float = 0.45
    usable_memory: float = 0.9  # of gpu_memory; XLA and CUDA keep the rest


@dataclasses.dataclass(frozen=True)
class ModelSize:
    params: int
    layers: int
    d_model: int
    heads: int
    seq_len: int
    vocab: int
    param_bytes: int
    compute_bytes: int
    remat: str
    flops_per_token: float
    loss_chunk: int = 0
    copied_params: int = 0  # parameters also kept as compute-dtype copies (precision.compute_copies)
    matmul_params: int = 0  # parameters the model reads in the compute dtype (their gradients come out in it)
    fsdp_gathers: int = 2  # all-gathers of each weight per step over fsdp (train.fsdp_gather)
    moments: int = 2  # optimizer state per parameter, in parameters' worth (the optimizer section's `moments`)
    microbatches: int = 1  # train.microbatches: activations are kept for one microbatch at a time

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the whole gradient as it crosses devices."""
        return self.matmul_params * self.compute_bytes + (self.params - self.matmul_params) * self.param_bytes

    @property
    def gathered_bytes(self) -> int:
        """Bytes of every weight once, as FSDP gathers them: the compute-dtype copies where kept."""
        return self.copied_params * self.compute_bytes + (self.params - self.copied_params) * self.param_bytes


def model_size(cfg: Config) -> ModelSize:
    """The recipe's sizes; the parameter count is read off the abstract model (nothing allocated)."""
    entry = models.get(cfg.model.name)
    if not entry.scales:
        raise UserError(f"jaxdist scale models a transformer's traffic (layers, heads, tokens per sequence); "
                        f"model.name={cfg.model.name} is not one: use a gpt config")
    abstract_params = abstract_model(entry.create(cfg), cfg.seed).params
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    param_bytes, compute_bytes = _dtype_bytes(cfg.precision.params), _dtype_bytes(cfg.precision.compute)
    matmul = 0
    if entry.read_in_compute_dtype is not None:
        matmul = sum(math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
                     if entry.read_in_compute_dtype(path))
    copied = matmul if cfg.precision.compute_copies and compute_bytes != param_bytes else 0
    m = cfg.model
    return ModelSize(
        params=params, layers=m.layers, d_model=m.d_model, heads=m.heads, seq_len=m.seq_len, vocab=m.vocab,
        param_bytes=param_bytes, compute_bytes=compute_bytes, remat=m.impl.remat,
        flops_per_token=entry.flops_per_example(cfg) / m.seq_len, loss_chunk=m.impl.loss_chunk,
        copied_params=copied, matmul_params=matmul, fsdp_gathers=1 if cfg.train.fsdp_gather == "per_step" else 2,
        moments=cfg.optim.moments, microbatches=cfg.train.microbatches,
    )


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """Bytes one GPU sends per step for one mesh axis, split by link."""

    network: float
    nvlink: float


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    shape: dict[str, int]
    across: dict[str, int]
    batch_per_shard: float  # sequences per (data x fsdp) shard
    state_bytes: float  # params + fp32 grads + optimizer moments + compute-dtype copies, per GPU
    activation_bytes: float  # per GPU, of one microbatch, estimated
    traffic: dict[str, AxisTraffic]
    network_s: float
    nvlink_s: float
    compute_s: float
    fits: bool
    problem: str  # why the layout cannot run ("" if it can)

    @property
    def comm_s(self) -> float:
        return self.network_s + self.nvlink_s


def hierarchical_bytes(factor: float, nbytes: float, across: int, within: int) -> AxisTraffic:
    """Bytes per GPU of a collective of `nbytes` (full size) over `across` hosts x `within` GPUs each.

    `factor` is 2 for an all-reduce and 1 for an all-gather or a reduce-scatter (ring algorithms),
    times the number of such collectives per step.
    """
    nvlink = factor * (within - 1) / within * nbytes
    network = factor * (across - 1) / across * nbytes / within
    return AxisTraffic(network=network, nvlink=nvlink)


def layout_cost(model: ModelSize, hw: Hardware, hosts: int, shape: dict[str, int], global_batch: int) -> LayoutCost:
    """Memory, traffic per axis and times of one layout (an axis-size dict) for this model and batch."""
    across, within = split_across_hosts(shape, hosts)
    data, fsdp, tensor = shape["data"], shape["fsdp"], shape["tensor"]
    gpus = math.prod(shape.values())
    batch_per_shard = global_batch / (data * fsdp)
    shard_params = model.params / (fsdp * tensor)
    # fp32 gradients (summed and clipped in fp32), the optimizer's moments in the parameter dtype, and
    # the compute-dtype copies, split as their parameters (train.fsdp_gather=per_layer).
    state = (shard_params * ((1 + model.moments) * model.param_bytes + 4)
             + model.copied_params / (fsdp * tensor) * model.compute_bytes)
    activation = activation_bytes_per_sequence(model, tensor) * batch_per_shard / model.microbatches
    grad_bytes = model.gradient_bytes / tensor
    traffic = {
        "data": hierarchical_bytes(2, grad_bytes / fsdp, across["data"], within["data"]),
        "fsdp": _sum(
            hierarchical_bytes(model.fsdp_gathers, model.gathered_bytes / tensor, across["fsdp"], within["fsdp"]),
            hierarchical_bytes(1, grad_bytes, across["fsdp"], within["fsdp"]),
        ),
        "tensor": _scale(
            hierarchical_bytes(2, batch_per_shard * model.seq_len * model.d_model * model.compute_bytes,
                               across["tensor"], within["tensor"]),
            4 * model.layers + 2,
        ),
    }
    network = sum(t.network for t in traffic.values())
    nvlink = sum(t.nvlink for t in traffic.values())
    compute = model.flops_per_token * global_batch * model.seq_len / gpus / (hw.mfu * hw.peak_flops)
    problem = ""
    if global_batch % (data * fsdp):
        problem = f"global batch {global_batch} not divisible by data x fsdp = {data * fsdp}"
    elif batch_per_shard % model.microbatches:
        problem = f"{batch_per_shard:.0f} sequences per shard not divisible by train.microbatches = {model.microbatches}"
    elif model.heads % tensor:
        problem = f"{model.heads} heads not divisible by tensor = {tensor}"
    elif state + activation > hw.usable_memory * hw.gpu_memory:
        problem = f"needs {(state + activation) / GB:.0f} GB per GPU"
    return LayoutCost(
        shape=shape, across=across, batch_per_shard=batch_per_shard, state_bytes=state,
        activation_bytes=activation, traffic=traffic, network_s=network / hw.network_bw,
        nvlink_s=nvlink / hw.nvlink_bw, compute_s=compute, fits=not problem, problem=problem,
    )


def compressed_payloads(cfg: Config) -> dict[str, float]:
    """Bytes of the whole gradient as each `train.grad_compression` sends it (none: as the
    gradients come out, in their dtypes; powersgd: float32 rank-r factors and the vectors
    exactly; int8: a byte a number plus the block scales)."""
    entry = models.get(cfg.model.name)
    abstract = abstract_model(entry.create(cfg), cfg.seed)
    payloads = {}
    for method in compression.METHODS[1:]:
        chosen = compression.Compression(method, ("data",), cfg.train.grad_compression_rank)
        plans = compression.leaf_plans(abstract.params, abstract.names, abstract.roles, chosen)
        payloads[method] = compression.bytes_sent(plans, chosen)[1]
    return payloads


def compression_lines(cfg: Config, model: ModelSize, hw: Hardware, chosen: LayoutCost) -> list[str]:
    """Each gradient compression's bytes over the chosen layout's data axis and the step time it
    predicts (compute plus all communication, not overlapped: an upper bound)."""
    across, within = chosen.across["data"], chosen.shape["data"] // chosen.across["data"]
    exact = chosen.traffic["data"]
    lines = [f"gradient compression over the data axis (train.grad_compression; powersgd rank "
             f"{cfg.train.grad_compression_rank}): bytes per GPU per step and the step it predicts",
             f"  {'method':<9} {'sent GB':>8} {'net GB':>7} {'net ms':>7} {'step ms':>8}"]
    payloads = {"none": model.gradient_bytes / (chosen.shape["fsdp"] * chosen.shape["tensor"]),
                **{method: size / chosen.shape["tensor"] for method, size in compressed_payloads(cfg).items()}}
    for method, payload in payloads.items():
        traffic = exact if method == "none" else hierarchical_bytes(2, payload, across, within)
        others = chosen.comm_s - exact.network / hw.network_bw - exact.nvlink / hw.nvlink_bw
        step = chosen.compute_s + others + traffic.network / hw.network_bw + traffic.nvlink / hw.nvlink_bw
        lines.append(f"  {method:<9} {payload / GB:>8.3f} {traffic.network / GB:>7.3f} "
                     f"{traffic.network / hw.network_bw * 1e3:>7.2f} {step * 1e3:>8.1f}")
    return lines


def expert_lines(cfg: Config, model: ModelSize, hw: Hardware, tokens_per_gpu: int) -> list[str]:
    """A mixture of experts' weights per GPU and the all-to-all bytes each GPU sends per step, for
    each `mesh.expert` within a host that divides the experts (none for a dense model). The bytes
    are what the exchange sends: buffers of every assignment of the GPU's tokens for each other
    expert GPU (models/layers/moe.py), there and back, forward and backward, each MoE layer."""
    moe = cfg.model.moe
    if not moe.experts:
        return []
    layers = sum(moe.is_moe(layer) for layer in range(cfg.model.layers))
    per_expert = (3 if cfg.model.activation == "swiglu" else 2) * model.d_model * cfg.model.expert_hidden
    expert_bytes = layers * moe.experts * per_expert * model.param_bytes
    assignments = tokens_per_gpu * moe.experts_per_token
    lines = ["", f"mixture of experts: {layers} MoE layers of {moe.experts} experts, {moe.experts_per_token} per token; "
                 f"expert weights {expert_bytes / GB:.2f} GB in all"]
    for size in (n for n in (1, 2, 4, 8, 16) if n <= hw.gpus_per_host and moe.experts % n == 0):
        sent = 4 * layers * (size - 1) * assignments * model.d_model * model.compute_bytes
        lines.append(f"  mesh.expert={size}: expert weights {expert_bytes / size / GB:.2f} GB per GPU; all-to-all "
                     f"{sent / GB:.2f} GB per GPU per step, {sent / hw.nvlink_bw * 1e3:.1f} ms over NVLink")
    return lines


def _sum(a: AxisTraffic, b: AxisTraffic) -> AxisTraffic:
    return AxisTraffic(a.network + b.network, a.nvlink + b.nvlink)


def _scale(a: AxisTraffic, times: float) -> AxisTraffic:
    return AxisTraffic(a.network * times, a.nvlink * times)


def activation_bytes_per_sequence(model: ModelSize, tensor: int) -> float:
    """Activations kept for the backward pass, per sequence (Korthikanti et al. 2022, flash attention).

    Per layer s*d*(10 + 24/t) bytes at 16-bit activations (no s^2 scores: flash attention), scaled
    for fp32 compute; with full remat only each layer's input is kept, with remat=mlp the MLP
    activation's output (8/t of the 24/t) is recomputed. Plus fp32 logits and their gradient (vocab
    split over tensor), for `loss_chunk` positions at a time when the loss is chunked.
    """
    s, d = model.seq_len, model.d_model
    scale = model.compute_bytes / 2
    per_layer = s * d * (10 + (16 if model.remat == "mlp" else 24) / tensor) * scale
    if model.remat == "full":
        layers = model.layers * s * d * model.compute_bytes + per_layer
    else:
        layers = model.layers * per_layer
    return layers + 8 * (model.loss_chunk or s) * model.vocab / tensor


def candidate_shapes(hosts: int, gpus_per_host: int) -> list[dict[str, int]]:
    """Data parallel everywhere; data over hosts with fsdp x tensor inside a host; fsdp everywhere."""
    gpus = hosts * gpus_per_host
    shapes = [{"data": gpus, "stage": 1, "fsdp": 1, "expert": 1, "tensor": 1}]
    tensor = 1
    while tensor <= gpus_per_host:
        if gpus_per_host % tensor == 0:
            shapes.append({"data": hosts, "stage": 1, "fsdp": gpus_per_host // tensor, "expert": 1, "tensor": tensor})
        tensor *= 2
    if hosts > 1:
        shapes.append({"data": 1, "stage": 1, "fsdp": gpus, "expert": 1, "tensor": 1})
    unique = []
    for shape in shapes:
        if shape not in unique:
            unique.append(shape)
    return unique


def with_accumulation(model: ModelSize, hw: Hardware, hosts: int, gpus_per_host: int,
                      global_batch: int) -> tuple[int, LayoutCost] | None:
    """The fewest `train.microbatches` (more than the model's, dividing a shard's batch) with which a
    candidate layout fits, and the layout `choose` takes with it; None if none does."""
    shapes = candidate_shapes(hosts, gpus_per_host)
    most = max(global_batch // (shape["data"] * shape["fsdp"]) for shape in shapes)
    for count in range(model.microbatches + 1, most + 1):
        accumulating = dataclasses.replace(model, microbatches=count)
        chosen = choose([layout_cost(accumulating, hw, hosts, shape, global_batch) for shape in shapes])
        if chosen is not None:
            return count, chosen
    return None


def choose(costs: list[LayoutCost]) -> LayoutCost | None:
    """The layout that fits and spends the least time communicating (ties: less tensor parallelism)."""
    fitting = [cost for cost in costs if cost.fits]
    return min(fitting, key=lambda c: (round(c.comm_s, 6), c.shape["tensor"])) if fitting else None


@dataclasses.dataclass(frozen=True)
class CheckpointCost:
    total_bytes: float
    per_host_replica_parallel: float  # every host writes an equal slice of replicated arrays
    per_host_primary_replica: float  # only the hosts of data replica 0 write
    write_s_replica_parallel: float
    write_s_primary_replica: float


def checkpoint_cost(model: ModelSize, hw: Hardware, hosts: int, layout: LayoutCost) -> CheckpointCost:
    """Checkpoint size (params + optimizer moments) and the write per host under the two Orbax policies."""
    total = model.params * (1 + model.moments) * model.param_bytes
    writers = hosts // layout.across["data"]
    per_host_parallel = total / hosts
    per_host_primary = total / writers
    return CheckpointCost(total, per_host_parallel, per_host_primary,
                          per_host_parallel / hw.storage_bw, per_host_primary / hw.storage_bw)


def describe_shape(shape: dict[str, int]) -> str:
    return " ".join(f"{axis}={shape[axis]}" for axis in MESH_AXES if shape.get(axis, 1) > 1) or "one device"


def report(cfg: Config, hosts: int, gpus_per_host: int = 8, batch_per_gpu: int | None = None,
           hw: Hardware | None = None) -> str:
    """The scaling numbers for this recipe on `hosts` hosts, as text."""
    if hosts < 1:
        raise UserError(f"scale --hosts {hosts}: give a positive number of hosts")
    if gpus_per_host < 1:
        raise UserError(f"scale --gpus-per-host {gpus_per_host}: give a positive number")
    hw = dataclasses.replace(hw or Hardware(), gpus_per_host=gpus_per_host)
    model = model_size(cfg)
    gpus = hosts * gpus_per_host
    per_gpu = batch_per_gpu or cfg.train.global_batch
    global_batch = per_gpu * gpus
    costs = [layout_cost(model, hw, hosts, shape, global_batch) for shape in candidate_shapes(hosts, gpus_per_host)]
    chosen = choose(costs)
    tokens = global_batch * model.seq_len
    lines = [
        f"{cfg.model.name}: {model.params / 1e6:,.1f}M parameters ({model.layers} layers, d_model {model.d_model}, "
        f"seq {model.seq_len}, params {cfg.precision.params}, compute {cfg.precision.compute})",
        f"optimizer {cfg.optim.name}: {model.moments} parameter-sized moment(s); train.microbatches "
        f"{model.microbatches} (activations are kept for one microbatch at a time)",
        f"{hosts} host(s) x {gpus_per_host} GPUs = {gpus} GPUs; global batch {global_batch} sequences "
        f"({per_gpu} per GPU) = {tokens / 1e6:.2f}M tokens per step",
        f"assumed: NVLink {hw.nvlink_bw / GB:.0f} GB/s and network {hw.network_bw / GB:.0f} GB/s per GPU per "
        f"direction; {hw.gpu_memory / GB:.0f} GB per GPU; {hw.peak_flops / 1e12:.0f} TFLOP/s at "
        f"{hw.mfu:.0%} MFU; storage {hw.storage_bw / GB:.1f} GB/s per host",
        f"gradients cross devices as {model.gradient_bytes / GB:.2f} GB; fsdp gathers {model.gathered_bytes / GB:.2f} GB of weights "
        f"{model.fsdp_gathers}x per step (train.fsdp_gather {cfg.train.fsdp_gather})",
        "",
        f"{'layout':<28} {'state GB':>8} {'act GB':>7} {'net GB':>7} {'nvl GB':>7} {'net ms':>7} "
        f"{'nvl ms':>7} {'compute ms':>10}  verdict",
    ]
    for cost in costs:
        verdict = "<- chosen" if cost is chosen else ("fits" if cost.fits else cost.problem)
        net = sum(t.network for t in cost.traffic.values())
        nvl = sum(t.nvlink for t in cost.traffic.values())
        lines.append(
            f"{describe_shape(cost.shape):<28} {cost.state_bytes / GB:>8.2f} {cost.activation_bytes / GB:>7.2f} "
            f"{net / GB:>7.3f} {nvl / GB:>7.3f} {cost.network_s * 1e3:>7.2f} {cost.nvlink_s * 1e3:>7.2f} "
            f"{cost.compute_s * 1e3:>10.1f}  {verdict}"
        )
    if chosen is None:
        lines.append("no candidate layout fits: use pipeline stages, remat (model.impl.remat=full) or a smaller batch")
        accumulated = with_accumulation(model, hw, hosts, gpus_per_host, global_batch)
        if accumulated is not None:
            count, cost = accumulated
            lines.append(f"or accumulate: train.microbatches={count} fits {describe_shape(cost.shape)} "
                         f"({cost.activation_bytes / GB:.2f} GB of activations per microbatch)")
        return "\n".join(lines)
    lines += ["", f"chosen layout {describe_shape(chosen.shape)}: bytes per GPU per step, by axis and link"]
    for axis in ("data", "fsdp", "tensor"):
        if chosen.shape.get(axis, 1) > 1:
            t = chosen.traffic[axis]
            place = f"{chosen.across[axis]} host(s) x {chosen.shape[axis] // chosen.across[axis]} GPU(s)"
            lines.append(f"  {axis:<7} ({place}): between hosts {t.network / GB:.3f} GB, "
                         f"inside a host {t.nvlink / GB:.3f} GB")
    ckpt = checkpoint_cost(model, hw, hosts, chosen)
    lines += ["", *compression_lines(cfg, model, hw, chosen)]
    lines += expert_lines(cfg, model, hw, global_batch * model.seq_len // gpus)
    lines += [
        "",
        f"checkpoint: {ckpt.total_bytes / GB:.2f} GB (params + {cfg.optim.name} state, {cfg.precision.params})",
        f"  per host, replica-parallel writes: {ckpt.per_host_replica_parallel / GB:.3f} GB, "
        f"{ckpt.write_s_replica_parallel:.2f} s",
        f"  per host, data replica 0 writes alone: {ckpt.per_host_primary_replica / GB:.3f} GB, "
        f"{ckpt.write_s_primary_replica:.2f} s",
        "",
        "limits:",
        f"  smallest global batch for this layout: {chosen.shape['data'] * chosen.shape['fsdp']} sequences "
        f"({chosen.shape['data'] * chosen.shape['fsdp'] * model.seq_len / 1e6:.2f}M tokens)",
        f"  communication / compute per step: {chosen.comm_s * 1e3:.1f} ms / {chosen.compute_s * 1e3:.1f} ms"
        + ("  (communication-bound unless overlapped)" if chosen.comm_s > chosen.compute_s else ""),
        f"  processes (one per GPU) joining one coordinator: {gpus}",
    ]
    return "\n".join(lines)
