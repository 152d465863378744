"""Typed run configuration: YAML file + dotted overrides, validated before anything compiles.

One pydantic model per section. Unknown keys and wrong types are rejected with a `UserError`
naming the dotted key; `jaxdist.parallel.layout` adds the checks that need the devices.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxdist.errors import UserError

MESH_AXES = ("data", "stage", "fsdp", "tensor")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class MeshConfig(Section):
    """Mesh axis sizes; -1 means all remaining devices (at most one axis may say so)."""

    data: int = 1
    stage: int = 1
    fsdp: int = -1
    tensor: int = 1

    @model_validator(mode="after")
    def _sizes(self) -> MeshConfig:
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"mesh.{axis}={size}: use a positive size or -1 (fill)")
        if len(fills := [f"mesh.{axis}" for axis, size in sizes.items() if size == -1]) > 1:
            raise ValueError(f"mesh: {', '.join(fills)} are all -1, but at most one axis may be -1 (fill with "
                             f"the remaining devices)")
        return self


class RulesConfig(Section):
    """A preset of logical-axis rules, with per-name overrides for params and activations.

    Each override maps a logical name to a mesh axis, a list of mesh axes, or null (replicated).
    """

    preset: str = "fsdp_tp"
    params: dict[str, str | list[str] | None] = Field(default_factory=dict)
    activations: dict[str, str | list[str] | None] = Field(default_factory=dict)


class ModelConfig(Section):
    """The architecture: what the model computes (`impl` says how it runs)."""

    name: str = "gpt"
    # auto: the vocabulary of the configured data, resolved before the model is built
    # (`jaxdist.data.loader.resolve_vocab`).
    vocab: int | Literal["auto"] = 256
    d_model: int = Field(256, gt=0)
    layers: int = Field(4, gt=0)
    heads: int = Field(8, gt=0)
    mlp_ratio: float = Field(4.0, gt=0)
    seq_len: int = Field(256, gt=0)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    positions: Literal["learned", "rope"] = "learned"
    activation: Literal["gelu", "swiglu"] = "gelu"
    tied_embeddings: bool = False

    @field_validator("vocab", mode="before")
    @classmethod
    def _vocab(cls, value: Any) -> Any:
        # Checked here, so a bad value is one error naming the key, not one per member of the union.
        if value == "auto" or (type(value) is int and value > 0):
            return value
        raise ValueError(f"model.vocab={value!r}: use a positive number of ids, or auto (the data's vocabulary)")

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        if self.positions == "rope" and (self.d_model // self.heads) % 2:
            raise ValueError("model.positions=rope needs an even head dimension (d_model / heads)")
        return self

    @property
    def mlp_dim(self) -> int:
        return int(self.d_model * self.mlp_ratio)


class ImplConfig(Section):
    """How the model runs: layer stacking, recomputation, kernels and loss chunking.

    None of these changes the math beyond float rounding; they trade compile time, memory and speed
    (docs/performance.md says what each was measured to do).
    """

    # true: the layers stacked and run as a `lax.scan` (fast compile; needed by pipelines);
    # false: each layer its own parameters, unrolled (faster on GPU).
    scan_layers: bool = True
    # Recomputed in the backward pass: nothing (none), the MLP activation (mlp: one elementwise
    # pass, saves batch x length x mlp_dim per layer), all but matmul outputs (dots), or each block (full).
    remat: Literal["none", "mlp", "full", "dots"] = "none"
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    # Residual add + norm as one Pallas kernel each way (kernels/fused_norm.py): auto = on GPU where
    # the shapes allow, with the layers unrolled; xla = plain XLA fusions; pallas = always (errors if not possible).
    norm_impl: Literal["auto", "xla", "pallas"] = "auto"
    # The MLP's backward matmul with GELU's gradient in cuBLASLt's epilogue (kernels/gelu_matmul.py,
    # built by `jaxdist build-kernels` or train/bench on a GPU): auto = on GPU where it is built, with
    # the layers unrolled and bf16 activations; xla = a separate pass after the matmul; cublaslt =
    # always (errors if not possible).
    gelu_grad_impl: Literal["auto", "xla", "cublaslt"] = "auto"
    # dtype the output projection writes its logits in; the softmax is float32 either way.
    logits_dtype: Literal["float32", "compute"] = "float32"
    # > 0: the training and eval loss project to the vocabulary this many sequence positions at a
    # time (models/cross_entropy.py), never holding the full logits; 0: one projection.
    loss_chunk: int = Field(0, ge=0)
    # The chunked loss's softmax, per-row loss and logits gradient as one Pallas kernel per chunk
    # (kernels/softmax_grad.py): auto = on GPU where the vocabulary is whole on each device; xla = a
    # reduction and a gradient pass; pallas = always (errors if not possible). Needs loss_chunk > 0.
    loss_impl: Literal["auto", "xla", "pallas"] = "auto"
    # > 1: every layer runs on this many slices of each device's batch in turn (unrolled layers), so
    # one slice's tensor-parallel all-reduce can run while the next slice computes. For tensor
    # parallelism; beside data/fsdp axes XLA may reduce each slice's weight gradients on its own.
    batch_chunks: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _combinations(self) -> ImplConfig:
        if self.loss_impl == "pallas" and not self.loss_chunk:
            raise ValueError("impl.loss_impl=pallas needs impl.loss_chunk > 0 (the kernel runs inside the chunked loss)")
        if self.norm_impl == "pallas" and self.scan_layers:
            raise ValueError("impl.norm_impl=pallas needs impl.scan_layers=false (the fused norms run on unrolled layers)")
        if self.gelu_grad_impl == "cublaslt" and self.scan_layers:
            raise ValueError("impl.gelu_grad_impl=cublaslt needs impl.scan_layers=false")
        if self.batch_chunks > 1 and self.scan_layers:
            raise ValueError("impl.batch_chunks > 1 needs impl.scan_layers=false (the slices interleave unrolled layers)")
        return self


class DataConfig(Section):
    """Where examples come from (`stdlib`, `arrayrecord` shards or an `arrays` .npz at `path`).

    `eval_fraction` holds out that share of stdlib files or array rows (prepared shards fix their
    eval split when written); `epochs`, when set, decides `train.steps`; `workers` > 0 reads in
    that many grain worker processes (the batches are the same at any count; absl's flags are then
    marked parsed, as grain's workers need).
    """

    source: Literal["stdlib", "arrayrecord", "arrays"] = "stdlib"
    path: str | None = None
    eval_fraction: float = Field(0.01, ge=0, lt=1)
    epochs: int | None = Field(None, gt=0)
    workers: int = Field(0, ge=0)
    read_threads: int = Field(2, ge=0)
    prefetch: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.source == "stdlib" and self.path is not None:
            raise ValueError(f"data.path={self.path} is set but data.source=stdlib reads no path; drop data.path")
        if self.source != "stdlib" and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path (a prepared directory or a .npz file)")
        return self


class TrainConfig(Section):
    """`microbatches` scan steps per optimizer step; `grad_reduction` says when gradients cross devices.

    per_step: reduce once after the scan (one all-reduce/reduce-scatter per step at any
    microbatch count; each device holds its unreduced fp32 gradients, unsharded along the batch
    axes, during the scan). per_microbatch: reduce inside every scan step (k reductions per step;
    gradients stay sharded like the parameters, which is lighter on memory under FSDP).

    `fsdp_gather` says when the weights the model reads are gathered over the `fsdp` axis.
    per_layer (FSDP, ZeRO-3): XLA gathers each layer's where it is used, in the forward and again
    in the backward unless it keeps the forward's for the backward (on GPU it did, 406M GPT).
    per_step (ZeRO-2): the compute-dtype copies (`precision.compute_copies`) are gathered whole once
    per step, in the forward, and kept for the backward (PyTorch FSDP2's
    reshard_after_forward=False); XLA hoists the gather out of the microbatch scan, as the copies do
    not change inside it. The float32 weights and optimizer state stay sharded, gradients are
    reduce-scattered, and each device updates its shard only. Weights without a copy (for the GPT:
    embeddings, norms, head) are gathered where used, as under per_layer.

    A step whose loss or gradients are not finite never updates the state: it keeps the old
    parameters and optimizer state (its data is consumed). `on_nonfinite` says what the run does
    next: halt (stop without saving that step, exit code 3) or skip (go on; after
    `max_consecutive_skips` such steps in a row, halt). Under dynamic loss scaling a gradient
    overflow is the scaler's business (skipped, the scale halves) unless the scale is already 1.
    """

    steps: int = Field(300, gt=0)
    global_batch: int = Field(32, gt=0)
    microbatches: int = Field(1, gt=0)
    grad_reduction: Literal["per_step", "per_microbatch"] = "per_step"
    fsdp_gather: Literal["per_layer", "per_step"] = "per_layer"
    on_nonfinite: Literal["halt", "skip"] = "halt"
    max_consecutive_skips: int = Field(10, gt=0)


class OptimConfig(Section):
    """Optimizer, weight-decay and trust-ratio masks, clipping, schedule and batch-size LR scaling.

    `lr` is the peak learning rate at `base_batch`; `lr_scaling` rescales it to
    `train.global_batch` (linear: Goyal et al. 2017; sqrt: for adaptive optimizers). The schedule
    warms up linearly from 0 over `warmup_steps`, then holds (constant) or decays (cosine, linear)
    to `min_lr_ratio` x the peak at `train.steps`.
    """

    name: Literal["adamw", "sgd", "lamb", "lars", "adafactor"] = "adamw"
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False
    trust_ratio_norms_and_biases: bool = False
    trust_coefficient: float = Field(0.001, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = False
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch: int | None = Field(None, gt=0)
    clip_norm: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _scaling(self) -> OptimConfig:
        if self.lr_scaling != "none" and self.base_batch is None:
            raise ValueError(
                f"optim.lr_scaling={self.lr_scaling} needs optim.base_batch (the batch size optim.lr was "
                f"tuned for); set it, or optim.lr_scaling=none"
            )
        return self


class PrecisionConfig(Section):
    """Mixed precision: parameter (master) dtype, compute dtype, and loss scaling for float16.

    compute=auto is bfloat16 on GPU and TPU, float32 on CPU. Losses and the gradients the optimizer
    sees are float32.

    loss_scale=auto is dynamic for float16 compute, none otherwise: the loss is multiplied by the
    scale, a step whose gradients are not all finite is skipped and halves the scale, and
    `loss_scale_period` clean steps in a row double it.
    """

    compute: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    params: Literal["float32", "bfloat16"] = "float32"
    # Keep the matmul weights' compute-dtype copies between steps, written by the optimizer's update,
    # instead of casting every weight at the start of each step (same values and gradients).
    compute_copies: bool = True
    loss_scale: Literal["auto", "dynamic", "none"] = "auto"
    loss_scale_init: float = Field(2.0**15, gt=0)
    loss_scale_period: int = Field(2000, gt=0)


class LogConfig(Section):
    every: int = Field(10, gt=0)


class EvalConfig(Section):
    every: int = Field(0, ge=0)
    batches: int | None = Field(None, gt=0)  # None: the whole eval split


class CheckpointConfig(Section):
    """`every`: save every N steps and at the last step, asynchronously (0: never save; a run_dir's
    existing checkpoints are still resumed from). `keep`: how many of the newest to keep."""

    every: int = Field(0, ge=0)
    keep: int = Field(3, gt=0)


class PipelineConfig(Section):
    """Pipeline parallelism, used when mesh.stage > 1 (jaxdist.parallel.pipeline).

    `microbatches` per gradient-accumulation step (a multiple of mesh.stage); `repeats` layer
    groups per stage taken round-robin (1: GPipe; more: circular, a smaller bubble for more
    transfers); `remat` recomputes each stage's forward in the backward pass.
    """

    microbatches: int = Field(1, gt=0)
    repeats: int = Field(1, gt=0)
    remat: bool = False


class SampleConfig(Section):
    prompt: str = "def "
    tokens: int = Field(200, ge=0)
    temperature: float = Field(0.8, ge=0)


class Config(Section):
    seed: int = 0
    run_dir: str = "runs/default"
    mesh: MeshConfig = MeshConfig()
    rules: RulesConfig = RulesConfig()
    model: ModelConfig = ModelConfig()
    impl: ImplConfig = ImplConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    precision: PrecisionConfig = PrecisionConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    pipeline: PipelineConfig = PipelineConfig()
    sample: SampleConfig = SampleConfig()

    @field_validator("run_dir")
    @classmethod
    def _run_dir_given(cls, run_dir: str) -> str:
        # An empty path would be the working directory: checkpoints and metrics among other files.
        if not run_dir.strip():
            raise ValueError(f"run_dir={run_dir!r} is empty; give the run's directory, e.g. run_dir=runs/mine")
        return run_dir

    @model_validator(mode="after")
    def _impl_fits_model(self) -> Config:
        chunk, seq_len = self.impl.loss_chunk, self.model.seq_len
        if chunk and seq_len % chunk:
            raise ValueError(
                f"impl.loss_chunk={chunk} does not divide model.seq_len={seq_len}; use a divisor of {seq_len}, "
                f"or 0 for the unchunked loss"
            )
        if self.impl.gelu_grad_impl == "cublaslt" and self.model.activation != "gelu":
            raise ValueError(f"impl.gelu_grad_impl=cublaslt needs model.activation=gelu, not {self.model.activation}")
        return self

    @model_validator(mode="after")
    def _gathered_copies(self) -> Config:
        if self.train.fsdp_gather != "per_layer" and not self.precision.compute_copies:
            raise ValueError(f"train.fsdp_gather={self.train.fsdp_gather} gathers the compute-dtype copies of "
                             f"the weights: it needs precision.compute_copies=true")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice (YAML forbids it; PyYAML alone would keep the last)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that raises `DuplicateKey` on a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself rejects it, with its own message
            if key in seen:
                raise DuplicateKey(f"key '{key}' appears twice in one mapping (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads a YAML file (or the defaults, when path is None) and applies `key.sub=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist: pass the path of a YAML file")
        try:
            raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except UnicodeDecodeError as err:
            raise UserError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                            f"{err.start}); save it as UTF-8") from None
        except yaml.YAMLError as err:
            raise UserError(f"config file {path} is not valid YAML: {_first_line(err)}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return from_dict(raw)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with dotted `key.sub=value` overrides applied, as on the command line."""
    raw = cfg.model_dump(mode="json")
    for override in overrides:
        _apply_override(raw, override)
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise UserError(_describe(err)) from None


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise UserError(f"override {override!r} is not of the form key.sub=value (e.g. train.steps=100)")
    try:
        value = yaml.load(text, Loader=UniqueKeyLoader) if text else ""
    except yaml.YAMLError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override {override!r}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(err: ValidationError) -> str:
    """The first validation error as one line: the dotted key, what is wrong, and the fix."""
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        if first["loc"][:-1] == ("model",) and first["loc"][-1] in ImplConfig.model_fields:
            return f"config: unknown key '{key}'; it is impl.{first['loc'][-1]} (the impl section says how the model runs)"
        section = _section_of(first["loc"][:-1])
        known = ", ".join(section.model_fields) if section else ""
        return f"config: unknown key '{key}'; known keys here: {known}"
    if kind == "value_error":
        return f"config: {first['msg'].removeprefix('Value error, ')}"
    got = first.get("input")
    return f"config: {key}={got!r}: {first['msg'].lower()}"


def _section_of(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


def resolve_mesh_shape(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Mesh axis sizes with the -1 filled in; a `UserError` if they cannot cover the devices."""
    sizes = {axis: getattr(mesh, axis) for axis in MESH_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    fill = [axis for axis, size in sizes.items() if size == -1]
    if fill:
        if device_count % fixed:
            shown = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items() if size != -1)
            raise UserError(
                f"mesh: the fixed axes {shown} multiply to {fixed}, which does not divide the "
                f"{device_count} devices; change them or mesh.{fill[0]}"
            )
        sizes[fill[0]] = device_count // fixed
    elif fixed != device_count:
        shown = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())
        raise UserError(
            f"mesh: {shown} = {fixed} devices, but {device_count} are present; make the product "
            f"{device_count} or set one axis to -1"
        )
    return sizes
