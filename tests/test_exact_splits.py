"""Principle 2 on packed rows: a step means the same under any split of the batch.

The rows here pack documents of very different lengths, so they carry real padding and each
microbatch or batch shard holds a different number of counted tokens. The loss is one token mean
over the global batch (the sums and weights of every part added, divided once), so the first
step's loss and gradient norm are the same on one device, with 4 microbatches, on data=2 x fsdp=4
with 2 microbatches, in a pipeline of 2 stages and 4 microbatches, and with int8-compressed
gradients (the loss; the gradients are compressed, so only close). Two processes:
tests/test_layouts_multiprocess.py, on the same kind of rows. The eval loss of a packed split is
the token mean of its rows, as numpy computes it.
"""

import json

import jax
import numpy as np
import optax
import pytest
from conftest import make_config
from flax import nnx

import jaxdist
from jaxdist import loop
from jaxdist.data import loader
from jaxdist.models import gpt
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.evaluate import Evaluator
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

MODEL = {"vocab": "auto", "d_model": 32, "layers": 2, "heads": 4, "seq_len": 32}
GLOBAL_BATCH = 16


def _config(run_dir, data, **sections):
    train = {"steps": 1, "global_batch": GLOBAL_BATCH, **sections.pop("train", {})}
    return make_config(run_dir, model=MODEL, train=train, precision={"compute": "float32"}, data=data,
                       optim={"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "clip_norm": None},
                       **sections)


def _first_step(run_dir) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, packed_corpus):
    run_dir = tmp_path_factory.mktemp("one_device")
    loop.train(_config(run_dir, packed_corpus, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}),
               devices=jax.devices()[:1])
    return _first_step(run_dir)


SPLITS = {
    "microbatches4": ({"data": 1, "fsdp": 1, "tensor": 1}, {"preset": "dp"}, {"train": {"microbatches": 4}}, 1),
    "data2_fsdp4_microbatches2": ({"data": 2, "fsdp": 4, "tensor": 1}, {"preset": "fsdp"},
                                  {"train": {"microbatches": 2}}, None),
    "stage2_pipeline4": ({"data": 1, "stage": 2, "fsdp": 4, "tensor": 1}, {"preset": "fsdp"},
                         {"pipeline": {"microbatches": 4}}, None),
}


@pytest.mark.parametrize("name", SPLITS)
def test_a_packed_step_is_the_same_under_any_split(tmp_path, packed_corpus, one_device, name):
    mesh, rules, sections, devices = SPLITS[name]
    cfg = _config(tmp_path, packed_corpus, mesh=mesh, rules=rules, **sections)
    loop.train(cfg, devices=None if devices is None else jax.devices()[:devices])
    got = _first_step(tmp_path)
    np.testing.assert_allclose([got["loss"], got["grad_norm"]], [one_device["loss"], one_device["grad_norm"]],
                               rtol=1e-5, atol=0)


def test_a_compressed_step_has_the_exact_token_mean_loss(tmp_path, packed_corpus, one_device):
    cfg = _config(tmp_path, packed_corpus, mesh={"data": 8, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                  train={"grad_compression": "int8"})
    loop.train(cfg)
    got = _first_step(tmp_path)
    np.testing.assert_allclose(got["loss"], one_device["loss"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["grad_norm"], one_device["grad_norm"], rtol=2e-2)


def test_the_eval_loss_of_a_packed_split_is_its_token_mean(tmp_path, packed_corpus):
    cfg = loader.resolve_model(_config(tmp_path, packed_corpus, mesh={"data": 2, "fsdp": 4, "tensor": 1},
                                       rules={"preset": "fsdp"}))
    trainer = Trainer.from_config(cfg)
    rows = trainer.process_rows(GLOBAL_BATCH)
    batches = lambda: loader.eval_iterator(cfg, rows)  # noqa: E731
    evaluated = Evaluator(trainer, gpt.loss, batches)()["eval_loss"]

    model = nnx.merge(trainer.graphdef, jax.device_get(trainer.params))
    token_losses = jax.jit(lambda b: optax.softmax_cross_entropy_with_integer_labels(
        model(b["inputs"], b["segments"], b["positions"]), b["targets"]))
    total, tokens, padded_rows = 0.0, 0, 0
    for batch in batches():
        counted = (batch["segments"] > 0) & (batch["weights"][:, None] > 0)
        total += np.asarray(token_losses(batch), np.float64)[counted].sum()
        tokens += int(counted.sum())
        padded_rows += int((batch["segments"] == 0).any(axis=1).sum())
    assert padded_rows > 4 and tokens < 0.9 * GLOBAL_BATCH * MODEL["seq_len"] * len(list(batches()))
    np.testing.assert_allclose(evaluated, total / tokens, rtol=1e-6)


class _Tagger(nnx.Module):
    """A per-token classifier of a user's own: a `jaxdist.Loss` over the tokens its mask counts."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(nnx.with_partitioning(init, ("features", "classes"))(rngs.params(), (8, 5)))


def _masked_loss(model, batch):
    logits = batch["x"] @ model.w[...]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jaxdist.Loss((losses * batch["mask"]).sum(), batch["mask"].sum())


def test_a_user_loss_of_sums_is_the_same_under_any_split():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 6, 8)).astype(np.float32), "y": rng.integers(0, 5, (32, 6)).astype(np.int32),
             # rows counting 0 to 6 tokens, the counted ones crowded into the first rows
             "mask": (np.arange(6)[None, :] < np.linspace(6, 0, 32)[:, None]).astype(np.float32)}
    user_rules = rules_lib.preset("dp").override(params={"features": None, "classes": None})
    steps = {}
    for name, mesh, microbatches in (("one", {"data": 1}, 1), ("data8_microbatches2", {"data": 8}, 2),
                                     ("data2_microbatches4", {"data": 2}, 4)):
        devices = jax.devices()[:mesh["data"]]
        trainer = jaxdist.Trainer(_Tagger, _masked_loss, optax.sgd(0.1), mesh_lib.make_mesh(**mesh, devices=devices),
                                  user_rules, options=jaxdist.StepOptions(microbatches=microbatches))
        steps[name] = {key: float(value) for key, value in trainer.step(batch).items() if key in ("loss", "grad_norm")}
    for name, got in steps.items():
        np.testing.assert_allclose([got["loss"], got["grad_norm"]], [steps["one"]["loss"], steps["one"]["grad_norm"]],
                                   rtol=1e-6, err_msg=name)
