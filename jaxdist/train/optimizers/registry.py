"""The optimizers, registered by name: `optim.name` picks one, with its section of keys.

An optimizer is one file: its config section (an `OptimizerSection` subclass, adding its own keys
to the ones every optimizer has) and the function that builds its optax transformation from that
section, the learning-rate schedule and the masks (`parts.Masks`), registered with one line,
`register(Section, build)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optax

from jaxdist.config import OptimizerSection, register_optimizer
from jaxdist.errors import UserError
from jaxdist.train.optimizers.parts import Masks

Build = Callable[[OptimizerSection, optax.Schedule, Masks], optax.GradientTransformation]


class Optimizer(NamedTuple):
    section: type[OptimizerSection]
    build: Build


OPTIMIZERS: dict[str, Optimizer] = {}


def register(section: type[OptimizerSection], build: Build) -> None:
    """Makes `build` the optimizer `optim.name=<the section's name>` runs, and `section` its keys."""
    register_optimizer(section)
    OPTIMIZERS[section.model_fields["name"].default] = Optimizer(section, build)


def get(name: str) -> Optimizer:
    """The registered optimizer called `name`; a `UserError` naming the choices otherwise."""
    if name not in OPTIMIZERS:
        raise UserError(f"optim.name={name!r} is not a registered optimizer; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]
