"""The model and optimizer sections, registered by name: `model.name` and `optim.name` pick one.

A model or an optimizer declares its section beside its code and registers it there (with
`jaxdist.models.register` and `jaxdist.train.optimizers.register`, which also register what builds
it). The built-in ones register when `jaxdist.models` and `jaxdist.train.optimizers` are imported;
a name not registered yet imports that package first, so a config names a built-in model or
optimizer without its caller importing the package.
"""

from __future__ import annotations

import importlib

from jaxdist.config.base import ModelSection, OptimizerSection

_MODELS: dict[str, type[ModelSection]] = {}
_OPTIMIZERS: dict[str, type[OptimizerSection]] = {}
# Where the built-in sections register themselves.
_BUILT_IN = {"model": "jaxdist.models", "optimizer": "jaxdist.train.optimizers"}


def register_model(section: type[ModelSection]) -> type[ModelSection]:
    """Makes `section` the `model:` section of `model.name=<its name's default>`."""
    _MODELS[section.model_fields["name"].default] = section
    return section


def register_optimizer(section: type[OptimizerSection]) -> type[OptimizerSection]:
    """Makes `section` the `optim:` section of `optim.name=<its name's default>`."""
    _OPTIMIZERS[section.model_fields["name"].default] = section
    return section


def model_sections() -> dict[str, type[ModelSection]]:
    """Every registered model section by name (the built-in ones always among them)."""
    importlib.import_module(_BUILT_IN["model"])
    return dict(_MODELS)


def optimizer_sections() -> dict[str, type[OptimizerSection]]:
    """Every registered optimizer section by name (the built-in ones always among them)."""
    importlib.import_module(_BUILT_IN["optimizer"])
    return dict(_OPTIMIZERS)
