"""Optimizers, masks, schedules and LR scaling against optax's references and textbook values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_config
from flax import nnx

from jaxdist import cli, models
from jaxdist.errors import UserError
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import roles as roles_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import optim as optim_lib
from jaxdist.train.optimizers import parts
from jaxdist.train.state import abstract_model, opt_state_shardings

LR, WEIGHT_DECAY = 0.01, 0.1


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """The tiny GPT's logical names, random parameters and gradients of its shapes (host arrays), and
    its parameters' roles.

    The two stacked layers get different scales, so one trust ratio for the whole stack would differ
    from one per layer.
    """
    cfg = make_config(tmp_path_factory.mktemp("gpt"))
    model = abstract_model(models.get("gpt").create(cfg), 0)
    abstract, names = model.params, model.names
    rng = np.random.default_rng(0)
    layer_scale = np.array([1.0, 3.0])

    def random_like(leaf, names):
        x = rng.normal(size=leaf.shape).astype(np.float32)
        if parts.is_stacked(names):
            x *= layer_scale.reshape((-1,) + (1,) * (x.ndim - 1))
        return x

    params = jax.tree.map(random_like, abstract, names, is_leaf=_is_names)
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(2)]
    return names, params, grads, model.roles


def _is_names(x):
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _paths(tree) -> dict[str, object]:
    return {rules_lib.path_str(path): leaf for path, leaf in jax.tree.leaves_with_path(tree)}


def _optim(name: str, **keys):
    return make_config("unused", optim={"name": name, "lr": LR, "weight_decay": WEIGHT_DECAY, "clip_norm": None, **keys})


def test_default_masks_spare_norms_biases_and_embeddings(gpt):
    roles = gpt[3]
    decayed = _paths(parts.weight_decay_mask(_optim("adamw").optim, roles))
    assert {path for path, on in decayed.items() if on} == {
        "blocks/attn/qkv", "blocks/attn/out", "blocks/mlp/up", "blocks/mlp/down", "head",
    }
    asked = _paths(parts.weight_decay_mask(_optim("adamw", decay_embeddings=True).optim, roles))
    assert asked["embed"] and asked["positions"] and not asked["final_norm/scale"]
    asked = _paths(parts.weight_decay_mask(_optim("adamw", decay_norms_and_biases=True).optim, roles))
    assert asked["blocks/norm1/bias"] and asked["final_norm/scale"] and not asked["embed"]

    trusted = _paths(parts.trust_ratio_mask(_optim("lamb").optim.trust_ratio_norms_and_biases, roles))
    assert {path for path, on in trusted.items() if not on} == {
        "blocks/norm1/scale", "blocks/norm1/bias", "blocks/norm2/scale", "blocks/norm2/bias",
        "final_norm/scale", "final_norm/bias",
    }
    assert all(_paths(parts.trust_ratio_mask(True, roles)).values())


def _run(tx, params, grads):
    """Parameters after applying `tx` to each gradient in turn."""
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _layers(tree, names):
    """Stacked leaves split into one leaf per layer: the model as optax sees an unstacked one."""
    return jax.tree.map(
        lambda x, n: list(x) if parts.is_stacked(n) else x, tree, names, is_leaf=_is_names
    )


def _restack(tree, names):
    return jax.tree.map(
        lambda x, n: np.stack(x) if parts.is_stacked(n) else x, tree, names,
        is_leaf=lambda x: isinstance(x, list) or _is_names(x),
    )


def _broadcast_mask(mask, names):
    return jax.tree.map(lambda m, n: [m] * 2 if parts.is_stacked(n) else m, mask, names, is_leaf=_is_names)


def _jit_run(tx, params, grads):
    return jax.jit(lambda p, gs: _run(tx, p, gs))(params, grads)


def _ours(cfg, names, roles, params, grads):
    tx, _ = optim_lib.build_optimizer(cfg.optim, cfg.train, names, roles)
    return _jit_run(tx, params, grads)


def test_lars_equals_optax_lars_per_layer_with_masks(gpt):
    names, params, grads, roles = gpt
    cfg = _optim("lars", momentum=0.9, nesterov=True, trust_coefficient=0.002)
    ours = _ours(cfg, names, roles, params, grads)

    reference = optax.lars(
        LR, weight_decay=WEIGHT_DECAY, trust_coefficient=0.002, momentum=0.9, nesterov=True,
        weight_decay_mask=_broadcast_mask(parts.weight_decay_mask(cfg.optim, roles), names),
        trust_ratio_mask=_broadcast_mask(parts.trust_ratio_mask(cfg.optim.trust_ratio_norms_and_biases, roles), names),
    )
    expected = _restack(_jit_run(reference, _layers(params, names), [_layers(g, names) for g in grads]), names)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), ours, expected)


def test_lamb_equals_optax_lamb_per_layer_with_masks(gpt):
    """optax.lamb has a decay mask but no trust-ratio mask: outside the trust mask LAMB is AdamW
    (the same chain without the trust ratio), so the reference labels each parameter (each layer of
    the unstacked model) lamb or adamw, with or without decay, through optax.multi_transform."""
    names, params, grads, roles = gpt
    cfg = _optim("lamb", b1=0.9, b2=0.99, eps=1e-6)
    ours = _ours(cfg, names, roles, params, grads)

    def label(decayed, trusted):
        return ("lamb" if trusted else "adamw") + ("_decay" if decayed else "")

    labels = jax.tree.map(
        label, parts.weight_decay_mask(cfg.optim, roles),
        parts.trust_ratio_mask(cfg.optim.trust_ratio_norms_and_biases, roles),
    )
    reference = optax.multi_transform(
        {
            f"{make.__name__}{suffix}": make(LR, b1=0.9, b2=0.99, eps=1e-6, weight_decay=wd)
            for make in (optax.lamb, optax.adamw)
            for suffix, wd in (("", 0.0), ("_decay", WEIGHT_DECAY))
        },
        _broadcast_mask(labels, names),
    )
    expected = _restack(_jit_run(reference, _layers(params, names), [_layers(g, names) for g in grads]), names)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), ours, expected)


def test_adafactor_weight_decay_is_scaled_by_the_learning_rate(gpt):
    """With zero gradients an update is the decoupled decay alone: -lr * weight_decay * p on the
    masked parameters, as adamw's and sgd's; nothing at all at lr 0 (warmup's first step)."""
    names, params, _, roles = gpt
    zeros = jax.tree.map(np.zeros_like, params)

    def first_update(name, **keys):
        cfg = _optim(name, **keys)
        tx, _ = optim_lib.build_optimizer(cfg.optim, cfg.train, names, roles)
        return jax.jit(lambda p: tx.update(zeros, tx.init(p), p)[0])(params)

    expected = jax.tree.map(
        lambda p, on: -LR * WEIGHT_DECAY * p if on else np.zeros_like(p),
        params, parts.weight_decay_mask(_optim("adamw").optim, roles),
    )
    for name in ("adafactor", "adamw", "sgd"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), first_update(name), expected)
    at_lr_0 = first_update("adafactor", warmup_steps=5)
    assert all(not np.any(u) for u in jax.tree.leaves(at_lr_0))


