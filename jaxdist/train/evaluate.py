"""Exact evaluation over a whole split: a jitted weighted loss per batch, summed on the host.

Eval batches carry `weights` (1 for a real example, 0 for the padding that fills the last
batch); the loss function must weight examples by them (`models.lm_loss` does). Each batch
gives (mean loss x weight, weight), so the total over all batches is the exact mean over the
split, whatever the batch size or process count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.parallel import rules as rules_lib
from jaxdist.train.accumulate import LossFn, loss_and_aux
from jaxdist.parallel.feed import batch_sharding

Batch = dict[str, Any]


def make_eval_step(
    graphdef: nnx.GraphDef, loss_fn: LossFn, mesh: Mesh, rules: rules_lib.Rules, param_shardings: Any
) -> Callable[[Any, Batch], tuple[jax.Array, jax.Array]]:
    """The jitted `eval_step(params, batch) -> (loss x total weight, total weight)` of one global batch."""

    def eval_step(params, batch: Batch):
        with rules_lib.activation_rules(mesh, rules):
            loss, _ = loss_and_aux(loss_fn(nnx.merge(graphdef, params), batch))
        weight = batch["weights"].sum()
        return loss * weight, weight

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding(mesh, rules)), out_shardings=replicated)


class Evaluator:
    """The mean loss of a `Trainer`'s current parameters over every example of an eval split."""

    def __init__(self, trainer, loss_fn: LossFn, batches: Callable[[], Iterator[dict[str, np.ndarray]]]):
        """`batches()` starts a fresh pass of this process's local eval batches (with `weights`)."""
        self._trainer = trainer
        self._batches = batches
        self._step = make_eval_step(
            trainer.graphdef, loss_fn, trainer.mesh, trainer.rules, trainer.state_shardings.params
        )

    def __call__(self) -> float:
        params = self._trainer.params
        sums = []
        for local in self._batches():
            sums.append(self._step(params, self._trainer.global_batch(local)))
            if self._trainer.finish_each_step:  # as the train step: no two programs in flight on CPU
                jax.block_until_ready(sums[-1])
        loss, weight = np.asarray(jax.device_get(sums), np.float64).sum(axis=0)
        return float(loss / weight)
