"""What a checkpoint's parts are called: its three Orbax items, and each array of a state by its
dotted path, as Orbax names it (`opt_state.1.0.mu.blocks.attn.qkv`).

Saving (`jaxdist.checkpoint.store`) writes by these names and restoring
(`jaxdist.checkpoint.restore`) reads and compares by them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# The items of `run_dir/checkpoints/<step>/`: the train state, the JSON meta, the arrays' digests.
STATE, META, DIGESTS = "state", "meta", "digests"


def named_arrays(tree: Any) -> dict[str, Any]:
    """`{dotted.path: leaf}` of every array-like leaf of `tree`, in tree order."""
    return {dotted_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def leaf_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{dotted.path: (shape, dtype)}` of every array-like leaf, in tree order.

    Works on live states, abstract states and Orbax's saved metadata alike, and names leaves the
    way Orbax does (`opt_state.1.0.mu.blocks.attn.qkv`).
    """
    shapes = {}
    for name, leaf in named_arrays(tree).items():
        if is_prng_key(leaf):
            # A typed PRNG key array is saved as its key data (uint32, one more axis or more).
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        shapes[name] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return shapes


def dotted_name(path) -> str:
    """A pytree key path as Orbax names it: `opt_state.1.0.mu.blocks.attn.qkv`."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def is_prng_key(leaf: Any) -> bool:
    """Whether `leaf` is a typed PRNG key array (or its abstract shape)."""
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
