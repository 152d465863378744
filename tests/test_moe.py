"""Mixture of experts (models/layers/moe.py): the routers and losses against the papers' formulas in
numpy, the grouped and exchanged experts against every expert run on every token, the same training
under every layout, capacity's dropped share, and the sigmoid router's bias balancing the load."""

import functools
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxdist import cli, loop
from jaxdist.kernels import grouped_matmul
from jaxdist.models.gpt.config import ImplConfig
from jaxdist.models.layers import moe as moe_lib
from jaxdist.parallel import rules as rules_lib

pytestmark = pytest.mark.slow


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top_k(scores, k):
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return order


@pytest.mark.parametrize("router, renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_the_router_is_the_papers(router, renormalize):
    """Mixtral / Qwen3-MoE: softmax over the experts, the top k, renormalized over them (Mixtral) or
    not (Qwen3-MoE's norm_topk_prob false); DeepSeek-V3: sigmoid scores, the top k of scores plus a
    bias chosen, their scores (renormalized) times the routed scale the weights."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    bias = rng.normal(size=(8,)).astype(np.float32)
    cfg = moe_lib.MoEConfig(experts=8, experts_per_token=3, router=router, renormalize=renormalize,
                            routed_scale=2.5 if router == "sigmoid" else 1.0)
    got = moe_lib.route(jnp.asarray(logits), cfg, jnp.asarray(bias) if router == "sigmoid" else None)
    if router == "softmax":
        probs = _softmax(logits)
        experts = _top_k(probs, 3)
    else:
        probs = 1 / (1 + np.exp(-logits))
        experts = _top_k(probs + bias, 3)
    weights = np.take_along_axis(probs, experts, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * cfg.routed_scale
    np.testing.assert_array_equal(got.experts, experts)
    np.testing.assert_allclose(got.weights, weights, rtol=1e-6)
    np.testing.assert_allclose(got.probs, probs, rtol=1e-6)


def test_group_limited_routing_chooses_within_the_best_groups():
    """DeepSeek-V3's: 16 experts in 4 groups, each group scored by its two best experts' biased
    scores, each token's top 3 taken from its best 2 groups only; the weights stay the sigmoids."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = rng.normal(size=(16,)).astype(np.float32) * 0.5
    cfg = moe_lib.MoEConfig(experts=16, experts_per_token=3, router="sigmoid", groups=4, top_groups=2)
    got = moe_lib.route(jnp.asarray(logits), cfg, jnp.asarray(bias))
    probs = 1 / (1 + np.exp(-logits))
    choice = (probs + bias).reshape(64, 4, 4)
    group_scores = np.sort(choice, -1)[..., -2:].sum(-1)
    best = np.argsort(-group_scores, -1, kind="stable")[:, :2]
    allowed = np.zeros((64, 4), bool)
    np.put_along_axis(allowed, best, True, -1)
    experts = _top_k(np.where(allowed[..., None], choice, -np.inf).reshape(64, 16), 3)
    np.testing.assert_array_equal(got.experts, experts)
    weights = np.take_along_axis(probs, experts, -1)
    np.testing.assert_allclose(got.weights, weights / weights.sum(-1, keepdims=True), rtol=1e-6)
    # The groups bite: unlimited, some token would take an expert outside its best groups.
    assert (np.asarray(moe_lib.route(jnp.asarray(logits), cfg.model_copy(update={"groups": 1}), jnp.asarray(bias))
                       .experts) != experts).any()
    with pytest.raises(ValueError, match="model.moe.groups=3 groups the sigmoid router's experts"):
        moe_lib.MoEConfig(experts=16, router="sigmoid", groups=3)


def test_the_auxiliary_and_z_losses_are_switch_and_st_moe():
    """Switch Transformers' load balancing, E x sum_e f_e P_e (f_e: the tokens sent to e per token,
    over the k choices, as Mixtral's load_balancing_loss_func), and ST-MoE's z-loss, the mean of
    logsumexp(logits)^2; tokens that do not count (padding) left out of both."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(40, 4)).astype(np.float32)
    counted = (rng.random(40) > 0.25).astype(np.float32)
    cfg = moe_lib.MoEConfig(experts=4, experts_per_token=2)
    routing = moe_lib.route(jnp.asarray(logits), cfg)
    stats = moe_lib.statistics(routing, jnp.asarray(counted), jnp.ones((40, 2), bool), 4)
    probs = _softmax(logits)[counted > 0]
    chosen = _top_k(_softmax(logits), 2)[counted > 0]
    f = np.stack([(chosen == e).any(-1).sum() for e in range(4)]) / len(chosen)
    np.testing.assert_allclose(moe_lib.aux_loss(stats), 4 * np.sum(f * probs.mean(0)), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))[counted > 0]
    np.testing.assert_allclose(moe_lib.z_loss(stats), np.mean(lse**2), rtol=1e-5)
    balanced = moe_lib.Stats(jnp.float32(8), jnp.full((4,), 4.0), jnp.full((4,), 2.0), jnp.float32(0), jnp.float32(0))
    assert float(moe_lib.aux_loss(balanced)) == pytest.approx(2.0)  # k, for a router that balances perfectly


def _layer(**keys):
    cfg = types.SimpleNamespace(moe=moe_lib.MoEConfig(experts=8, experts_per_token=2, **keys), mlp_dim=24, d_model=16,
                                layers=2, activation="swiglu")
    with nnx.use_eager_sharding(False):
        return moe_lib.MoE(cfg, ImplConfig(), jnp.float32, nnx.Rngs(0))


def _every_expert(layer, x):
    """Each token's output with every expert run on it, the chosen ones weighed and summed."""
    routing = moe_lib.route(jnp.einsum("bld,de->ble", x, layer.router[...]), layer.cfg)
    up, gate = (jnp.einsum("bld,edh->bleh", x, w[...]) for w in (layer.up, layer.gate))
    outputs = jnp.einsum("bleh,ehd->bled", jax.nn.silu(gate) * up, layer.down[...])
    return (jnp.take_along_axis(outputs, routing.experts[..., None], 2) * routing.weights[..., None]).sum(2)


def _mesh(**sizes):
    devices = np.array(jax.devices()).reshape(list(sizes.values()))
    return Mesh(devices, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


@pytest.mark.parametrize("sizes, batch, hidden, embed", [
    ({"expert": 8}, ["expert"], None, None),
    ({"data": 2, "expert": 4}, ["data", "expert"], None, None),
    ({"fsdp": 2, "expert": 2, "tensor": 2}, ["fsdp", "expert"], "tensor", "fsdp"),
    ({"data": 2, "expert": 4}, ["data"], None, None),
], ids=["expert8", "data2_expert4", "fsdp2_expert2_tensor2", "tokens_whole_on_each_expert_device"])
def test_the_grouped_and_exchanged_experts_are_every_expert_on_every_token(devices, sizes, batch, hidden, embed):
    """Each device runs its experts as one grouped matmul on the assignments sent to it (an
    all-to-all there and back where the tokens are split too): values and gradients as the dense
    computation of every expert on every token."""
    layer = _layer()
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    want = _every_expert(layer, x)
    want_grads = jax.grad(lambda s: jnp.sum(_every_expert(nnx.merge(graphdef, s), x) ** 2))(state)
    mesh = _mesh(**sizes)
    rules = rules_lib.preset("fsdp_tp").override(params={"experts": "expert", "expert_mlp": hidden, "embed": embed},
                                                 activations={"batch": batch})

    def loss(state):
        with rules_lib.activation_rules(mesh, rules):
            out, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(out**2), out

    with jax.set_mesh(mesh):
        (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7 * float(jnp.abs(want).max()))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * float(jnp.abs(w).max()))


def test_the_grouped_matmuls_backward_is_ragged_dots():
    """The kernels' custom VJP (XLA's three grouped products in their place): the value and both
    gradients are `jax.lax.ragged_dot`'s, with an empty group and rows after the groups (0 out,
    0 gradient), in float32 to 1e-5."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(23, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    groups = jnp.asarray([5, 0, 9, 4], jnp.int32)  # 18 of 23 rows
    probe = jnp.asarray(rng.normal(size=(23, 6)), jnp.float32)

    def loss(f, x, w):
        return jnp.sum(f(x, w) * probe)

    def reference(x, w):
        return jax.lax.ragged_dot(x, w, groups)

    def custom(x, w):
        return grouped_matmul.grouped_with(grouped_matmul.XLA, x, w, groups)

    np.testing.assert_allclose(custom(x, w), reference(x, w), atol=1e-5)
    assert float(jnp.abs(custom(x, w)[18:]).max()) == 0.0
    (dx, dw), (dx_ref, dw_ref) = (jax.grad(functools.partial(loss, f), (0, 1))(x, w) for f in (custom, reference))
    np.testing.assert_allclose(dx, dx_ref, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, atol=1e-5)
    assert float(jnp.abs(dx[18:]).max()) == 0.0 and float(jnp.abs(dw[1]).max()) == 0.0
    # dw of group 2 is its 9 rows' outer product with the probe, by hand
    np.testing.assert_allclose(dw[2], x[5:14].T @ probe[5:14], atol=1e-5)
    assert grouped_matmul.unsupported(2048, 5632, jnp.bfloat16) == "jax's grouped-matmul kernels run on a GPU only"
    with pytest.raises(ValueError, match="model.impl.grouped_matmul_impl=pallas: jax's grouped-matmul kernels run"):
        grouped_matmul.grouped(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), groups, "pallas")


def test_capacity_drops_each_experts_assignments_past_its_share_in_token_order():
    layer = _layer(capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(2), (4, 8, 16))
    _, stats = layer(x)
    routing = moe_lib.route(jnp.einsum("bld,de->ble", x, layer.router[...]), layer.cfg)
    chosen = np.asarray(routing.experts).reshape(-1)  # (row, position, choice) order
    limit = moe_lib.capacity(layer.cfg, 32)
    assert limit == 4  # 0.5 x 32 tokens x 2 choices / 8 experts
    taken, dropped = np.zeros(8, int), 0
    for expert in chosen:
        if taken[expert] < limit:
            taken[expert] += 1
        else:
            dropped += 1
    assert dropped > 0 and float(stats.dropped) == dropped
    np.testing.assert_array_equal(stats.load, np.bincount(chosen, minlength=8))  # the router's choices
    dropless, _ = _layer()(x)
    roomy, roomy_stats = _layer(capacity_factor=8.0)(x)  # room for every token at every expert
    assert float(roomy_stats.dropped) == 0
    np.testing.assert_array_equal(roomy, dropless)


MOE_MODEL = {"d_model": 32, "layers": 2, "heads": 4, "seq_len": 16, "vocab": "auto", "activation": "swiglu",
             "impl": {"scan_layers": True},
             "moe": {"experts": 8, "experts_per_token": 2, "expert_hidden": 24, "aux_loss": 0.01, "z_loss": 0.001}}
STEPS = 5


def _moe_config(run_dir, data, **sections):
    train = {"steps": STEPS, "global_batch": 16, **sections.pop("train", {})}
    return make_config(run_dir, model=MOE_MODEL, train=train, precision={"compute": "float32"}, data=data, **sections)


def _logged(run_dir) -> dict[str, list[float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: [line[key] for line in lines] for key in ("loss", "grad_norm", "moe_aux_loss", "moe_load_max")}


@pytest.fixture(scope="module")
def one_device_moe(tmp_path_factory, packed_corpus):
    run_dir = tmp_path_factory.mktemp("one_device_moe")
    loop.train(_moe_config(run_dir, packed_corpus, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}),
               devices=jax.devices()[:1])
    run = _logged(run_dir)
    assert run["loss"][-1] < run["loss"][0] and run["moe_aux_loss"][0] > 1.5  # about k = 2 at the start
    return run


MOE_LAYOUTS = {
    "expert8": ({"expert": 8, "fsdp": 1, "tensor": 1}, "fsdp", {}),
    "expert2_fsdp2_tensor2": ({"expert": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", {}),
    "expert4_data2": ({"expert": 4, "data": 2, "fsdp": 1, "tensor": 1}, "fsdp", {}),
    "stage2_expert4": ({"stage": 2, "expert": 4, "fsdp": 1, "tensor": 1}, "fsdp", {"pipeline": {"microbatches": 2}}),
    # Context parallelism: each sequence in chunks over fsdp, each device routing its chunk's tokens.
    "data2_context4": ({"data": 2, "fsdp": 4, "tensor": 1}, "fsdp",
                       {"rules": {"activations": {"batch": "data", "seq": "fsdp", "length": "fsdp"}}}),
    "expert2_context4": ({"expert": 2, "fsdp": 4, "tensor": 1}, "fsdp",
                         {"rules": {"activations": {"batch": ["data", "expert"], "seq": "fsdp", "length": "fsdp"}}}),
}


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_a_mixture_trains_the_same_under_every_layout(tmp_path, packed_corpus, one_device_moe, name):
    """Dropless, with the auxiliary and z losses on, on packed rows (padding routed to no expert):
    the losses, gradient norms, auxiliary loss and load of one device over 5 steps, within 1e-5. In
    the pipeline the statistics of its microbatches add up to the whole batch's."""
    mesh, preset, sections = MOE_LAYOUTS[name]
    rules = {"preset": preset, **sections.get("rules", {})}
    sections = {key: value for key, value in sections.items() if key != "rules"}
    loop.train(_moe_config(tmp_path, packed_corpus, mesh=mesh, rules=rules, **sections))
    got = _logged(tmp_path)
    for key, values in one_device_moe.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=0, err_msg=key)