def test_adafactor_stacked_equals_per_layer(gpt):
    """Adafactor's statistics are per layer: the stacked model steps as the per-layer one. `wide`
    has two dimensions of at least optax's min_dim_size_to_factor (128), so its second moments
    are factored."""
    names, params, grads, roles = gpt
    rng = np.random.default_rng(1)
    wide = lambda scale: (rng.normal(size=(2, 128, 256)) * scale).astype(np.float32)  # noqa: E731
    names = {**names, "wide": ("layers", "embed", "mlp")}
    roles = {**roles, "wide": "weight"}
    params = {**params, "wide": wide(np.array([1.0, 10.0])[:, None, None])}
    grads = [{**g, "wide": wide(1.0)} for g in grads + grads[:1]]
    cfg = _optim("adafactor")
    ours = _ours(cfg, names, roles, params, grads)

    per_layer_names = jax.tree.map(lambda n: [n[1:]] * 2 if parts.is_stacked(n) else n, names, is_leaf=_is_names)
    per_layer_roles = jax.tree.map(lambda r, n: [r] * 2 if parts.is_stacked(n) else r, roles, names, is_leaf=_is_names)
    expected = _restack(
        _ours(cfg, per_layer_names, per_layer_roles, _layers(params, names), [_layers(g, names) for g in grads]),
        names)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), ours, expected)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb", "lars", "adafactor"])
