"""SyncBatchNorm: the statistics are the whole batch's under any layout and microbatching.

A tiny model (a linear layer, BatchNorm, a head) runs through the step's own `loss_and_grads` on
one device and on 8 devices (data=8): the batch mean and variance (read back from the running
averages one update moved) equal the whole batch's, computed in numpy, and the 8-device running
averages and gradients equal the one-device ones, also with 2 microbatches through both
gradient reductions (per_step's per-shard vmap included).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist.models import batchnorm, classifier
from jaxdist.models.batchnorm import BatchNorm
from jaxdist.parallel import feed
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.mesh import build_mesh
from jaxdist.train.accumulate import GradInputs, loss_and_grads
from jaxdist.train.options import StepLayout, StepOptions
from jaxdist.train.state import abstract_model, model_variables
from jaxdist.train.trainer import Trainer

BATCH, FEATURES, MOMENTUM = 32, 6, 0.9
MESHES = {"one": {"data": 1}, "data8": {"data": 8}}


class TinyBatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mix = nnx.Linear(3, FEATURES, kernel_metadata={"out_sharding": ("embed", "conv_out")}, use_bias=False,
                              rngs=rngs)
        self.norm = BatchNorm(FEATURES, ("conv_out",), momentum=MOMENTUM)
        self.head = nnx.Linear(FEATURES, 4, kernel_metadata={"out_sharding": ("embed", "classes")},
                               bias_metadata={"out_sharding": ("classes",)}, rngs=rngs)

    def __call__(self, images):
        features = self.norm(self.mix(images))  # statistics over batch, height and width
        return self.head(features.mean(axis=(1, 2)))


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    # Rows of the second half are shifted: a shard's statistics would differ from the whole batch's.
    images = rng.normal(size=(BATCH, 2, 2, 3)).astype(np.float32) + np.repeat([0.0, 2.0], BATCH // 2)[:, None, None, None]
    return {"images": images, "labels": rng.integers(0, 4, BATCH).astype(np.int32)}


def _run(mesh_shape: dict[str, int], microbatches: int, reduction: str):
    """(running averages after the step, gradients), on the host."""
    devices = jax.devices()[: mesh_shape["data"]]
    mesh = build_mesh({"data": mesh_shape["data"], "stage": 1, "fsdp": 1, "tensor": 1}, devices)
    rules = rules_lib.preset("dp")
    abstract = abstract_model(TinyBatchNormNet, 0)
    param_shardings = rules_lib.layout_shardings(rules_lib.param_layouts(abstract.params, abstract.names, rules, mesh),
                                                 mesh)
    params, model_state = jax.jit(lambda: model_variables(TinyBatchNormNet, 0))()

    def step(params, model_state, batch):
        with rules_lib.activation_rules(mesh, rules):
            _, _, grads, model_state, _ = loss_and_grads(
                abstract.graphdef, classifier.loss, GradInputs(params, model_state), batch, StepLayout(mesh, rules),
                param_shardings, StepOptions(microbatches=microbatches, grad_reduction=reduction))
        return model_state, grads

    batch = feed.assemble(_batch(), feed.batch_sharding(mesh, rules))
    params = jax.device_put(params, param_shardings)
    compiled = jax.jit(step).lower(params, model_state, batch).compile()
    return jax.device_get(compiled(params, model_state, batch))


def _whole_batch_statistics(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased) variance over batch, height and width of the BatchNorm's input, in float64."""
    params, _ = jax.device_get(jax.jit(lambda: model_variables(TinyBatchNormNet, 0))())
    features = np.einsum("bhwc,cf->bhwf", rows.astype(np.float64), params["mix"]["kernel"])
    return features.mean(axis=(0, 1, 2)), features.var(axis=(0, 1, 2))


def test_statistics_are_the_whole_batch_on_one_device_and_on_eight():
    images = _batch()["images"]
    mean, var = _whole_batch_statistics(images)
    for name, shape in MESHES.items():
        state, _ = _run(shape, 1, "per_step")
        running = state["norm"]
        # One update from (mean 0, var 1): the batch's statistics are (running - m x old) / (1 - m).
        np.testing.assert_allclose((running["mean"] - 0.0) / (1 - MOMENTUM), mean, rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose((running["var"] - MOMENTUM) / (1 - MOMENTUM), var, rtol=0, atol=1e-5, err_msg=name)
    # The running averages themselves, to the float rounding of the sums' order.
    one, eight = _run(MESHES["one"], 1, "per_step")[0], _run(MESHES["data8"], 1, "per_step")[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), eight, one)