def test_experts_across_two_processes_train_as_one_device(tmp_path, packed_corpus, one_device_moe):
    from test_layouts_multiprocess import run_processes

    run_processes([_moe_config(tmp_path / "run", packed_corpus, mesh={"expert": 8, "fsdp": 1, "tensor": 1},
                               rules={"preset": "fsdp"})], 2, tmp_path)
    got = _logged(tmp_path / "run")
    for key, values in one_device_moe.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=0, err_msg=key)


def test_the_sigmoid_routers_bias_balances_a_deliberately_unbalanced_router():
    """DeepSeek-V3's balancing without an auxiliary loss: each forward pass moves each expert's bias
    by bias_rate towards a balanced load; a router whose bias sends every token to expert 0 comes
    within 2x of the mean load on every expert in 40 passes, with its weights unchanged."""
    from jaxdist.models import gpt

    cfg = gpt.GPTConfig(vocab=64, d_model=32, layers=1, heads=4, seq_len=16, activation="swiglu",
                        moe={"experts": 4, "experts_per_token": 1, "router": "sigmoid", "bias_rate": 0.02})
    with nnx.use_eager_sharding(False):
        model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    router = model.blocks.moe.router[...]
    model.blocks.moe.bias[...] = jnp.array([[1.0, 0.0, 0.0, 0.0]])  # sigmoids are in (0, 1): expert 0 always wins
    tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, 64)

    def load_max():
        load = model.features(tokens).moe.load[0]
        return float(load.max() / load.mean())

    assert load_max() == 4.0  # all of the 4 experts' load on one
    for _ in range(40):
        model.features(tokens)
    assert load_max() < 2.0
    np.testing.assert_array_equal(model.blocks.moe.router[...], router)
    model.eval()  # evaluation moves no bias
    bias = model.blocks.moe.bias[...]
    model.features(tokens)
    np.testing.assert_array_equal(model.blocks.moe.bias[...], bias)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.expert=2", "mesh.fsdp=4", "mesh.tensor=1"],
     "mesh.expert=2 splits a mixture's experts, and model.moe.experts=0; set mesh.expert=1, or give the model experts"),
    (["model.moe.experts=6", "mesh.expert=4", "mesh.fsdp=2", "mesh.tensor=1"],
     "model.moe.experts=6 is not divisible by mesh.expert=4, over which rules.preset=fsdp_tp splits experts"),
    (["model.moe.experts=4", "model.moe.experts_per_token=5"],
     "model.moe.experts_per_token=5 is more than model.moe.experts=4"),
    (["model.moe.experts=4", "model.moe.first_dense=1"],
     "layers with and without experts are not one stack to scan; set model.impl.scan_layers=false"),
    (["model.moe.experts=4", "model.moe.bias_rate=0.01"],
     "model.moe.bias_rate balances the sigmoid router's bias: set model.moe.router=sigmoid"),
    (["model.moe.experts=4", "model.moe.capacity_factor=1.5", "mesh.stage=2", "mesh.fsdp=4", "mesh.tensor=1",
      "model.impl.scan_layers=true", "pipeline.microbatches=2"],
     "model.moe.capacity_factor=1.5 takes each expert's first assignments in token order, which mesh.stage > 1 "
     "runs microbatches would change"),
    (["model.moe.experts=4", "model.moe.first_dense=4"],
     "model.moe.first_dense=4 and model.moe.every=1 leave none of the model.layers=4 layers with experts"),
    (["model.moe.experts=4", "mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "train.microbatches=2"],
     "model.moe.experts=4: train.microbatches > 1 with train.grad_reduction=per_step computes each of the 8 batch "
     "shards' gradients apart, in a vmap, and the experts' grouped matmuls (jax.lax.ragged_dot) cannot be vmapped; "
     "set train.grad_reduction=per_microbatch (reduced each microbatch; the same math)"),
], ids=["no_experts", "not_divisible", "k_above_experts", "mixed_scanned", "bias_softmax", "capacity_pipeline",
        "no_moe_layer", "vmapped_shards"])
