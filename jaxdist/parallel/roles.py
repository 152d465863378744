"""What each parameter is, its role: a weight, a bias, a norm's scale or offset, or an embedding.

Weight decay, LAMB's and LARS's trust ratio (train/optimizers/parts.py) and the compressed
gradient reduction (parallel/compression.py) treat a parameter by its role, never by its shape:
GPT-2's and Qwen2's attention biases have three axes (qkv, heads, head_dim) and are biases all the
same. A model declares each role where it makes the parameter, as variable metadata beside its
logical names:

    nnx.Param(init(key, shape), out_sharding=("heads", "head_dim"), role="bias")

A parameter that declares none takes the role its name has in flax's own layers: `bias`
(nnx.Linear, nnx.Conv, the norms) a bias, `scale` (the norms) a norm, `embedding` (nnx.Embed) an
embedding; any other is a weight. To treat one otherwise, declare its role.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxdist.errors import UserError
from jaxdist.parallel.rules import path_str

WEIGHT, BIAS, NORM, EMBEDDING = "weight", "bias", "norm", "embedding"
ROLES = (WEIGHT, BIAS, NORM, EMBEDDING)
METADATA = "role"  # the variable metadata key a model declares a role under
_BY_FLAX_NAME = {"bias": BIAS, "scale": NORM, "embedding": EMBEDDING}


def role_of(path: tuple, variable: nnx.Variable) -> str:
    """The role of the parameter at `path` (a pytree path): declared, else by its flax name."""
    declared = variable.get_metadata().get(METADATA)
    if declared is None:
        return _BY_FLAX_NAME.get(str(getattr(path[-1], "key", path[-1])), WEIGHT) if path else WEIGHT
    if declared not in ROLES:
        raise UserError(f"parameter {path_str(path)} declares role={declared!r}; a role is one of {', '.join(ROLES)}")
    return declared


def roles(variables: nnx.State) -> Any:
    """Each variable's role, a pure dict tree shaped like `nnx.to_pure_dict(variables)`."""
    return nnx.to_pure_dict(jax.tree.map_with_path(role_of, variables, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def is_weight(role: str) -> bool:
    """A matrix the model multiplies by (weights and embeddings): what decay's, trust ratios' and
    compression's defaults treat as a weight."""
    return role in (WEIGHT, EMBEDDING)
