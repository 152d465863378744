"""Image classifiers: their config sections, sizes, FLOPs, the digits data, and their user errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RESNET, make_classifier_config
from flax import nnx

from jaxdist import cli, config, models
from jaxdist.config import model_sections
from jaxdist.data import digits, loader
from jaxdist.errors import UserError
from jaxdist.models import classifier
from jaxdist.train.state import abstract_model

# torchvision's published sizes at 224x224x3 and 1000 classes: parameters, and multiply-adds of one
# forward pass (its "GFLOPS" column, 1.81 and 4.09).
PUBLISHED = {18: (11_689_512, 1.81e9), 50: (25_557_032, 4.09e9)}
def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("depth", [18, 50])
def test_resnet_sizes_are_the_published(depth):
    cfg = config.load(None, ["model.name=resnet", f"model.depth={depth}", "model.classes=1000",
                             "model.image_shape=[224,224,3]"])
    abstract = abstract_model(models.get("resnet").create(cfg), 0)  # shapes only, nothing allocated
    params, macs = PUBLISHED[depth]
    assert _count(abstract.params) == params
    # BatchNorm's running mean and variance: one pair per BatchNorm, which has a scale and an offset.
    assert _count(abstract.state) == 2 * sum(_count(norm) for norm in _norms(abstract.params))
    flops = models.get("resnet").flops_per_example(cfg)
    assert flops % 6 == 0 and abs(flops / 6 / macs - 1) < 0.005


def _norms(params):
    """The BatchNorm scales among the parameters (their offsets have the same size)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [leaf for path, leaf in flat if getattr(path[-1], "key", None) == "scale"]


def test_mlp_sizes_and_flops():
    cfg = config.load(None, ["model.name=mlp", "model.hidden=[32,16]", "model.classes=10", "model.image_shape=[8,8,1]"])
    abstract = abstract_model(models.get("mlp").create(cfg), 0)
    assert _count(abstract.params) == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)
    assert abstract.state is None  # no BatchNorm: no model state
    assert models.get("mlp").flops_per_example(cfg) == 6 * (64 * 32 + 32 * 16 + 16 * 10)


def test_gpt_flops_per_example_is_palms_model_flops_per_token_times_tokens():
    cfg = config.load("tiny")
    m = cfg.model
    per_token = 6 * (12 * m.layers * m.d_model**2 + m.vocab * m.d_model) + 12 * m.layers * m.d_model * m.seq_len
    assert models.get("gpt").flops_per_example(cfg) == per_token * m.seq_len


def test_every_registered_model_has_a_config_section():
    assert set(models.MODELS) == set(model_sections()) == {"gpt", "deepseek", "gemma", "llama", "mlp", "resnet"}
    for name, section in model_sections().items():
        assert section().name == name and models.get(name).section is section


def test_8_bit_pixels_are_scaled_on_the_device_to_the_floats_the_host_would_feed():
    cfg = config.load(None, ["model.name=mlp", "model.hidden=[16]", "model.classes=3", "model.image_shape=[4,4,3]",
                             "precision.compute=float32"])
    with nnx.use_eager_sharding(False):
        model = models.get("mlp").create(cfg)(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (8, 4, 4, 3), dtype=np.uint8)
    labels, weights = rng.integers(0, 3, 8, dtype=np.int32), np.ones(8, np.float32)
    scaled = pixels.astype(np.float32) / np.float32(255)  # what the host fed before: within one rounding
    unit = np.asarray(jax.jit(classifier.unit_range)(jnp.asarray(pixels)))
    assert unit.dtype == np.float32 and unit.min() >= 0 and unit.max() <= 1
    np.testing.assert_array_equal(unit, pixels.astype(np.float32) * np.float32(1 / 255))
    np.testing.assert_allclose(unit, scaled, rtol=2**-23, atol=0)
    as_pixels = classifier.loss(model, {"images": jnp.asarray(pixels), "labels": jnp.asarray(labels)}).mean
    as_floats = classifier.loss(model, {"images": jnp.asarray(scaled), "labels": jnp.asarray(labels)}).mean
    assert float(as_pixels) == pytest.approx(float(as_floats), rel=1e-6) and float(as_pixels) > 0
    weighted = classifier.loss(model, {"images": jnp.asarray(pixels), "labels": labels, "weights": weights})
    assert float(weighted.total) == pytest.approx(float(classifier.loss(
        model, {"images": jnp.asarray(scaled), "labels": labels, "weights": weights}).total), rel=1e-6)
    # Unscaled, the model would see 0 to 255: another loss.
    assert float(as_pixels) != pytest.approx(float(classifier.loss(
        model, {"images": jnp.asarray(pixels, jnp.float32), "labels": jnp.asarray(labels)}).mean), rel=1e-3)


def test_digits_split_is_fixed_real_and_disjoint():
    train, held_out = digits.split("train"), digits.split("eval")
    assert len(train["labels"]) == 1437 and len(held_out["labels"]) == 360
    assert train["images"].shape == (1437, 8, 8, 1) and train["images"].dtype == np.float32
    assert train["labels"].dtype == np.int32 and set(np.unique(held_out["labels"])) == set(range(10))
    assert 0.0 == train["images"].min() and train["images"].max() == 1.0
    # No eval image is a train image, and the split is the same on every call.
    train_rows = {row.tobytes() for row in train["images"]}
    assert not any(row.tobytes() in train_rows for row in held_out["images"][:50])
    np.testing.assert_array_equal(digits.split("eval")["labels"], held_out["labels"])


