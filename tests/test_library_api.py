"""The README's library example runs as written and trains a user's own model on the mesh."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    text = README.read_text()
    match = re.search(r"<!-- library-example:[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "README lost its library example"
    return match.group(1)


def test_readme_example_is_short():
    assert len(library_example().strip().splitlines()) < 30


def test_readme_example_trains_with_rule_shardings(capsys):
    namespace: dict = {}
    exec(compile(library_example(), str(README), "exec"), namespace)
    trainer, metrics = namespace["trainer"], namespace["metrics"]
    assert float(metrics["loss"]) < 0.15  # a separable problem: the loss must have fallen from ~0.7
    w1, w2 = trainer.params["w1"], trainer.params["w2"]
    assert tuple(w1.sharding.spec) == ("fsdp", "tensor")
    assert w1.addressable_shards[0].data.shape == (4, 32)
    assert w2.addressable_shards[0].data.shape == (32, 2)
    assert "w1 sharded as" in capsys.readouterr().out
