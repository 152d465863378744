"""Typed run configuration: YAML file + dotted overrides, validated before anything compiles.

One pydantic model per section. Unknown keys and wrong types are rejected with a `UserError`
naming the dotted key; `jaxdist.parallel.layout` adds the checks that need the devices.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Hashable, Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from jaxdist.errors import UserError

MESH_AXES = ("data", "stage", "fsdp", "tensor")
_MODEL_NAME = "the model: gpt, mlp or resnet; each has its own keys (`jaxdist config show model.name=NAME`)"


class Section(BaseModel):
    # No float key means anything at inf or nan: an infinite learning rate trains NaN parameters.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true as 1 for an int or a float, and YAML reads yes/no and on/off as
        # booleans too: `mesh.tensor=yes` would be a size.
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and (kind := _number_kind(annotation)):
            raise PydanticCustomError("bool_not_number", f"Input should be a valid {kind}, {_NOT_A_BOOLEAN}")
        if isinstance(value, list) and any(isinstance(item, bool) for item in value) and (
                kind := _number_kind(_list_item(annotation))):
            raise PydanticCustomError("bool_not_number", f"Each item should be a valid {kind}, {_NOT_A_BOOLEAN}")
        return value


_NOT_A_BOOLEAN = "not a boolean (YAML reads true/false, yes/no and on/off as booleans)"


def _scalar_types(annotation: Any) -> set[Any]:
    """The types a field's annotation admits, unwrapped from `Annotated` and unions."""
    if get_origin(annotation) is Annotated:
        return _scalar_types(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return set().union(*(_scalar_types(arg) for arg in get_args(annotation)))
    return {annotation}


def _number_kind(annotation: Any) -> str | None:
    """"integer" or "number" where the annotation takes ints or floats and no bool; else None."""
    types = _scalar_types(annotation)
    if bool in types:
        return None
    return "number" if float in types else "integer" if int in types else None


def _list_item(annotation: Any) -> Any:
    """The item type of the list the annotation admits (None: it admits no list)."""
    lists = [kind for kind in _scalar_types(annotation) if get_origin(kind) is list]
    return get_args(lists[0])[0] if lists else None


class MeshConfig(Section):
    """Mesh axis sizes; -1 means all remaining devices (at most one axis may say so)."""

    data: int = Field(1, description="devices along the data-parallel axis (replicas of the parameters)")
    stage: int = Field(1, description="pipeline stages (> 1 runs the layer stack as a pipeline)")
    fsdp: int = Field(-1, description="devices the parameters and optimizer state are sharded over (FSDP)")
    tensor: int = Field(1, description="devices each layer's matmuls are split over (tensor parallelism)")

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


# A rules override: a mesh axis, a list of mesh axes, or None (replicated).
AxisRule = str | list[str] | None


class RulesConfig(Section):
    """A preset of logical-axis rules, with per-name overrides for params and activations."""

    preset: str = Field("fsdp_tp", description="logical-axis rules preset: dp, fsdp, tp or fsdp_tp")
    params: dict[str, AxisRule] = Field(
        default_factory=dict, description="parameter rules overrides: logical name -> mesh axis, axes or null")
    activations: dict[str, AxisRule] = Field(
        default_factory=dict, description="activation rules overrides: logical name -> mesh axis, axes or null")

    @field_validator("params", "activations", mode="before")
    @classmethod
    def _overrides(cls, table: Any, info: ValidationInfo) -> Any:
        # Checked here, where the logical name is known: pydantic's errors would name the member of
        # the AxisRule union that failed last (rules.params.embed.str) instead of the key.
        if not isinstance(table, dict):
            return table  # pydantic's own error names rules.params
        key = f"rules.{info.field_name}"
        for name, axes in table.items():
            if not isinstance(name, str):
                raise ValueError(f"key {_shown(name)} in {key} is not a logical name (names are text, e.g. embed)")
            if not (axes is None or isinstance(axes, str)
                    or (isinstance(axes, list) and all(isinstance(axis, str) for axis in axes))):
                raise ValueError(f"{key}.{name}={_shown(axes)}: use a mesh axis ({', '.join(MESH_AXES)}), a list of "
                                 f"them, or null (replicated)")
        return table


class ParamSize(NamedTuple):
    """A size the model's parameters have along the dimensions of one logical name, and the config key
    that decides it."""

    name: str  # the dimensions' logical name (embed, mlp, ...)
    key: str  # the dotted key that decides the size
    value: Any  # that key's value
    size: int
    what: str  # the dimensions in words; for a size other than the key's value, how it follows from the keys


class ModelSection(Section):
    """What every model's section answers for the layers that are not the model (layout, pipeline,
    throughput); each model's own keys live in its subclass."""

    @property
    def layer_stack(self) -> int | None:
        """Layers of the stack of identical layers a pipeline splits into stages; None: no such stack."""
        return None

    @property
    def tokens_per_example(self) -> int | None:
        """Tokens in one example (a sequence), for tokens/s; None where examples are not token sequences."""
        return None

    def param_sizes(self) -> list[ParamSize]:
        """The sizes the model's keys give its parameters' named dimensions, so that a size the rules
        cannot split is reported by the key that decides it, before the model is built. Every size of
        a listed name is a multiple of one listed for it; names left out (sizes no key decides, such
        as q, k and v's 3) are checked as the parameters are placed."""
        return []

    def summary(self) -> dict[str, Any]:
        """The sizes that tell models apart in a benchmark record (`jaxdist bench`)."""
        return {}


def _positive_or_auto(key: str, value: Any, unit: str, what: str) -> Any:
    # Checked in a "before" validator, so a bad value is one error naming the key, not one per member of the union.
    if value == "auto" or (type(value) is int and value > 0):
        return value
    raise ValueError(f"{key}={value!r}: use a positive number of {unit}, or auto (the data's {what})")


class GPTConfig(ModelSection):
    """A decoder-only transformer language model (models/gpt.py)."""

    name: Literal["gpt"] = Field("gpt", description=_MODEL_NAME)
    vocab: int | Literal["auto"] = Field(
        256, description="vocabulary size; auto: the configured data's (resolved before the model is built)")
    d_model: int = Field(256, gt=0, description="width of the residual stream")
    layers: int = Field(4, gt=0, description="number of transformer blocks")
    heads: int = Field(8, gt=0, description="attention heads (must divide d_model)")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width as a multiple of d_model")
    seq_len: int = Field(256, gt=0, description="tokens per sequence")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="normalization layer")
    positions: Literal["learned", "rope"] = Field("learned", description="position encoding")
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation")
    tied_embeddings: bool = Field(False, description="the output projection reuses the token embedding")

    @field_validator("vocab", mode="before")
    @classmethod
    def _vocab(cls, value: Any) -> Any:
        return _positive_or_auto("model.vocab", value, "ids", "vocabulary")

    @model_validator(mode="after")
    def _shapes(self) -> GPTConfig:
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        if self.positions == "rope" and (self.d_model // self.heads) % 2:
            raise ValueError("model.positions=rope needs an even head dimension (d_model / heads)")
        if self.mlp_dim < 1:
            raise ValueError(f"model.mlp_ratio={self.mlp_ratio} makes the MLP's hidden width int(model.d_model x "
                             f"model.mlp_ratio) = {self.mlp_dim}; it needs at least 1: model.mlp_ratio >= "
                             f"1/{self.d_model}")
        return self

    @property
    def mlp_dim(self) -> int:
        return int(self.d_model * self.mlp_ratio)

    @property
    def layer_stack(self) -> int:
        return self.layers

    @property
    def tokens_per_example(self) -> int:
        return self.seq_len

    def param_sizes(self) -> list[ParamSize]:
        # Not the stacked `layers`: that dim exists only with impl.scan_layers, and pipeline.check_config
        # checks model.layers against mesh.stage.
        sizes = [
            ParamSize("embed", "model.d_model", self.d_model, self.d_model, "the embedding dimension of every weight"),
            ParamSize("heads", "model.heads", self.heads, self.heads, "the attention heads of every attention weight"),
            ParamSize("mlp", "model.mlp_ratio", self.mlp_ratio, self.mlp_dim,
                      "the MLP's hidden width int(model.d_model x model.mlp_ratio)"),
            ParamSize("head_dim", "model.d_model", self.d_model, self.d_model // self.heads,
                      "the head dimension model.d_model / model.heads"),
        ]
        if self.vocab != "auto":
            sizes.append(ParamSize("vocab", "model.vocab", self.vocab, self.vocab,
                                   "the vocabulary of the token embedding and the output head"))
        if self.positions == "learned":
            sizes.append(ParamSize("length", "model.seq_len", self.seq_len, self.seq_len,
                                   "the positions of the learned position embedding"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"d": self.d_model, "layers": self.layers, "seq": self.seq_len}


def _classes(value: Any) -> Any:
    return _positive_or_auto("model.classes", value, "classes", "classes")


def _image_shape(value: Any) -> Any:
    if value == "auto" or (isinstance(value, (list, tuple)) and len(value) == 3
                           and all(type(size) is int and size > 0 for size in value)):
        return value
    raise ValueError(f"model.image_shape={value!r}: use [height, width, channels] (three positive sizes), "
                     f"or auto (the data's)")


ClassCount = Annotated[int | Literal["auto"], BeforeValidator(_classes), Field(
    description="number of classes; auto: the configured data's (resolved before the model is built)")]
ImageShape = Annotated[list[int] | Literal["auto"], BeforeValidator(_image_shape), Field(
    description="[height, width, channels] of an input image; auto: the configured data's")]


class ClassifierSection(ModelSection):
    """An image classifier: images [height, width, channels] in, one of `classes` labels out. Each
    subclass has the keys `classes` (`ClassCount`) and `image_shape` (`ImageShape`)."""


class MLPConfig(ClassifierSection):
    """A multilayer perceptron classifier: the flattened image through ReLU layers (models/mlp.py)."""

    name: Literal["mlp"] = Field("mlp", description=_MODEL_NAME)
    classes: ClassCount = "auto"
    image_shape: ImageShape = "auto"
    hidden: list[Annotated[int, Field(gt=0)]] = Field(
        [256, 256], description="width of each hidden layer, first to last (its length is the depth)")

    def param_sizes(self) -> list[ParamSize]:
        sizes = []
        if self.image_shape != "auto":
            sizes.append(ParamSize("embed", "model.image_shape", self.image_shape, math.prod(self.image_shape),
                                   "the first layer's inputs height x width x channels"))
        for i, width in enumerate(self.hidden):
            # A hidden layer's outputs (mlp) are the next layer's inputs (embed).
            what = f"the width of hidden layer {i + 1} (model.hidden[{i}])"
            sizes += [ParamSize(name, "model.hidden", self.hidden, width, what) for name in ("mlp", "embed")]
        if self.classes != "auto":
            sizes.append(ParamSize("classes", "model.classes", self.classes, self.classes, "the head's outputs"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"hidden": list(self.hidden)}


class ResNetConfig(ClassifierSection):
    """A residual convolutional network with BatchNorm (He et al. 2016; models/resnet.py)."""

    name: Literal["resnet"] = Field("resnet", description=_MODEL_NAME)
    classes: ClassCount = "auto"
    image_shape: ImageShape = "auto"
    depth: Literal[18, 50] = Field(
        18, description="18: basic blocks [2, 2, 2, 2]; 50: bottleneck blocks [3, 4, 6, 3]")
    width: int = Field(64, gt=0, description="channels of the first stage (doubled at each later stage; 64 published)")
    stem: Literal["imagenet", "small"] = Field(
        "imagenet", description="imagenet: 7x7 stride-2 conv + 3x3 max-pool; small: one 3x3 stride-1 conv (small images)")
    bn_momentum: float = Field(0.9, gt=0, lt=1, description="decay of BatchNorm's running averages per update")

    def param_sizes(self) -> list[ParamSize]:
        # Stage 3 has width x 8 channels, x 4 out of ResNet-50's bottleneck blocks: the head's inputs.
        last = self.width * 8 * (4 if self.depth == 50 else 1)
        sizes = [
            ParamSize("conv_out", "model.width", self.width, self.width,
                      "the output channels of every convolution (each a multiple of model.width)"),
            ParamSize("embed", "model.width", self.width, last,
                      f"the head's inputs, the last stage's channels model.width x {last // self.width}"),
        ]
        if self.classes != "auto":
            sizes.append(ParamSize("classes", "model.classes", self.classes, self.classes, "the head's outputs"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"depth": self.depth, "width": self.width, "stem": self.stem}


def _model_name(raw: Any) -> Any:
    """The model section's `name`; gpt when a mapping leaves it out."""
    return raw.get("name", "gpt") if isinstance(raw, dict) else getattr(raw, "name", None)


# The `model:` section: one of these, picked by `model.name`.
MODEL_CONFIGS: dict[str, type[ModelSection]] = {"gpt": GPTConfig, "mlp": MLPConfig, "resnet": ResNetConfig}
ModelConfig = Annotated[
    Union[tuple(Annotated[section, Tag(name)] for name, section in MODEL_CONFIGS.items())],
    Discriminator(_model_name),
]


class ImplConfig(Section):
    """How the model runs: layer stacking, recomputation, kernels and loss chunking.

    None of these changes the math beyond float rounding; they trade compile time, memory and speed
    (docs/performance.md says what each was measured to do). For a kernel switch, auto uses it where
    it is possible and known to be faster, xla never, the explicit value always (or errors).
    """

    scan_layers: bool = Field(
        True, description="true: layers stacked in a lax.scan (fast compile, needed by pipelines); false: unrolled")
    remat: Literal["none", "mlp", "full", "dots"] = Field(
        "none", description="recomputed in the backward: nothing, the MLP activation, whole blocks, or all but matmuls")
    attention: Literal["auto", "xla", "cudnn"] = Field("auto", description="attention implementation")
    norm_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="residual add + norm as one Pallas kernel (kernels/fused_norm.py)")
    gelu_grad_impl: Literal["auto", "xla", "cublaslt"] = Field(
        "auto", description="GELU's gradient in the MLP backward matmul's cuBLASLt epilogue (kernels/gelu_matmul.py)")
    logits_dtype: Literal["float32", "compute"] = Field(
        "float32", description="dtype of the output projection's logits (the softmax is float32 either way)")
    loss_chunk: int = Field(
        0, ge=0, description="> 0: the loss projects this many positions at a time, never the full logits")
    loss_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="the chunked loss's softmax and gradient as one Pallas kernel (needs loss_chunk > 0)")

    @model_validator(mode="after")
    def _combinations(self) -> ImplConfig:
        if self.loss_impl == "pallas" and not self.loss_chunk:
            raise ValueError("impl.loss_impl=pallas needs impl.loss_chunk > 0 (the kernel runs inside the chunked loss)")
        return self


class AugmentConfig(Section):
    """Random changes to each train image (eval images never change), drawn from (seed, the example's
    global index): the same on every process and after a resume, different for an image each epoch."""

    crop_padding: int = Field(
        0, ge=0, description="pad each side by this many pixels (zeros), then crop a random H x W window (0: off)")
    flip: bool = Field(False, description="mirror each image left-right with probability 1/2")

    @property
    def active(self) -> bool:
        return bool(self.crop_padding or self.flip)


class DataConfig(Section):
    """Where examples come from and how they are read."""

    source: Literal["stdlib", "arrayrecord", "images", "arrays", "digits"] = Field(
        "stdlib", description="stdlib: Python's standard library .py files; arrayrecord: prepared token shards; "
                              "images: a prepared image folder; arrays: an .npz; digits: scikit-learn's 8x8 digit "
                              "images (fixed split: 1,437 train, 360 eval)")
    path: str | None = Field(None, description="prepared directory or .npz file (not for stdlib)")
    eval_fraction: float = Field(
        0.01, ge=0, lt=1, description="share of stdlib files or array rows held out for eval")
    epochs: int | None = Field(None, gt=0, description="when set, decides train.steps")
    workers: int | Literal["auto"] = Field(
        "auto", description="grain worker processes (0: read in the training process; any count reads the same "
                            "batches); auto: from the host's cores per training process")
    read_threads: int = Field(2, ge=0, description="grain read threads")
    prefetch: int = Field(4, ge=0, description="grain read-ahead buffer, in elements")
    augment: AugmentConfig = Field(AugmentConfig(), description="random crops and flips of train images")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 0):
            return value
        raise ValueError(f"data.workers={value!r}: use a number of worker processes (0: read in the training "
                         f"process), or auto")

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.source in ("stdlib", "digits") and self.path is not None:
            raise ValueError(f"data.path={self.path} is set but data.source={self.source} reads no path; drop data.path")
        if self.source not in ("stdlib", "digits") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path (a prepared directory or a .npz file)")
        return self


class TrainConfig(Section):
    """Steps, batch, accumulation, when gradients and weights cross devices, and non-finite steps.

    grad_reduction per_step holds each device's unreduced fp32 gradients during the scan;
    per_microbatch keeps them sharded like the parameters (lighter under FSDP). fsdp_gather
    per_step gathers the compute-dtype copies once in the forward and keeps them for the backward
    (PyTorch FSDP2's reshard_after_forward=False); float32 weights and optimizer state stay sharded.
    A non-finite step never updates the state (its data is consumed); under dynamic loss scaling
    an overflow is the scaler's business unless the scale is already 1. A loss spike (a finite loss
    far above the running average: a diverging run) is a bad step like a non-finite one.
    """

    steps: int = Field(300, gt=0, description="optimizer steps to train")
    global_batch: int = Field(
        32, gt=0, description="sequences or examples per optimizer step, all processes together")
    microbatches: int = Field(1, gt=0, description="scan steps (gradient accumulation) per optimizer step")
    grad_reduction: Literal["per_step", "per_microbatch"] = Field(
        "per_step", description="reduce gradients once after the microbatch scan, or inside every scan step")
    fsdp_gather: Literal["per_layer", "per_step"] = Field(
        "per_layer", description="gather fsdp-sharded weights where each layer uses them (ZeRO-3) or once a step (ZeRO-2)")
    on_nonfinite: Literal["halt", "skip"] = Field(
        "halt", description="after a non-finite step: stop without saving it (exit 3), or go on")
    max_consecutive_skips: int = Field(10, gt=0, description="under skip: halt after more bad steps in a row")
    loss_spike: float | None = Field(
        5.0, gt=1, description="a finite loss above this many times the running average of the last losses is a "
        "bad step too, halted or skipped as on_nonfinite says (null: off)")


class OptimConfig(Section):
    """Optimizer, weight-decay and trust-ratio masks, clipping, schedule and batch-size LR scaling."""

    name: Literal["adamw", "sgd", "lamb", "lars", "adafactor"] = Field("adamw", description="optimizer")
    lr: float = Field(3e-3, gt=0, description="peak learning rate, at base_batch")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay, scaled by the learning rate schedule")
    decay_norms_and_biases: bool = Field(False, description="apply weight decay to norms and biases too")
    decay_embeddings: bool = Field(False, description="apply weight decay to embeddings too")
    trust_ratio_norms_and_biases: bool = Field(
        False, description="lamb/lars: apply the trust ratio to norms and biases too")
    trust_coefficient: float = Field(0.001, gt=0, description="lars: trust coefficient")
    b1: float = Field(0.9, ge=0, lt=1, description="adam/lamb: first-moment decay")
    b2: float = Field(0.95, ge=0, lt=1, description="adam/lamb: second-moment decay")
    eps: float = Field(1e-8, gt=0, description="adam/lamb: denominator epsilon")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd/lars: momentum")
    nesterov: bool = Field(False, description="sgd/lars: Nesterov momentum")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to the peak")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warmup: hold, or decay to min_lr_ratio x peak at train.steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final learning rate as a fraction of the peak")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="rescale lr from base_batch to train.global_batch (linear: Goyal et al. 2017)")
    base_batch: int | None = Field(None, gt=0, description="the batch size lr was tuned for (for lr_scaling)")
    clip_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this (null: off)")

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

    Losses and the gradients the optimizer sees are float32. Dynamic loss scaling skips a step
    whose gradients are not all finite and halves the scale.
    """

    compute: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto: bfloat16 on GPU and TPU, float32 on CPU")
    params: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the stored (master) parameters")
    compute_copies: bool = Field(
        True, description="keep the weights' compute-dtype copies between steps instead of casting each step")
    loss_scale: Literal["auto", "dynamic", "none"] = Field(
        "auto", description="loss scaling; auto: dynamic for float16 compute, none otherwise")
    loss_scale_init: float = Field(2.0**15, gt=0, description="initial dynamic loss scale")
    loss_scale_period: int = Field(2000, gt=0, description="clean steps in a row that double the loss scale")


class LogConfig(Section):
    """Console and metrics logging."""

    every: int = Field(10, gt=0, description="log metrics every N steps (and the first and last)")
    wandb: bool = Field(False, description="also log the metrics and the config to Weights & Biases, from process "
                        "0 (needs the wandb extra); its files go to run_dir/wandb")
    wandb_project: str = Field("jaxdist", description="W&B project the run is logged to")
    wandb_entity: str | None = Field(None, description="W&B team or user (null: your default entity)")
    wandb_name: str | None = Field(None, description="W&B run name (null: the run_dir folder's name)")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="online streams to the W&B server; offline only writes run_dir/wandb, for "
        "`wandb sync` later")


class EvalConfig(Section):
    """Evaluation on the held-out split."""

    every: int = Field(0, ge=0, description="evaluate every N steps and at the end (0: never)")
    batches: int | None = Field(None, gt=0, description="eval batches per evaluation, in a fixed shuffled order of the "
                                "eval split, the same in every run (null: the whole eval split)")


class CheckpointConfig(Section):
    """Asynchronous checkpoints in run_dir/checkpoints (existing ones are resumed from even at every=0)."""

    every: int = Field(0, ge=0, description="save every N steps and at the last step (0: never)")
    keep: int = Field(3, gt=0, description="how many of the newest checkpoints to keep (a checkpoint counts once "
                      "the step after it was sane)")
    keep_every: int | None = Field(
        None, gt=0, description="also keep every checkpoint at a multiple of this many steps, for good (null: none)")
    resume_step: int | None = Field(
        None, ge=0, description="resume from this step's checkpoint instead of the newest; newer ones are moved "
        "aside as superseded-<step> (null: the newest)")
    write_timeout: float = Field(
        1800.0, gt=0, description="seconds a checkpoint write may take; a longer one stops the run (a stuck file "
        "system), with the checkpoints before it intact")


class PipelineConfig(Section):
    """Pipeline parallelism, used when mesh.stage > 1 (jaxdist.parallel.pipeline)."""

    microbatches: int = Field(
        1, gt=0, description="pipeline microbatches per accumulation step (at least mesh.stage)")
    repeats: int = Field(
        1, gt=0, description="layer groups per stage, round-robin (1: GPipe; more: circular, smaller bubble)")
    remat: bool = Field(False, description="recompute each stage's forward in the backward pass")
    unroll: bool = Field(
        True, description="run the iterations unrolled (fastest on GPU); false: as one lax.scan (compiles faster)")


class SampleConfig(Section):
    """The text sample printed after training."""

    prompt: str = Field("def ", description="prompt the sample continues")
    tokens: int = Field(200, ge=0, description="tokens to generate (0: no sample)")
    temperature: float = Field(0.8, ge=0, description="sampling temperature (0: greedy)")


class ProfileConfig(Section):
    """A JAX profiler trace of some train steps, into run_dir/profile/process_<i>."""

    start_step: int = Field(1, gt=0, description="first traced step")
    steps: int = Field(0, ge=0, description="steps to trace (0: no trace)")


class Config(Section):
    """A whole run: its sections, seed and run directory."""

    # Unsigned 32 bits: what grain's shuffles and numpy's SeedSequence take.
    seed: int = Field(0, ge=0, lt=2**32, description="seed of parameter init, data order and sampling")
    run_dir: str = Field("runs/default", description="directory of config.yaml, metrics.jsonl and checkpoints/")
    mesh: MeshConfig = Field(MeshConfig(), description="device mesh axis sizes")
    rules: RulesConfig = Field(RulesConfig(), description="logical-axis rules")
    model: ModelConfig = Field(GPTConfig(), description="the architecture")
    impl: ImplConfig = Field(ImplConfig(), description="how the model runs")
    data: DataConfig = Field(DataConfig(), description="the input data")
    train: TrainConfig = Field(TrainConfig(), description="steps, batch and accumulation")
    optim: OptimConfig = Field(OptimConfig(), description="optimizer and schedule")
    precision: PrecisionConfig = Field(PrecisionConfig(), description="mixed precision")
    log: LogConfig = Field(LogConfig(), description="logging")
    eval: EvalConfig = Field(EvalConfig(), description="evaluation")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="checkpoints")
    pipeline: PipelineConfig = Field(PipelineConfig(), description="pipeline parallelism")
    sample: SampleConfig = Field(SampleConfig(), description="the text sample after training")
    profile: ProfileConfig = Field(ProfileConfig(), description="profiler trace of train steps")

    @field_validator("run_dir")
    @classmethod
    def _run_dir_given(cls, run_dir: str) -> str:
        # An empty path would be the working directory: checkpoints and metrics among other files.
        if not run_dir.strip():
            raise ValueError(f"run_dir={run_dir!r} is empty; give the run's directory, e.g. run_dir=runs/mine")
        return run_dir

    @model_validator(mode="after")
    def _impl_fits_model(self) -> Config:
        if not isinstance(self.model, GPTConfig):
            # impl says how the GPT runs; no other model reads it, so a changed key would do nothing.
            default = ImplConfig()
            if changed := [key for key in ImplConfig.model_fields if getattr(self.impl, key) != getattr(default, key)]:
                raise ValueError(f"impl.{changed[0]}={getattr(self.impl, changed[0])}: the impl section says how "
                                 f"model.name=gpt runs, and model.name={self.model.name} reads none of it; drop it")
            return self
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
        """The whole config as YAML, every key with its value (what run_dir/config.yaml holds)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def describe(cfg: Config) -> list[tuple[str, str, str, str]]:
    """Every leaf key of `cfg` as (dotted key, value, type, description), in declaration order."""
    return list(_describe_section(cfg, ""))


