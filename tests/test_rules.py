"""Logical-axis rules: presets, overrides, checks, and the `jaxdist rules` table."""

import re

import jax
import numpy as np
import optax
import pytest
import yaml
from conftest import SMALL_RESNET, TINY_GPT, make_classifier_config, make_config
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import UserError, cli, make_mesh, models
from jaxdist.parallel import layout, rules
from jaxdist.train.trainer import Trainer, param_layouts


def test_presets_split_what_they_say():
    assert rules.preset("dp").param_spec(("embed", "mlp")) == P(None, None)
    assert rules.preset("fsdp").param_spec(("embed", "mlp")) == P("fsdp", None)
    assert rules.preset("tp").param_spec(("embed", "mlp")) == P(None, "tensor")
    assert rules.preset("fsdp_tp").param_spec(("embed", "mlp")) == P("fsdp", "tensor")
    for name in rules.PRESETS:
        assert rules.preset(name).activation_spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)


def test_override_in_python_and_yaml(tmp_path):
    custom = rules.preset("fsdp").override(params={"mlp": "tensor", "codes": ["data"]},
                                           activations={"length": "tensor"})
    assert custom.param_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert custom.param_spec(("codes",)) == P("data")
    assert custom.activation_spec(("batch", "length")) == P(("data", "fsdp"), "tensor")
    assert rules.preset("fsdp").param_spec(("embed", "mlp")) == P("fsdp", None)  # presets are not mutated

    cfg = make_config(tmp_path, rules={"preset": "fsdp", "params": {"mlp": "tensor"}, "activations": {"mlp": "tensor"}})
    assert rules.from_config(cfg.rules).param_spec(("mlp",)) == P("tensor")


class Codebook(nnx.Module):
    """A model with a logical name no preset has."""

    def __init__(self, rngs):
        self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.lecun_normal(), ("codes", "embed"))(
            rngs.params(), (4, 16)))


def test_missing_rule_names_the_parameter_and_the_fix_in_the_terms_the_rules_were_written_in(tmp_path, devices):
    python = ("rules: parameter w uses logical axis 'codes', which has no rule; give it one with "
              ".override(params={'codes': None}) (replicated) or a mesh axis in place of None")
    with pytest.raises(UserError) as caught:
        rules.place(Codebook, rules.preset("fsdp"), make_mesh(fsdp=8))
    assert str(caught.value) == python  # not a config key: the rules came from Python
    with pytest.raises(UserError) as caught:
        rules.from_config(make_config(tmp_path).rules).param_spec(("codes", "embed"), "parameter w")
    assert str(caught.value) == (  # a config file cannot name it (test_a_rule_for_a_name_no_model_uses_is_refused)
        "rules: parameter w uses logical axis 'codes', which has no rule; no preset has one and config files remap "
        "only the presets' names: place this model from Python (jaxdist.Trainer, rules.place) and give it one with "
        ".override(params={'codes': None}) (replicated) or a mesh axis in place of None")
    placed = rules.place(Codebook, rules.preset("fsdp").override(params={"codes": None}), make_mesh(fsdp=8))
    assert placed.layouts["w"].spec == P(None, "fsdp")  # the fix works


def test_mesh_axis_used_twice_names_the_parameter():
    both = rules.preset("fsdp").override(params={"mlp": "fsdp"})
    with pytest.raises(UserError) as caught:
        both.param_spec(("embed", "mlp"), "parameter mlp/up")
    assert str(caught.value) == ("rules: parameter mlp/up maps both 'embed' and 'mlp' to mesh axis 'fsdp'; a mesh axis "
                                 "can split only one dimension: change the rule of 'mlp' or of 'embed' with "
                                 ".override(params={...})")


def test_indivisible_dimension_names_the_parameter(tmp_path, devices):
    """Where no config key decides the size (a model placed from Python, a size no key gives), the
    placement names the parameter."""
    cfg = make_config(tmp_path, model={"d_model": 60, "heads": 4})
    with pytest.raises(UserError, match=r"parameter blocks/attn/out dim 3 \(size 60\) is not divisible by fsdp=8"):
        rules.place(models.get("gpt").create(cfg), rules.preset("fsdp"), make_mesh(fsdp=8))
    cfg = make_config(tmp_path, mesh={"data": 1, "fsdp": 8}, rules={"params": {"qkv": "fsdp", "embed": None}})
    with pytest.raises(UserError, match=r"parameter blocks/attn/qkv dim 1 \(size 3\) is not divisible by fsdp=8"):
        param_layouts(cfg)


