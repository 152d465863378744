"""Each layer's gradient reduction ordered into the backward pass (`model.overlap_grad_reduce`).

Under data parallelism XLA reduces every weight gradient across devices, and its scheduler is free
to put the weight-gradient matmuls, and so their all-reduces, anywhere before the optimizer. It
puts them at the end of the backward: the input gradients first (the critical path), then every
layer's weight gradients and all-reduces one after the other, with little compute left to overlap
(406M GPT, 2 H200s: 24 all-reduces between 1-2 matmuls each, 2.7 ms per step with no kernel beside
them). PyTorch DDP starts each bucket's all-reduce from a backward hook as soon as its gradients
exist.

`tie(later, x)` is the hook's counterpart as a data dependency: the identity in the forward pass,
it makes the backward wait, at `x`, for the gradient of `later` (parameters used after `x`,
a layer or more further on), all-reduce included. Tying layer i + 1's parameters to layer i's
input makes layer i + 1's weight gradients and their reduction happen while layer i's backward
runs: the reduction has one layer's backward to hide behind, and the next layer's cannot start
before it is done. The barrier is only an ordering: values and gradients are unchanged.
"""

from __future__ import annotations

from typing import Any

import jax


@jax.custom_vjp
def tie(later: Any, x: jax.Array) -> tuple[Any, jax.Array]:
    """`(later, x)` unchanged; backward, `x`'s gradient waits for `later`'s (see the module doc)."""
    return later, x


def _tie_fwd(later, x):
    return (later, x), None


def _tie_bwd(_, grads):
    return jax.lax.optimization_barrier(grads)


tie.defvjp(_tie_fwd, _tie_bwd)
