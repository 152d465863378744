"""The main job: `jaxdist train configs/tiny.yaml` on 8 simulated devices really learns, then samples.

The recipe as it is, for 40 of its 200 steps (its warm-up and cosine schedule over those 40): the
steps are the test's time, and 40 of them take the loss from 5.6 to about 2.6.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import logged_losses

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_trains_the_stdlib_gpt_and_prints_a_sample(tmp_path):
    # XLA's full optimisation, as a user's run has: the steps take twice as long without it.
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
    run = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", "train", str(ROOT / "configs/tiny.yaml"), f"run_dir={tmp_path}",
         "train.steps=40"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fsdp=4 x tensor=2 on 8 devices" in run.stdout
    losses = logged_losses(tmp_path)
    assert len(losses) == 3  # step 1, then every 20 of 40 steps
    assert 5.0 < losses[0] < 6.0, losses  # bytes start near uniform: ln 256 = 5.55
    assert losses[1] < 3.5 and losses[2] < 2.8, losses  # below the bytes' unigram entropy, 3.15
    sample = run.stdout.split("--- sample ---\n")[1].split("\n-----")[0]
    assert sample.startswith("def ") and len(sample) > 100
    assert (tmp_path / "config.yaml").is_file()
