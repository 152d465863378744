"""The sections of a run's config that are the same for every model and optimizer: the mesh, the
rules, the data, the training loop, precision, logging, evaluation, checkpoints, the pipeline, the
sample and the profiler."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jaxdist.config.base import Section, local_path, shown as _shown

MESH_AXES = ("data", "stage", "fsdp", "expert", "tensor")


class MeshConfig(Section):
    """Mesh axis sizes; -1 means all remaining devices (at most one axis may say so)."""

    data: int = Field(1, description="devices along the data-parallel axis (replicas of the parameters)")
    stage: int = Field(1, description="pipeline stages (> 1 runs the layer stack as a pipeline)")
    fsdp: int = Field(-1, description="devices the parameters and optimizer state are sharded over (FSDP)")
    expert: int = Field(1, description="devices a mixture of experts' experts are split over (expert parallelism; the "
                                       "batch is split over them too)")
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


class AugmentConfig(Section):
    """Random changes to each train image (eval images never change), drawn from (seed, the example's
    global index): the same on every process and after a resume, different for an image each epoch."""

    crop_padding: int = Field(
        0, ge=0, description="pad each side by this many pixels (zeros), then crop a random H x W window (0: off)")
    flip: bool = Field(False, description="mirror each image left-right with probability 1/2")

    @property
    def active(self) -> bool:
        return bool(self.crop_padding or self.flip)


class MixtureSource(Section):
    """One prepared token folder of a mixture and its share of the rows."""

    name: str = Field(description="what its eval metrics are called: eval_<name>_loss")
    path: str = Field(description="a folder `jaxdist data prepare` wrote")
    weight: float = Field(gt=0, description="its share of the train rows, relative to the others' weights")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"data.mixture name {value!r}: use letters, digits and _ (it names metrics)")
        return value

    @field_validator("path")
    @classmethod
    def _local(cls, value: str) -> str:
        return local_path("data.mixture path", value)


# The share of the stdlib corpus's files or an arrays file's rows held out for eval by default.
DEFAULT_EVAL_FRACTION = 0.01


class DataConfig(Section):
    """Where examples come from and how they are read."""

    source: Literal["stdlib", "arrayrecord", "images", "arrays", "digits"] = Field(
        "stdlib", description="stdlib: Python's standard library .py files; arrayrecord: prepared token shards; "
                              "images: a prepared image folder; arrays: an .npz; digits: scikit-learn's 8x8 digit "
                              "images (fixed split: 1,437 train, 360 eval)")
    path: str | None = Field(None, description="prepared directory or .npz file (not for stdlib)")
    eval_fraction: float | None = Field(
        None, ge=0, lt=1, description=f"share of stdlib files or array rows held out for eval (null: "
        f"{DEFAULT_EVAL_FRACTION}); refused for prepared data and digits, whose split is fixed")
    epochs: int | None = Field(None, gt=0, description="when set, decides train.steps")
    workers: int | Literal["auto"] = Field(
        "auto", description="grain worker processes (0: read in the training process; any count reads the same "
                            "batches); auto: from the host's cores per training process")
    read_threads: int = Field(2, ge=0, description="grain read threads")
    prefetch: int = Field(4, ge=0, description="grain read-ahead buffer, in elements")
    packing: bool = Field(
        False, description="token sources: rows of whole documents, attention kept within each and positions "
                           "restarted (padding left out of the loss); false: windows across document boundaries")
    augment: AugmentConfig = Field(AugmentConfig(), description="random crops and flips of train images")
    mixture: list[MixtureSource] | None = Field(
        None, description="data.source=arrayrecord: prepared folders mixed by weight ({name, path, weight} each; "
                          "grain's deterministic mixing), each evaluated apart; instead of data.path")

    @property
    def held_out(self) -> float:
        """The share of stdlib files or array rows held out for eval: data.eval_fraction, or its default."""
        return DEFAULT_EVAL_FRACTION if self.eval_fraction is None else self.eval_fraction

    @field_validator("path")
    @classmethod
    def _local(cls, value: str | None) -> str | None:
        return value if value is None else local_path("data.path", value)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 0):
            return value
        raise ValueError(f"data.workers={value!r}: use a number of worker processes (0: read in the training "
                         f"process), or auto")

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.mixture is not None:
            if self.source != "arrayrecord" or self.path is not None:
                raise ValueError("data.mixture mixes prepared token folders: set data.source=arrayrecord and leave "
                                 "data.path out (each source names its own path)")
            names = [source.name for source in self.mixture]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"data.mixture needs one or more sources of distinct names, got {names}")
            return self
        if self.source in ("stdlib", "digits") and self.path is not None:
            raise ValueError(f"data.path={self.path} is set but data.source={self.source} reads no path; drop data.path")
        if self.source not in ("stdlib", "digits") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path (a prepared directory or a .npz file)")
        if self.packing and self.source not in ("stdlib", "arrayrecord"):
            raise ValueError(f"data.packing packs the documents of a token stream; data.source={self.source} holds "
                             f"none (use stdlib or arrayrecord)")
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
    offload: Literal["none", "optimizer"] = Field(
        "none", description="optimizer: the optimizer state lives in pinned host memory and comes to the devices a "
        "parameter at a time for the update (device memory for host-device copies each step)")
    grad_compression: Literal["none", "powersgd", "int8"] = Field(
        "none", description="send the gradients across the compressed axes as PowerSGD low-rank factors or int8, "
        "with error feedback (for hosts joined by slow links)")
    grad_compression_rank: int = Field(4, gt=0, description="PowerSGD's rank")
    grad_compression_start: int = Field(
        0, ge=0, description="steps reduced exactly before compression starts (PowerSGD's low-rank updates move "
        "a freshly initialized model slowly)")
    grad_compression_axes: list[str] | None = Field(
        None, description="the data-parallel mesh axes whose gradient reduction is compressed, e.g. [data] when "
        "only data crosses hosts (null: every data-parallel axis); the others reduce exactly first")

    @model_validator(mode="after")
    def _compression(self) -> TrainConfig:
        if self.grad_compression != "none" and self.grad_reduction != "per_step":
            raise ValueError(f"train.grad_compression={self.grad_compression} compresses each batch shard's own "
                             f"gradients: set train.grad_reduction=per_step")
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
    fp8: bool = Field(
        False, description="the attention and MLP projections as FP8 GEMMs: e4m3 operands, input gradients from e5m2 "
                           "output gradients, weight gradients in the compute dtype, each FP8 tensor scaled by its "
                           "current absolute maximum (NVIDIA GPUs of compute capability 8.9+; elsewhere off, with one "
                           "line)")
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
    overlap_transfers: bool = Field(
        False, description="use each stage's output two iterations after it is made, so that its transfer to the "
                           "next stage runs beside an iteration's compute (for stages on different hosts); the "
                           "bubble doubles, and with repeats the microbatches must be at least 2 x mesh.stage")


class SampleConfig(Section):
    """The text sample printed after training."""

    prompt: str = Field("def ", description="prompt the sample continues")
    tokens: int = Field(200, ge=0, description="tokens to generate (0: no sample)")
    temperature: float = Field(0.8, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the likeliest tokens up to this "
                                                      "probability (1: every token)")


class ProfileConfig(Section):
    """A JAX profiler trace of some train steps, into run_dir/profile/process_<i>."""

    start_step: int = Field(1, gt=0, description="first traced step")
    steps: int = Field(0, ge=0, description="steps to trace (0: no trace)")


