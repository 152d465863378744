"""Exact evaluation over a whole split: jitted sums per batch, added up on the host.

Eval batches carry `weights` (1 for a real example, 0 for the padding that fills the last
batch). The model's loss (`ModelEntry.loss`) gives each batch's weighted sums (the loss, the count
of correct predictions, ...) and their weight (tokens that count, or examples); XLA adds the rows of
every device and process. The host adds the batches' sums and weights in float64 and divides each
total by the total weight, so every metric is the exact mean over the split (per token for a
language model, packed rows too), whatever the batch size, layout or process count. The model runs
in eval mode (`model.eval()`: BatchNorm normalizes by its running averages and updates nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.models.loss import as_loss
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.feed import batch_sharding
from jaxdist.train import state as state_lib
from jaxdist.train.accumulate import LossFn

Batch = dict[str, Any]


def make_eval_step(
    graphdef: nnx.GraphDef, loss_fn: LossFn, mesh: Mesh, rules: rules_lib.Rules, param_shardings: Any,
    model_state_shardings: Any = None,
) -> Callable[[Any, Any, Batch], tuple[dict[str, jax.Array], jax.Array]]:
    """The jitted `eval_step(params, model_state, batch) -> ({metric: sum}, total weight)` of one global batch."""

    def eval_step(params, model_state, batch: Batch):
        with rules_lib.activation_rules(mesh, rules):
            model = state_lib.merge(graphdef, params, model_state)
            model.eval()
            loss = as_loss(loss_fn(model, batch), batch)
        return {"loss": loss.total, **loss.metrics}, loss.weight

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(eval_step, in_shardings=(param_shardings, model_state_shardings, batch_sharding(mesh, rules)),
                   out_shardings=replicated)


class Evaluator:
    """The mean of each metric of a `Trainer`'s current model over every example of an eval split."""

    def __init__(self, trainer, loss_fn: LossFn, batches: Callable[[], Iterator[dict[str, np.ndarray]]]):
        """`loss_fn`: the model's loss (`models.ModelEntry.loss`); `batches()` starts a fresh pass of
        this process's local eval batches (with `weights`)."""
        self._trainer = trainer
        self._batches = batches
        shardings = trainer.state_shardings
        self._step = make_eval_step(trainer.graphdef, loss_fn, trainer.mesh, trainer.rules, shardings.params,
                                    shardings.model_state)

    def warm_up(self) -> None:
        """Compiles the eval step on the split's first batch, so that the first evaluation costs no more
        than the others."""
        first = next(iter(self._batches()))
        state = self._trainer.state
        jax.block_until_ready(self._step(state.params, state.model_state, self._trainer.global_batch(first)))

    def __call__(self) -> dict[str, float]:
        """`{"eval_" + metric: mean over the split}`, e.g. eval_loss and eval_accuracy."""
        return self.over(self._batches)

    def over(self, batches: Callable[[], Iterator[dict[str, np.ndarray]]]) -> dict[str, float]:
        """As `__call__`, over another split's batches (of the same shapes: the step is compiled once)."""
        state = self._trainer.state
        results = []
        for local in batches():
            results.append(self._step(state.params, state.model_state, self._trainer.global_batch(local)))
            if self._trainer.finish_each_step:  # as the train step: no two programs in flight on CPU
                jax.block_until_ready(results[-1])
        results = jax.device_get(results)
        weight = sum(np.float64(batch_weight) for _, batch_weight in results)
        return {f"eval_{name}": float(sum(np.float64(sums[name]) for sums, _ in results) / weight)
                for name in results[0][0]}


class MixtureEvaluator:
    """Each source of a data mixture evaluated apart, `eval_<source>_<metric>`, and `eval_<metric>` the
    mean of the sources' weighted as the mixture weighs them; one compiled eval step for all."""

    def __init__(self, evaluator: Evaluator, batches: dict[str, Callable[[], Iterator[dict[str, np.ndarray]]]],
                 weights: dict[str, float]):
        self._evaluator, self._batches = evaluator, batches
        total = sum(weights.values())
        self._shares = {name: weight / total for name, weight in weights.items()}

    def warm_up(self) -> None:
        self._evaluator.warm_up()

    def __call__(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, batches in self._batches.items():
            for key, value in self._evaluator.over(batches).items():
                metric = key.removeprefix("eval_")
                out[f"eval_{name}_{metric}"] = value
                out[f"eval_{metric}"] = out.get(f"eval_{metric}", 0.0) + self._shares[name] * value
        return out