def test_auto_sizes_come_from_the_data(tmp_path):
    cfg = make_classifier_config(tmp_path, {"name": "resnet"})
    assert (cfg.model.classes, cfg.model.image_shape) == ("auto", "auto")
    resolved = loader.resolve_model(cfg)
    assert (resolved.model.classes, resolved.model.image_shape) == (10, [8, 8, 1])
    np.savez(tmp_path / "images.npz", images=np.zeros((6, 5, 4, 3), np.float32), labels=np.array([0, 6, 1, 2, 3, 4]))
    arrays = make_classifier_config(tmp_path, {"name": "mlp", "classes": 12},
                               data={"source": "arrays", "path": str(tmp_path / "images.npz")})
    assert loader.resolve_model(arrays).model.model_dump() == {
        "name": "mlp", "classes": 12, "image_shape": [5, 4, 3], "hidden": [256, 256]}
    with pytest.raises(UserError, match=r"^data.source=stdlib holds no labeled images to take the classes and image"):
        loader.resolve_model(make_classifier_config(tmp_path, {"name": "mlp"}, data={"source": "stdlib"}))
    with pytest.raises(UserError, match=r"^model.vocab=auto: data.source=digits holds images, not tokens"):
        loader.resolve_model(make_classifier_config(tmp_path, {"name": "gpt", "vocab": "auto"}))
    with pytest.raises(UserError, match=r"^model.image_shape=auto is not resolved; pass the config through"):
        models.get("mlp").create(make_classifier_config(tmp_path, {"name": "mlp", "classes": 10}))


MLP = {"name": "mlp"}


@pytest.mark.parametrize("model, overrides, message", [
    (MLP, ["model.d_model=64"],
     "config: unknown key 'model.d_model' for model.name=mlp; its keys: name, classes, image_shape, hidden "
     "(other models: gpt, deepseek, gemma, llama, resnet)"),
    (MLP, ["model.name=vit"], "config: model.name='vit' is not a registered model; use model.name: one of gpt, deepseek, gemma, llama, mlp, resnet"),
    (SMALL_RESNET, ["model.depth=34"], "config: model.depth=34: input should be 18 or 50"),
    (SMALL_RESNET, ["model.image_shape=[8,8]"],
     "config: model.image_shape=[8, 8]: use [height, width, channels] (three positive sizes), or auto (the data's)"),
    (SMALL_RESNET, ["model.impl.remat=full"],
     "config: unknown key 'model.impl' for model.name=resnet; its keys: name, classes, image_shape, depth, width, stem, "
     "bn_momentum (other models: gpt, deepseek, gemma, llama, mlp)"),
    (SMALL_RESNET, ["mesh.stage=2", "mesh.fsdp=4"],
     "mesh.stage=2 pipelines a stack of identical layers, and model.name=resnet has none; use mesh.stage=1"),
    ({**MLP, "classes": 10, "image_shape": [8, 8, 1]}, ["data.source=stdlib"],
     "data.source=stdlib holds token sequences, but model.name=mlp reads images and labels; use data.source=images, "
     "digits or arrays"),
    ({"name": "gpt", "d_model": 32, "heads": 4, "layers": 1, "seq_len": 16}, [],
     "data.source=digits lacks the array(s) inputs, targets that model.name=gpt reads (it holds images, labels); "
     "use a classifier (model.name=mlp or resnet)"),
], ids=["gpt_key_under_mlp", "unknown_model", "depth", "image_shape", "impl_key", "pipeline", "token_data",
        "gpt_on_digits"])
def test_classifier_mistakes_are_one_line_before_compiling(tmp_path, capsys, compiles, model, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(make_classifier_config(tmp_path / "run", model).to_yaml())
    assert cli.main(["train", str(path), *overrides]) == 2
    assert capsys.readouterr().err.strip() == f"jaxdist: error: {message}"
    assert compiles.count == 0


def test_rules_place_convolutions_by_preset(capsys):
    """`jaxdist rules` for a ResNet: kernels split on their output channels over fsdp (fsdp) or
    tensor (tp), BatchNorm's scale with its channels, the head's classes replicated."""
    tables = {}
    for preset, mesh in (("fsdp", ["mesh.data=1", "mesh.fsdp=8"]), ("tp", ["mesh.data=2", "mesh.tensor=4"])):
        assert cli.main(["rules", "digits_resnet_lars", "model.width=16", f"rules.preset={preset}", *mesh]) == 0
        tables[preset] = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:-1]}
    fsdp, tp = tables["fsdp"], tables["tp"]
    assert fsdp["stem/conv/kernel"] == ["3x3x1x16", "(kernel_h,", "kernel_w,", "conv_in,", "conv_out)",
                                        "(-,", "-,", "-,", "fsdp)", "72"]
    assert fsdp["stem/norm/scale"][-2:] == ["(fsdp)", "8"]
    assert tp["blocks/7/convs/1/conv/kernel"][0] == "3x3x128x128" and tp["blocks/7/convs/1/conv/kernel"][-2] == "tensor)"
    assert tp["head/kernel"][-3:] == ["(-,", "-)", f"{128 * 10 * 4:,}"]


@pytest.mark.parametrize("argv, message", [
    (["scale", "digits_resnet_lars", "--hosts", "2"],
     "jaxdist scale models a transformer's traffic (layers, heads, tokens per sequence); model.name=resnet is not "
     "one: use a gpt config"),
])
def test_commands_that_need_a_transformer_or_fixed_sizes_say_so(capsys, compiles, argv, message):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"jaxdist: error: {message}"
    assert compiles.count == 0
