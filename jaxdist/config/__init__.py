"""Typed run configuration: YAML file + dotted overrides, validated before anything compiles.

One pydantic section per part of a run (`sections`); the model's and the optimizer's sections are
declared beside their own code and registered by name (`registry`), and `model.name` and
`optim.name` pick one. Unknown keys and wrong types are a `UserError` naming the dotted key
(`files`); `jaxdist.parallel.layout` adds the checks that need the devices.
"""

from jaxdist.config.base import (MODEL_NAME, OPTIMIZER_NAME, ClassCount, ClassifierSection, ImageShape, ModelSection,
                                 OptimizerSection, ParamSize, Section)
from jaxdist.config.files import (DuplicateKey, UniqueKeyLoader, describe, from_dict, load, recipes, recipes_folder,
                                  with_overrides)
from jaxdist.config.registry import model_sections, optimizer_sections, register_model, register_optimizer
from jaxdist.config.root import Config
from jaxdist.config.sections import (MESH_AXES, AugmentConfig, CheckpointConfig, DataConfig, EvalConfig, LogConfig,
                                     MeshConfig, PipelineConfig, PrecisionConfig, ProfileConfig, RulesConfig,
                                     SampleConfig, TrainConfig)

__all__ = [
    "MESH_AXES", "MODEL_NAME", "OPTIMIZER_NAME", "AugmentConfig", "CheckpointConfig", "ClassCount", "ClassifierSection", "Config", "DataConfig",
    "DuplicateKey", "EvalConfig", "ImageShape", "LogConfig", "MeshConfig", "ModelSection", "OptimizerSection",
    "ParamSize", "PipelineConfig", "PrecisionConfig", "ProfileConfig", "RulesConfig", "SampleConfig", "Section",
    "TrainConfig", "UniqueKeyLoader", "describe", "from_dict", "load", "model_sections", "optimizer_sections",
    "recipes", "recipes_folder", "register_model", "register_optimizer", "with_overrides",
]
