"""The README's library example runs as written, as a user's own script, and trains a user's own
model with shardings from jaxdist's rules."""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jaxdist
from jaxdist.parallel import rules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LIBRARY = ROOT / "docs" / "library.md"

# Appended to the example: what the test checks, printed as one JSON line.
REPORT = """
import json
print(json.dumps({
    "loss": float(metrics["loss"]),
    "w1_spec": list(trainer.params["w1"].sharding.spec),
    "w1_shard": list(trainer.params["w1"].addressable_shards[0].data.shape),
    "w2_shard": list(trainer.params["w2"].addressable_shards[0].data.shape),
}))
"""


def library_example() -> str:
    text = README.read_text()
    match = re.search(r"<!-- library-example:[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "README lost its library example"
    return match.group(1)


def test_readme_example_is_short():
    assert len(library_example().strip().splitlines()) < 30


def test_readme_example_trains_with_rule_shardings(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(library_example() + REPORT)
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    printed, report = run.stdout.strip().splitlines()[-2:]
    assert printed.startswith("loss ") and "w1 sharded as P('fsdp', 'tensor')" in printed
    result = json.loads(report)
    assert result["loss"] < 0.15  # a separable problem: the loss must have fallen from ~0.7
    assert result["w1_spec"] == ["fsdp", "tensor"]
    assert result["w1_shard"] == [4, 32]
    assert result["w2_shard"] == [32, 2]



def sharding_example() -> str:
    """The README's sharding block, after the library example's imports, MLP and rules."""
    library = library_example()
    setup = library[: library.index("def loss_fn")] + library[library.index("my_rules = "):library.index("trainer = ")]
    match = re.search(r"<!-- sharding-example:[^>]*-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README lost its sharding example"
    return setup + match.group(1)


SHARDING_REPORT = """
import json
print(json.dumps({
    "specs": {"/".join(map(str, path)): list(leaf.spec) for path, leaf in nnx.to_flat_state(placement.shardings)},
    "w1_shard": list(model.w1[...].addressable_shards[0].data.shape),
    "w2_shard": list(model.w2[...].addressable_shards[0].data.shape),
    "logits": [list(logits.shape), list(logits.sharding.spec)],
}))
"""


def test_readme_sharding_example_places_a_users_model(tmp_path):
    match = re.search(r"<!-- sharding-example:[^>]*-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert len(match.group(1).strip().splitlines()) <= 8
    script = tmp_path / "sharding.py"
    script.write_text(sharding_example() + SHARDING_REPORT)
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].split() == ["parameter", "shape", "logical", "mesh", "spec", "bytes/device"]
    assert lines[1].split() == ["w1", "16x64", "(features,", "hidden)", "(fsdp,", "tensor)", "512"]
    assert lines[2].split() == ["w2", "64x2", "(hidden,", "classes)", "(tensor,", "-)", "256"]
    result = json.loads(lines[-1])
    assert result["specs"] == {"w1": ["fsdp", "tensor"], "w2": ["tensor", None]}
    assert result["w1_shard"] == [4, 32] and result["w2_shard"] == [32, 2]
    assert result["logits"] == [[64, 2], ["fsdp"]]  # the batch over data x fsdp (data=1)


def batch_example() -> str:
    """docs/library.md's batch block, after the README's sharding example."""
    match = re.search(r"<!-- batch-example:[^>]*-->\s*```python\n(.*?)```", LIBRARY.read_text(), re.S)
    assert match, "docs/library.md lost its batch example"
    return sharding_example() + match.group(1)


BATCH_REPORT = """
import json
with nnx.use_eager_sharding(False):
    alone = MLP(nnx.Rngs(3))  # unsharded, on one device
created = placement.create(seed=3)
print(json.dumps({
    "batch": [list(batch["x"].shape), list(batch["x"].sharding.spec)],
    "rows": list(rows),
    "logits": [list(logits.shape), list(logits.sharding.spec)],
    "logits_right": bool(np.allclose(logits, np.maximum(all_x @ model.w1[...], 0) @ model.w2[...], atol=1e-5)),
    "seed_gives_the_unsharded_values": all(np.array_equal(getattr(created, name)[...], getattr(alone, name)[...])
                                           for name in ("w1", "w2")),
}))
"""


def test_library_doc_batch_example_shards_the_input_batch(tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(batch_example() + BATCH_REPORT)
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "warning" not in run.stderr  # every parameter of the MLP has logical names
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["batch"] == [[64, 16], [["data", "fsdp"]]]  # data=1 x fsdp=4: rows split 4 ways
    assert result["rows"] == list(range(64))  # one process feeds every row
    assert result["logits"] == [[64, 2], ["fsdp"]]
    assert result["logits_right"] and result["seed_gives_the_unsharded_values"]


def preset_tables() -> str:
    """The tables of docs/library.md, rendered from rules.PRESETS."""
    def table(kind: str, title: str) -> list[str]:
        names = list(dict.fromkeys(name for preset in rules.PRESETS.values() for name in getattr(preset, kind)))
        lines = [f"| {title} name | " + " | ".join(f"`{name}`" for name in rules.PRESETS) + " |",
                 "|" + " --- |" * (len(rules.PRESETS) + 1)]
        for name in names:
            cells = [" + ".join(getattr(preset, kind)[name]) or "replicated" for preset in rules.PRESETS.values()]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        return lines

    return "\n".join([*table("params", "parameter"), "", *table("activations", "activation")]) + "\n"


def test_library_doc_preset_tables_are_the_presets():
    """Every preset knows the same names (a name one lacked would fail placing there)."""
    assert all(preset.params.keys() == rules.PRESETS["dp"].params.keys()
               and preset.activations.keys() == rules.PRESETS["dp"].activations.keys() for preset in rules.PRESETS.values())
    text = LIBRARY.read_text()
    marker = "<!-- preset-tables: tests/test_library_api.py checks them against rules.PRESETS -->\n"
    assert marker in text
    assert text.split(marker, 1)[1] == preset_tables(), "regenerate the tables with tests/test_library_api.py:preset_tables()"


def test_rules_round_trip_through_flax_pairs():
    import flax.linen as nn

    from jaxdist.parallel import rules

    my_rules = rules.preset("fsdp_tp").override(params={"experts": ["data", "stage"]}, activations={"seq": "tensor"})
    params, activations = my_rules.to_flax("params"), my_rules.to_flax("activations")
    assert ("embed", "fsdp") in params and ("experts", ("data", "stage")) in params and ("layers", None) in params
    assert rules.Rules.from_flax(params, activations) == my_rules
    # flax reads the pairs as jaxdist does: the same mesh spec for the same logical names.
    for names in [("embed", "mlp"), ("layers", "heads", "head_dim", "embed"), ("vocab", "embed"), ("experts", "embed")]:
        assert nn.logical_to_mesh_axes(names, params) == my_rules.param_spec(names)
    # Where flax lists a name twice, the first pair wins, as in flax.
    assert rules.Rules.from_flax([("batch", "data"), ("batch", None)]).params["batch"] == ("data",)


def test_the_public_names_are_the_ones_editors_see():
    """jaxdist imports its public names on first use; the imports written out for editors and type
    checkers name the same objects, and `from jaxdist import *` and dir() give every one."""
    tree = ast.parse((ROOT / "jaxdist" / "__init__.py").read_text())
    static = {alias.asname or alias.name: (node.module, alias.name)
              for block in tree.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
              for node in block.body for alias in node.names}
    assert sorted(static) == sorted(jaxdist.__all__)
    for name, (module, attribute) in static.items():
        assert getattr(jaxdist, name) is getattr(importlib.import_module(module), attribute), name
    namespace = {}
    exec("from jaxdist import *", namespace)
    assert {name: namespace[name] for name in jaxdist.__all__} == {name: getattr(jaxdist, name) for name in static}
    assert set(jaxdist.__all__) <= set(dir(jaxdist))