@pytest.mark.parametrize("reduction", ["per_step", "per_microbatch"])
def test_microbatches_normalize_the_same_rows_on_any_layout(reduction):
    """Two microbatches: each normalizes by its own rows across all 8 devices (every other row of
    the batch, as on one device), and the running averages move twice, in order."""
    images = _batch()["images"]
    expected_state = {"mean": np.zeros(FEATURES), "var": np.ones(FEATURES)}
    for micro in (images[0::2], images[1::2]):
        mean, var = _whole_batch_statistics(micro)
        expected_state = {"mean": MOMENTUM * expected_state["mean"] + (1 - MOMENTUM) * mean,
                          "var": MOMENTUM * expected_state["var"] + (1 - MOMENTUM) * var}
    one_state, one_grads = _run(MESHES["one"], 2, reduction)
    state, grads = _run(MESHES["data8"], 2, reduction)
    for key in ("mean", "var"):
        np.testing.assert_allclose(one_state["norm"][key], expected_state[key], rtol=0, atol=1e-6)
        np.testing.assert_allclose(state["norm"][key], one_state["norm"][key], rtol=0, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, one_grads)


@pytest.mark.parametrize("relu", [False, True])
def test_the_written_out_gradient_is_autodiffs_of_the_formula(relu):
    """`batchnorm.normalize`'s backward against autodiff of the same forward (in float64 on the
    host), with a ReLU that cuts about half the outputs."""
    rng = np.random.default_rng(0)
    x = (3.0 * rng.normal(size=(16, 3, 3, FEATURES)) + 1.0).astype(np.float32)
    scale, bias = rng.normal(size=FEATURES).astype(np.float32), 0.1 * rng.normal(size=FEATURES).astype(np.float32)
    d_y = rng.normal(size=x.shape).astype(np.float32)

    def formula(x, scale, bias):
        mean = x.mean(axis=(0, 1, 2))
        var = jnp.maximum(jnp.square(x).mean(axis=(0, 1, 2)) - jnp.square(mean), 0.0)
        y = (x - mean) * scale * jax.lax.rsqrt(var + 1e-5) + bias
        return jax.nn.relu(y) if relu else y

    def written_out(x, scale, bias):
        return batchnorm.normalize(x, scale, bias, 1e-5, relu)[0]

    with jax.enable_x64():
        want_y, want_vjp = jax.vjp(formula, *(np.asarray(a, np.float64) for a in (x, scale, bias)))
        want = want_vjp(np.asarray(d_y, np.float64))
    got_y, got_vjp = jax.vjp(written_out, x, scale, bias)
    if relu:
        assert 0.3 < float(jnp.mean(got_y == 0)) < 0.7
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    for got, expected in zip(got_vjp(d_y), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_eval_mode_normalizes_by_the_running_averages():
    abstract = abstract_model(TinyBatchNormNet, 0)
    params, model_state = jax.jit(lambda: model_variables(TinyBatchNormNet, 0))()
    model_state = {"norm": {"mean": jnp.full(FEATURES, 0.5), "var": jnp.full(FEATURES, 4.0)}}
    model = nnx.merge(abstract.graphdef, params, model_state)
    model.eval()
    x = jnp.asarray(_batch()["images"][:2]) @ params["mix"]["kernel"]
    want = (x - 0.5) / np.sqrt(4.0 + 1e-5)
    np.testing.assert_allclose(model.norm(x), want, rtol=1e-6)
    assert float(model.norm.mean[0]) == 0.5  # nothing updated in eval mode


class FlaxBatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.BatchNorm(3, rngs=rngs)
        self.head = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, images):
        return self.head(self.norm(images).mean(axis=(1, 2)))


def test_flax_batch_norm_under_per_shard_gradients_is_refused(devices):
    """flax's own BatchNorm would normalize each shard by its own rows in per_step's vmap: refused
    there; elsewhere its statistics are the global batch's, as XLA partitions its mean."""
    mesh = build_mesh({"data": 8, "stage": 1, "fsdp": 1, "tensor": 1}, devices)
    make = functools.partial(Trainer, FlaxBatchNormNet, classifier.loss, optax.sgd(0.1), mesh, rules_lib.preset("dp"))
    with pytest.raises(ValueError, match="flax's nnx.BatchNorm would take its statistics from one batch shard"):
        make(options=StepOptions(microbatches=2))
    trainer = make(options=StepOptions(microbatches=2, grad_reduction="per_microbatch"))
    trainer.step(_batch())
    assert trainer.state.model_state["norm"]["mean"].shape == (3,)
