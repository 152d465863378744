"""The loss-spike guard: a finite loss far above its running average is a bad step.

A learning rate far too large diverges without ever producing a NaN: the loss jumps from 2 to
1e13 and stays finite. The step compares each loss with the running average of the losses of
the steps it applied; one above `factor` times that average is a spike, and a spike is handled
like a non-finite step (`precision.verdict`): its update is dropped, and the run halts or skips
it as `train.on_nonfinite` says. The average is part of the train state, so it is checkpointed
and a resumed run is guarded from its first step.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

# The average is armed once it holds this many applied steps: the first losses of a run fall fast
# and say little about the scale of later ones.
ARMED_AFTER = 10
# The average is a mean of the first WINDOW applied losses, then an exponential one with that span.
WINDOW = 100


class LossStats(flax.struct.PyTreeNode):
    """The running average of the applied steps' losses, and how many it holds (at most WINDOW)."""

    average: jax.Array
    count: jax.Array

    @classmethod
    def create(cls) -> LossStats:
        return cls(average=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32))

    def is_spike(self, loss: jax.Array, factor: float | None) -> jax.Array:
        """Whether `loss` is more than `factor` times the average (never before it is armed; never
        with `factor` None)."""
        if factor is None:
            return jnp.bool_(False)
        armed = (self.count >= ARMED_AFTER) & (self.average > 0)  # a loss that can be negative has no scale
        return armed & (loss.astype(jnp.float32) > factor * self.average)

    def updated(self, loss: jax.Array, applied: jax.Array) -> LossStats:
        """The statistics after a step: `loss` counted where the step was applied."""
        count = jnp.minimum(self.count + 1, WINDOW)
        average = self.average + (loss.astype(jnp.float32) - self.average) / count.astype(jnp.float32)
        return LossStats(average=jnp.where(applied, average, self.average),
                         count=jnp.where(applied, count, self.count))