def test_every_optimizer_descends_and_shards_its_state(gpt, name):
    names, params, _, roles = gpt
    cfg = make_config("unused", optim={"name": name, "lr": 0.05, "weight_decay": 1e-4, "clip_norm": None})
    tx, _ = optim_lib.build_optimizer(cfg.optim, cfg.train, names, roles)
    loss = lambda p: sum(jnp.sum((x - 0.5) ** 2) for x in jax.tree.leaves(p))  # noqa: E731

    def descend(p):
        updates, _ = tx.update(jax.grad(loss)(p), tx.init(p), p)
        return optax.apply_updates(p, updates)

    descended = jax.jit(descend)(params)
    assert float(loss(descended)) < float(loss(params))

    # Optimizer state follows the parameters' shardings where shaped like them (adafactor's
    # factored statistics are not, and are replicated).
    mesh = mesh_lib.make_mesh(data=2, fsdp=2, tensor=2)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    layouts = rules_lib.param_layouts(abstract, names, rules_lib.preset("fsdp_tp"), mesh)
    shardings = opt_state_shardings(tx, abstract, rules_lib.layout_shardings(layouts, mesh), mesh)
    opt_abstract = jax.eval_shape(tx.init, abstract)
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    leaves = jax.tree.leaves(opt_abstract, is_leaf=is_masked)
    placed = jax.tree.leaves(shardings, is_leaf=is_masked)
    assert len(leaves) == len(placed)
    sharded = 0
    for leaf, sharding in zip(leaves, placed):
        if is_masked(leaf):
            continue
        sharding.shard_shape(leaf.shape)  # raises if the sharding does not fit the leaf
        sharded += not sharding.is_fully_replicated
    assert sharded >= 5  # moments of the large matrices are split


def test_schedules_give_textbook_values():
    def schedule(**keys):
        cfg = make_config("unused", train={"steps": 110}, optim={"lr": 1.0, "warmup_steps": 10, **keys})
        return optim_lib.learning_rate_schedule(cfg.optim, cfg.train)

    cosine = schedule(schedule="cosine", min_lr_ratio=0.1)
    # Linear warmup from 0, then cosine to the floor: lr_t = floor + (peak - floor)(1 + cos(pi t / T)) / 2.
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 60: 0.55, 110: 0.1}
    for step, value in expected.items():
        assert float(cosine(step)) == pytest.approx(value, rel=1e-6, abs=1e-7), step

    linear = schedule(schedule="linear", min_lr_ratio=0.2)
    for step, value in {5: 0.5, 10: 1.0, 35: 0.8, 60: 0.6, 110: 0.2}.items():
        assert float(linear(step)) == pytest.approx(value, rel=1e-6), step

    constant = schedule(schedule="constant")
    for step, value in {2: 0.2, 10: 1.0, 100: 1.0}.items():
        assert float(constant(step)) == pytest.approx(value, rel=1e-6), step