def _describe_section(section: BaseModel, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from _describe_section(value, f"{prefix}{name}.")
        else:
            shown = value if isinstance(value, str) else json.dumps(value)
            kind = "|".join(MODEL_CONFIGS) if isinstance(section, ModelSection) and name == "name" else (
                _type_name(field.annotation))
            yield f"{prefix}{name}", shown, kind, field.description or ""


def _type_name(annotation: Any) -> str:
    """A field's type as a user writes its values: `int`, `float | null`, `auto|xla|pallas`."""
    if get_origin(annotation) is Annotated:
        return _type_name(get_args(annotation)[0])
    if get_origin(annotation) is Literal:
        return "|".join(str(choice) for choice in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(annotation))
    if annotation is type(None):
        return "null"
    if get_origin(annotation) is dict:
        return "mapping"
    if get_origin(annotation) is list:
        return f"list[{_type_name(get_args(annotation)[0])}]"
    return getattr(annotation, "__name__", str(annotation))


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


def recipes_folder() -> Path:
    """Where the recipes are: the package `jaxdist.configs` (the repository's `configs/`, installed or
    mapped there by an editable install), else, for a source tree on the path that is not installed
    (PYTHONPATH=.), that tree's own `configs/`."""
    try:
        return Path(str(importlib.resources.files("jaxdist.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "configs"


def recipes() -> list[str]:
    """Names of the recipes that ship with jaxdist (`configs/NAME.yaml`)."""
    return sorted(recipe.stem for recipe in recipes_folder().glob("*.yaml"))


def _locate(path: str | Path) -> Path:
    """`path` itself, or the recipe it names when it is a bare name (no suffix, no folder) and no
    file; a `UserError` for a directory that names no recipe."""
    path = Path(path)
    if not (path.is_file() or path.suffix or len(path.parts) != 1):
        recipe = recipes_folder() / f"{path}.yaml"
        if recipe.is_file():
            return recipe
        if not path.is_dir():
            raise UserError(f"config {path} is neither a file nor a recipe; recipes: {', '.join(recipes())}")
    if path.is_dir():
        raise UserError(f"config {path} is a directory; pass the path of a YAML file in it, or a recipe: "
                        f"{', '.join(recipes())}")
    return path


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads a YAML file or a recipe by name (or the defaults, when path is None) and applies
    `key.sub=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = _locate(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist: pass the path of a YAML file, or a recipe: "
                            f"{', '.join(recipes())}")
        try:
            raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except UnicodeDecodeError as err:
            raise UserError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                            f"{err.start}); save it as UTF-8") from None
        except yaml.YAMLError as err:
            raise UserError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
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
    """A checked `Config` from nested dicts (a YAML file's content); a one-line `UserError` otherwise."""
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
    loc = first["loc"]
    if loc[:1] == ("model",) and len(loc) > 1 and loc[1] in MODEL_CONFIGS:
        loc = ("model", *loc[2:])  # the union's tag: the model is named by model.name
    key = ".".join(str(part) for part in loc)
    kind = first["type"]
    if kind == "model_type" or (kind == "union_tag_not_found" and first["input"] is None):
        return _not_a_section(key, first["input"], _section_of(first["loc"]))
    if kind == "invalid_key":
        where = f"in {'.'.join(str(part) for part in loc[:-1])}" if loc[:-1] else "at the top level"
        section = _section_of(first["loc"][:-1])
        known = ", ".join(section.model_fields) if section else ""
        return f"config: key {_shown(first['input'])} {where} is not a name (keys are text); known keys here: {known}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        given = first["input"].get("name") if isinstance(first["input"], dict) else first["input"]
        what = "model.name" if isinstance(first["input"], dict) else "model"
        return f"config: {what}={given!r} is not a model; use model.name: one of {', '.join(MODEL_CONFIGS)}"
    if kind == "extra_forbidden":
        if loc[:-1] == ("model",) and loc[-1] in ImplConfig.model_fields:
            return f"config: unknown key '{key}'; it is impl.{loc[-1]} (the impl section says how the model runs)"
        section = _section_of(first["loc"][:-1])
        known = ", ".join(section.model_fields) if section else ""
        if section is not None and issubclass(section, ModelSection):
            return (f"config: unknown key '{key}' for model.name={first['loc'][1]}; its keys: {known} "
                    f"(other models: {', '.join(name for name in MODEL_CONFIGS if name != first['loc'][1])})")
        return f"config: unknown key '{key}'; known keys here: {known}"
    if kind == "value_error":
        return f"config: {first['msg'].removeprefix('Value error, ')}"
    message = first["msg"]  # a sentence: "Input should be ..."
    return f"config: {key}={_shown(first.get('input'))}: {message[:1].lower()}{message[1:]}"


def _not_a_section(key: str, given: Any, section: type[BaseModel]) -> str:
    """The error line for a section given as something other than a mapping of its keys (an empty
    `train:` in YAML is None)."""
    if section is ModelSection:  # its keys are those of the model that model.name picks
        *names, last = MODEL_CONFIGS
        keys = f"model.name: {', '.join(names)} or {last}, and that model's"
    else:
        keys = ", ".join(section.model_fields)
    if given is None:
        return f"config: {key} is empty; give its keys ({keys}) or leave the section out for its defaults"
    return f"config: {key}={_shown(given)}: {key} is a section: give it a mapping of its keys ({keys})"


def _shown(value: Any) -> str:
    """A value as the error line shows it: booleans as YAML writes them (true, not True)."""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, list):
        return f"[{', '.join(_shown(item) for item in value)}]"
    return repr(value)


def _section_of(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        if model is Config and part == "model":
            model = ModelSection  # the concrete section follows as the union's tag
            continue
        if model is ModelSection:
            model = MODEL_CONFIGS.get(str(part))
            if model is None:
                return None
            continue
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error as one line: what it was reading and the problem, each with its line and column."""
    if not isinstance(err, yaml.MarkedYAMLError) or not (err.context or err.problem):
        return _first_line(err)
    parts = [f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
             for text, mark in ((err.context, err.context_mark), (err.problem, err.problem_mark)) if text]
    return " ".join(": ".join(parts).split())