@pytest.mark.parametrize("model", [
    {"mlp_ratio": 3},
    {"heads": 2, "positions": "rope", "activation": "swiglu", "tied_embeddings": True},
    {"name": "mlp", "hidden": [32, 48]},
    {"name": "mlp", "hidden": []},
    SMALL_RESNET,
    {**SMALL_RESNET, "depth": 50, "width": 4},
], ids=["gpt", "gpt_rope_swiglu_tied", "mlp", "mlp_no_hidden", "resnet18", "resnet50"])
def test_the_sizes_checked_by_key_are_the_models(tmp_path, model):
    """`param_sizes`, which layout.check reports by key, against the model's own parameters: every size
    listed is one they have, every size of a listed name is a multiple of one listed, and every name
    a preset splits is listed."""
    if model.get("name") in ("mlp", "resnet"):
        cfg = make_classifier_config(tmp_path, {**model, "classes": 10, "image_shape": [8, 8, 1]})
    else:
        cfg = make_config(tmp_path, model={**TINY_GPT["model"], **model})
    with nnx.use_eager_sharding(False):
        built = nnx.eval_shape(lambda: models.get(cfg.model.name).create(cfg)(nnx.Rngs(0)))
    variables = jax.tree.leaves(nnx.state(built), is_leaf=lambda x: isinstance(x, nnx.Variable))
    actual = {(name, size) for v in variables for name, size in zip(rules.logical_names(v), v.shape) if name}
    listed: dict[str, set[int]] = {}
    for size in cfg.model.param_sizes():
        listed.setdefault(size.name, set()).add(size.size)
    assert {(name, size) for name, sizes in listed.items() for size in sizes} <= actual
    assert all(any(size % unit == 0 for unit in listed[name]) for name, size in actual if name in listed)
    split = {name for preset in rules.PRESETS.values() for name, axes in preset.params.items() if axes}
    assert {name for name, _ in actual} & split <= set(listed)


def test_rule_naming_a_missing_mesh_axis(tmp_path, devices):
    cfg = make_config(tmp_path, rules={"preset": "dp", "params": {"mlp": "pod"}})
    with pytest.raises(UserError, match=r"rules.params.mlp names mesh axis 'pod'"):
        param_layouts(cfg)
    with pytest.raises(UserError, match=r"rules: the params rule of 'embed' names mesh axis 'pod'; the mesh axes"):
        rules.place(Codebook, rules.preset("dp").override(params={"codes": None, "embed": "pod"}), make_mesh(fsdp=8))


_PARAM_NAMES = ("layers, vocab, embed, mlp, heads, kv_heads, head_dim, length, qkv, experts, expert_mlp, latent, "
                "classes, kernel_h, kernel_w, conv_in, conv_out")
_ACTIVATION_NAMES = "batch, seq, length, embed, mlp, heads, kv_heads, head_dim, vocab, stage, classes, height, width, channels"


@pytest.mark.parametrize("table, message", [
    ({"params": {"embd": "tensor"}},
     f"rules: rules.params.embd=tensor: 'embd' is not a logical name of a parameter; the names are {_PARAM_NAMES}"),
    ({"params": {"": ["data", "fsdp"]}},
     f"rules: rules.params.=[data, fsdp]: '' is not a logical name of a parameter; the names are {_PARAM_NAMES}"),
    ({"params": {"seq": None}},
     f"rules: rules.params.seq=null: 'seq' is not a logical name of a parameter; the names are {_PARAM_NAMES}"),
    ({"activations": {"sequence": "tensor"}},
     f"rules: rules.activations.sequence=tensor: 'sequence' is not a logical name of an activation; the names "
     f"are {_ACTIVATION_NAMES}"),
])
def test_a_rule_for_a_name_no_model_uses_is_refused(tmp_path, table, message):
    cfg = make_config(tmp_path, rules={"preset": "fsdp_tp", **table})
    with pytest.raises(UserError) as error:
        rules.from_config(cfg.rules)
    assert str(error.value) == message


def test_every_logical_name_of_the_models_can_be_configured(tmp_path):
    """The names the config accepts are those of the presets: every name jaxdist's models use has a
    rule there (placing a model fails on a name without one)."""
    for name in rules.PRESETS:
        preset = rules.preset(name)
        cfg = make_config(tmp_path, rules={"preset": name, "params": {n: None for n in preset.params},
                                           "activations": {n: None for n in preset.activations}})
        assert rules.from_config(cfg.rules).params["embed"] == ()


def test_constrain_is_a_noop_outside_a_step():
    x = jax.numpy.ones((4, 4))
    assert rules.constrain(x, ("batch", "embed")) is x


def test_constrain_applies_activation_rules():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with rules.activation_rules(mesh, rules.preset("tp")):
        out = jax.jit(lambda x: rules.constrain(x * 2, ("batch", "mlp")))(jax.numpy.ones((8, 16)))
    assert out.sharding.spec == P(("data", "fsdp"), "tensor")