def test_lr_scaling_rules_from_base_batch():
    # Goyal et al.: 0.1 per 256 examples; at 8192 linear scaling gives 3.2, square-root 0.1 x sqrt(32).
    def peak(rule, global_batch):
        cfg = make_config(
            "unused", train={"global_batch": global_batch},
            optim={"lr": 0.1, "lr_scaling": rule, "base_batch": 256, "schedule": "constant"},
        )
        return float(optim_lib.learning_rate_schedule(cfg.optim, cfg.train)(0))

    assert peak("linear", 8192) == pytest.approx(3.2, rel=1e-6)
    assert peak("sqrt", 8192) == pytest.approx(0.1 * math.sqrt(32), rel=1e-6)
    assert peak("linear", 64) == pytest.approx(0.025, rel=1e-6)
    assert peak("none", 8192) == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.name=adam", "optim.name='adam' is not a registered optimizer; use optim.name: one of adafactor, adamw, lamb, "
         "lars, sgd"),
        ("optim.lr=-0.1", "optim.lr=-0.1: input should be greater than 0"),
        ("optim.lr_scaling=linear", "optim.lr_scaling=linear needs optim.base_batch"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2: input should be less than or equal to 1"),
        ("train.microbatches=3", "train.microbatches=3 does not divide the per-device batch 2"),
        ("train.grad_reduction=sometimes", "train.grad_reduction='sometimes': input should be 'per_step' or"),
        ("precision.compute=float16", "precision.compute=float16: XLA on CPU cannot compile float16 attention"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_compiling(tmp_path, capsys, compiles, override, expected):
    config = tmp_path / "tiny.yaml"
    config.write_text(make_config(tmp_path / "run").to_yaml())  # 16 sequences over fsdp=8: 2 per device
    assert cli.main(["train", str(config), *override.split()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: ") and expected in err, err
    assert compiles.count == 0


# GPT-2's biases on every projection, and Qwen2's on q, k and v with grouped-query attention: biases
# of three axes (qkv, heads, head_dim) beside matrices of two to four.
BIASED_MODELS = {
    "gpt2": {"biases": "all", "tied_embeddings": True},
    "qwen2": {"name": "llama", "kv_heads": 2, "biases": "qkv"},
}


@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "lars"])
@pytest.mark.parametrize("model", BIASED_MODELS)
def test_with_zero_gradients_only_the_weights_move(model, optimizer):
    """Weight decay is the whole update of a zero gradient: every weight moves, no bias, norm or
    (by default) embedding does, whatever its rank."""
    cfg = make_config("unused", model={**BIASED_MODELS[model], "d_model": 32, "heads": 4, "layers": 2},
                      optim={"name": optimizer, "lr": LR, "weight_decay": WEIGHT_DECAY, "clip_norm": None})
    abstract = abstract_model(models.get(cfg.model.name).create(cfg), 0)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda leaf: rng.normal(size=leaf.shape).astype(np.float32), abstract.params)
    tx, _ = optim_lib.build_optimizer(cfg.optim, cfg.train, abstract.names, abstract.roles)
    zeros = jax.tree.map(np.zeros_like, params)
    updates = jax.jit(lambda p: tx.update(zeros, tx.init(p), p)[0])(params)
    roles = _paths(abstract.roles)
    names = {rules_lib.path_str(path): n for path, n in jax.tree.leaves_with_path(abstract.names, is_leaf=_is_names)}
    # (layers, qkv, heads, head_dim): not a vector, and still a bias
    assert any(role == "bias" and len(names[path]) == 4 for path, role in roles.items())
    moved = {path for path, update in _paths(updates).items() if np.any(update != 0)}
    assert moved == {path for path, role in roles.items() if role == "weight"}


def test_a_users_model_gets_roles_by_declaration_or_by_flax_names():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.proj = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)
            self.gain = nnx.Param(jnp.ones((3, 4)), role="norm")  # a matrix of per-channel scales

    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)
    assert _paths(roles_lib.roles(state)) == {
        "embed/embedding": "embedding", "gain": "norm", "norm/bias": "bias", "norm/scale": "norm",
        "proj/bias": "bias", "proj/kernel": "weight",
    }
    state["gain"].set_metadata("role", "gains")
    with pytest.raises(UserError, match=r"parameter gain declares role='gains'; a role is one of weight, bias"):
        roles_lib.roles(state)