def test_a_bad_mixture_is_one_line_before_compiling(tmp_path, capsys, compiles, overrides, message):
    code = cli.main(["train", "tiny", f"run_dir={tmp_path / 'run'}", "model.impl.scan_layers=true", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert compiles.count == 0


def test_microbatches_of_a_mixture_are_the_one_device_ones(tmp_path, packed_corpus):
    """Each microbatch is a call of its own (its own statistics, losses and bias moves): data=2 x
    expert=4 trains as one device does with the same 2 microbatches, reduced each microbatch."""
    runs = {}
    for name, mesh, devices in (("one", {"data": 1, "fsdp": 1, "tensor": 1}, 1),
                                ("split", {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}, 8)):
        cfg = _moe_config(tmp_path / name, packed_corpus, mesh=mesh, rules={"preset": "fsdp"},
                          train={"steps": 3, "microbatches": 2, "grad_reduction": "per_microbatch"})
        loop.train(cfg, devices=jax.devices()[:devices])
        runs[name] = _logged(tmp_path / name)
    for key, values in runs["one"].items():
        np.testing.assert_allclose(runs["split"][key], values, rtol=1e-5, atol=0, err_msg=key)


def test_plan_scale_and_plot_show_the_experts(tmp_path, capsys):
    """`plan` gives the experts' weights per device (E / mesh.expert of every MoE layer's) and the
    all-to-alls of the compiled step; `scale` their weights and all-to-all bytes per expert split;
    `plot` the load and the balancing loss."""
    overrides = ["model.d_model=32", "model.layers=2", "model.seq_len=16", "train.global_batch=8"]
    assert cli.main(["plan", "tiny_moe", *overrides]) == 0
    out = capsys.readouterr().out
    # 2 layers x 8 experts x (gate, up, down) x d 32 x hidden 256 x float32, over expert=4 x fsdp=2 (embed)
    assert 2 * 8 * 3 * 32 * 256 * 4 / 8 == 196_608
    assert "of the parameters, the experts' weights: 196.6 kB per device" in out, out
    assert re.search(r"collectives per step and device .*all-to-all [\d.]+ [kMG]B", out), out
    assert cli.main(["scale", "moe_5b", "--hosts", "1", "--gpus-per-host", "8"]) == 0
    out = capsys.readouterr().out
    # 16 layers x 8 experts x (gate, up, down) x d 2048 x hidden 5632 x float32
    assert round(16 * 8 * 3 * 2048 * 5632 * 4 / 1e9, 2) == 17.72
    assert "mixture of experts: 16 MoE layers of 8 experts, 2 per token; expert weights 17.72 GB in all" in out, out
    assert "mesh.expert=1: expert weights 17.72 GB per GPU; all-to-all 0.00 GB" in out, out
    assert "mesh.expert=8: expert weights 2.21 GB per GPU; all-to-all" in out, out
    from jaxdist.commands import plot

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "moe_load_max": 2.5 - s / 10,
                                                           "moe_load_min": 0.2, "moe_aux_loss": 2.1}) + "\n"
                                               for s in range(1, 4)))
    assert [title for title, _ in plot.panels({str(run): plot.read_metrics(run)})] == ["loss", "experts"]