def _table_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines()[1:-1]:
        path, shape, *rest = line.split()
        spec = re.search(r"\) +(\([^)]*\))", line).group(1)
        rows[path] = (shape, spec)
    return rows


def _spec_text(spec: P, ndim: int) -> str:
    entries = list(spec) + [None] * (ndim - len(spec))
    parts = []
    for entry in entries:
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        parts.append("+".join(axes) if axes else "-")
    return "(" + ", ".join(parts) + ")"


def test_rules_command_matches_shardings_used(tmp_path, capsys):
    raw = {**TINY_GPT, "run_dir": str(tmp_path / "run"), "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
           "rules": {"preset": "fsdp_tp"}}
    path = tmp_path / "fsdp_tp.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["rules", str(path)]) == 0
    table = _table_rows(capsys.readouterr().out)

    trainer = Trainer.from_config(make_config(tmp_path, mesh=raw["mesh"], rules=raw["rules"]))
    used = {
        "/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree.leaves_with_path(trainer.params)
    }
    assert set(table) == set(used)
    for name, array in used.items():
        shape, spec = table[name]
        assert shape == "x".join(map(str, array.shape)), name
        assert spec == _spec_text(array.sharding.spec, array.ndim), (name, spec, array.sharding.spec)
    assert table["blocks/mlp/up"][1] == "(-, fsdp, tensor)"
    assert table["embed"][1] == "(tensor, fsdp)"


@pytest.mark.parametrize("model, impl", [
    ({}, {}), ({}, {"loss_chunk": 8}),
    ({"name": "mlp", "hidden": [16], "classes": 10, "image_shape": [8, 8, 1]}, {}),
    ({**SMALL_RESNET, "classes": 10, "image_shape": [8, 8, 1]}, {}),
], ids=["gpt", "gpt_loss_chunk", "mlp", "resnet"])
def test_every_activation_a_model_constrains_is_one_the_layout_check_checks(tmp_path, monkeypatch, model, impl):
    # The layout check checks the activation specs a model declares (models.ModelEntry.activations), since
    # the traced ones appear only as the step compiles.
    traced = set()
    spec = rules.Rules.activation_spec
    monkeypatch.setattr(rules.Rules, "activation_spec",
                        lambda self, names, where="an activation": traced.add(tuple(names)) or spec(self, names, where))
    cfg = make_classifier_config(tmp_path, model) if model else make_config(tmp_path, impl=impl)
    entry, placed = models.get(cfg.model.name), layout.from_config(cfg)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: entry.create(cfg)(nnx.Rngs(0))))
    batch = entry.random_batch(cfg, np.random.default_rng(0), cfg.train.global_batch)
    traced.clear()
    with rules.activation_rules(placed.mesh, placed.rules):
        jax.eval_shape(lambda state, batch: entry.loss(nnx.merge(graphdef, state), batch), state, batch)
    named = {tuple(name for name in names if name is not None) for names in traced}
    assert named and named <= {*entry.activations, ("batch",), ("stage", "batch")}, named - set(entry.activations)


class PartlyNamed(nnx.Module):
    """A model whose projection carries logical names and whose flax layers (a Linear, a LayerNorm)
    and scalar carry none."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(nnx.with_partitioning(init, ("embed", "mlp"))(rngs.params(), (16, 32)))
        self.head = nnx.Linear(32, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.temperature = nnx.Param(jax.numpy.ones(()))  # nothing to split

    def __call__(self, x):
        return self.norm(self.head(x @ self.w)) * self.temperature


UNNAMED_WARNING = ("jaxdist: warning: rules: 4 parameter(s) carry no logical names, so every device holds them whole: "
                   "head/bias, head/kernel, norm/bias, norm/scale; name their dimensions (nnx.with_partitioning) "
                   "for the rules to split them\n")


def test_parameters_without_logical_names_are_replicated_with_one_warning(devices, capsys):
    mesh = make_mesh(fsdp=4, tensor=2)
    placement = rules.place(PartlyNamed, rules.preset("fsdp_tp"), mesh)
    assert capsys.readouterr().err == UNNAMED_WARNING  # the first placement in this process
    specs = {"/".join(map(str, path)): sharding.spec for path, sharding in nnx.to_flat_state(placement.shardings)}
    assert specs == {"w": P("fsdp", "tensor"), "head/kernel": P(None, None), "head/bias": P(None),
                     "norm/scale": P(None), "norm/bias": P(None), "temperature": P()}

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).mean()

    for _ in range(2):
        Trainer(PartlyNamed, loss_fn, optax.sgd(0.1), mesh, rules.preset("fsdp_tp"))
    assert capsys.readouterr().err == ""  # said once a process: not again for each Trainer that places it

    rules.place(models.get("gpt").create(make_config("unused")), rules.preset("fsdp_tp"), mesh)
    assert capsys.readouterr().err == ""  # jaxdist's models name every parameter
