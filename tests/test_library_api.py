"""The README's library example runs as written, as a user's own script, and trains a user's own
model with shardings from jaxdist's rules."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

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

