"""The optimizers (`registry`): AdamW, SGD, LAMB, LARS and Adafactor, each in its own file with its
config section. Importing the package registers them; `optim.name` picks one."""

from jaxdist.train.optimizers import adafactor, adamw, lamb, lars, sgd  # noqa: F401  (each registers itself)
from jaxdist.train.optimizers.registry import OPTIMIZERS, Optimizer, get, register

__all__ = ["OPTIMIZERS", "Optimizer", "get", "register"]
