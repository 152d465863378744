"""`Config`: a whole run, its sections by name. `model:` and `optim:` are the sections registered
under `model.name` and `optim.name` (`registry`); the others are the same for every run."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import Field, SerializeAsAny, ValidatorFunctionWrapHandler, field_validator, model_validator

from jaxdist.config import registry
from jaxdist.config.base import ModelSection, OptimizerSection, Section, local_path
from jaxdist.config.sections import (CheckpointConfig, DataConfig, EvalConfig, LogConfig, MeshConfig, PipelineConfig,
                                     PrecisionConfig, ProfileConfig, RulesConfig, SampleConfig, TrainConfig)

DEFAULT_MODEL, DEFAULT_OPTIMIZER = "gpt", "adamw"


class UnknownName(ValueError):
    """`model.name` or `optim.name` names no registered section."""


def _pick(kind: str, sections: dict[str, type[Section]], default: str, value: Any,
          handler: ValidatorFunctionWrapHandler) -> Any:
    """The section `value` (a mapping) names by its `name`, validated; an instance passes as it is."""
    if isinstance(value, dict):
        name = value.get("name", default)
        if not isinstance(name, str) or name not in sections:
            raise UnknownName(f"{kind}.name={name!r} is not a registered {'model' if kind == 'model' else 'optimizer'}; "
                              f"use {kind}.name: one of {', '.join(sections)}")
        return sections[name].model_validate(value)
    return handler(value)


class Config(Section):
    """A whole run: its sections, seed and run directory."""

    # Unsigned 32 bits: what grain's shuffles and numpy's SeedSequence take.
    seed: int = Field(0, ge=0, lt=2**32, description="seed of parameter init, data order and sampling")
    run_dir: str = Field("runs/default", description="directory of config.yaml, metrics.jsonl and checkpoints/")
    mesh: MeshConfig = Field(MeshConfig(), description="device mesh axis sizes")
    rules: RulesConfig = Field(RulesConfig(), description="logical-axis rules")
    model: SerializeAsAny[ModelSection] = Field(
        default_factory=lambda: registry.model_sections()[DEFAULT_MODEL](), description="the architecture")
    data: DataConfig = Field(DataConfig(), description="the input data")
    train: TrainConfig = Field(TrainConfig(), description="steps, batch and accumulation")
    optim: SerializeAsAny[OptimizerSection] = Field(
        default_factory=lambda: registry.optimizer_sections()[DEFAULT_OPTIMIZER](), description="optimizer and schedule")
    precision: PrecisionConfig = Field(PrecisionConfig(), description="mixed precision")
    log: LogConfig = Field(LogConfig(), description="logging")
    eval: EvalConfig = Field(EvalConfig(), description="evaluation")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="checkpoints")
    pipeline: PipelineConfig = Field(PipelineConfig(), description="pipeline parallelism")
    sample: SampleConfig = Field(SampleConfig(), description="the text sample after training")
    profile: ProfileConfig = Field(ProfileConfig(), description="profiler trace of train steps")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("impl"), dict):
            key = next(iter(raw["impl"]), "scan_layers")
            raise ValueError(f"impl.{key}: the impl section moved under the model that reads it: write "
                             f"model.impl.{key} (in YAML, an impl: mapping inside model:)")
        return raw

    @field_validator("model", mode="wrap")
    @classmethod
    def _model_section(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _pick("model", registry.model_sections(), DEFAULT_MODEL, value, handler)

    @field_validator("optim", mode="wrap")
    @classmethod
    def _optimizer_section(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _pick("optim", registry.optimizer_sections(), DEFAULT_OPTIMIZER, value, handler)

    @field_validator("run_dir")
    @classmethod
    def _run_dir_given(cls, run_dir: str) -> str:
        # An empty path would be the working directory: checkpoints and metrics among other files.
        if not run_dir.strip():
            raise ValueError(f"run_dir={run_dir!r} is empty; give the run's directory, e.g. run_dir=runs/mine")
        return local_path("run_dir", run_dir)

    @model_validator(mode="after")
    def _gathered_copies(self) -> Config:
        if self.train.fsdp_gather != "per_layer" and not self.precision.compute_copies:
            raise ValueError(f"train.fsdp_gather={self.train.fsdp_gather} gathers the compute-dtype copies of "
                             f"the weights: it needs precision.compute_copies=true")
        return self

    def to_yaml(self) -> str:
        """The whole config as YAML, every key with its value (what run_dir/config.yaml holds)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
