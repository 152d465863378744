"""What every config section is: strict pydantic models that name the key in every error, the
model's and the optimizer's base sections (each model and optimizer subclasses one beside its own
code: `registry`), and the sizes a model's keys decide."""

from __future__ import annotations

import json
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from jaxdist.errors import not_local


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
# How `model.init_from` names a Hugging Face model folder: hf:FOLDER.
HF_PREFIX = "hf:"


def shown(value: Any) -> str:
    """A value as the error line shows it: booleans as YAML writes them (true, not True)."""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, list):
        return f"[{', '.join(shown(item) for item in value)}]"
    return repr(value)


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


class ParamSize(NamedTuple):
    """A size the model's parameters have along the dimensions of one logical name, and the config key
    that decides it."""

    name: str  # the dimensions' logical name (embed, mlp, ...)
    key: str  # the dotted key that decides the size
    value: Any  # that key's value
    size: int
    what: str  # the dimensions in words; for a size other than the key's value, how it follows from the keys


MODEL_NAME = "the model, each with keys of its own (`jaxdist config show model.name=NAME`)"
OPTIMIZER_NAME = "the optimizer, each with keys of its own (`jaxdist config show optim.name=NAME`)"


class ModelSection(Section):
    """What every model's section answers for the layers that are not the model (layout, pipeline,
    throughput); each model's own keys live in its subclass, registered under its `name`
    (`jaxdist.models.register`)."""

    name: str = Field(description=MODEL_NAME)

    @property
    def stacked_layers(self) -> bool:
        """Whether the layer stack is one stacked set of parameters (what a pipeline splits into stages)."""
        return False

    @property
    def wants_native_kernels(self) -> bool:
        """Whether the model runs a C++ GPU handler where one is available (jaxdist.kernels.build_for)."""
        return False

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


def local_path(key: str, value: str) -> str:
    """`value` of the path key `key`, refused where it names object storage or another URL (`errors.not_local`)."""
    if problem := not_local(value, f"{key}={value}"):
        raise ValueError(problem)
    return value


def positive_or_auto(key: str, value: Any, unit: str, what: str) -> Any:
    # Checked in a "before" validator, so a bad value is one error naming the key, not one per member of the union.
    if value == "auto" or (type(value) is int and value > 0):
        return value
    raise ValueError(f"{key}={value!r}: use a positive number of {unit}, or auto (the data's {what})")


def _classes(value: Any) -> Any:
    return positive_or_auto("model.classes", value, "classes", "classes")


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


class OptimizerSection(Section):
    """The keys every optimizer has: learning rate and its schedule, weight decay and its masks,
    clipping and batch-size scaling. Each optimizer subclasses it with its own keys, registered under
    its `name` (`jaxdist.train.optimizers.register`)."""

    name: str = Field(description=OPTIMIZER_NAME)
    # Parameter-sized arrays of optimizer state (moments) per parameter, for `jaxdist scale`.
    moments: ClassVar[int] = 0

    lr: float = Field(3e-3, gt=0, description="peak learning rate, at base_batch")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay, scaled by the learning rate schedule")
    decay_norms_and_biases: bool = Field(False, description="apply weight decay to norms and biases too")
    decay_embeddings: bool = Field(False, description="apply weight decay to embeddings too")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to the peak")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warmup: hold, or decay to min_lr_ratio x peak at train.steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final learning rate as a fraction of the peak")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="rescale lr from base_batch to train.global_batch (linear: Goyal et al. 2017)")
    base_batch: int | None = Field(None, gt=0, description="the batch size lr was tuned for (for lr_scaling)")
    clip_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this (null: off)")

    @model_validator(mode="after")
    def _scaling(self) -> OptimizerSection:
        if self.lr_scaling != "none" and self.base_batch is None:
            raise ValueError(
                f"optim.lr_scaling={self.lr_scaling} needs optim.base_batch (the batch size optim.lr was "
                f"tuned for); set it, or optim.lr_scaling=none"
            )
        return self
