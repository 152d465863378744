"""Classifiers train: the digits recipes reach their accuracy, a BatchNorm ResNet trains the same on
every layout, and it resumes bitwise (running averages included) and onto another layout."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_RESNET, logged_keys, make_classifier_config, undocumented_metrics

from jaxdist import config, loop
from jaxdist.checkpoint import export_params

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
LAYOUTS = {
    "data8": {"mesh": {"data": 8, "fsdp": 1}, "rules": {"preset": "dp"}},
    "fsdp4_data2": {"mesh": {"data": 2, "fsdp": 4}, "rules": {"preset": "fsdp"}},
    # Convolutions split by output channels over tensor, their activations' channels too.
    "tensor4_data2": {"mesh": {"data": 2, "fsdp": 1, "tensor": 4}, "rules": {"preset": "tp"}},
}


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _resnet(run_dir, layout: str | None, steps: int = STEPS, **sections):
    """The small ResNet on the digits, 32 images a step, on `layout` (None: one device)."""
    placed = LAYOUTS[layout] if layout else {"mesh": {"data": 1, "fsdp": 1}, "rules": {"preset": "dp"}}
    return make_classifier_config(run_dir, SMALL_RESNET, **placed, train={"steps": steps, "global_batch": 32},
                                  **sections)


def _train(cfg, devices=None) -> tuple[float, list[dict], dict]:
    """(seconds, the run's metrics, its final model state on the host)."""
    start = time.perf_counter()
    trainer = loop.train(cfg, devices)
    return time.perf_counter() - start, metrics(Path(cfg.run_dir)), jax.device_get(trainer.state.model_state)


@pytest.mark.parametrize("recipe, devices", [("digits_mlp", 8), ("digits_resnet_lars", 1)])
def test_digits_recipe_reaches_97_percent(tmp_path, recipe, devices):
    """The recipes as shipped, run as a user runs them: `jaxdist train`, with XLA's full
    optimisation (the ResNet on one device: faster than 8 simulated ones on 2 cores)."""
    env = {**os.environ, "JAXDIST_CPU_DEVICES": str(devices), "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "jaxdist.cli", "train", recipe, f"run_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stderr[-2000:]
    final, steps = metrics(tmp_path)[-1], config.load(recipe).train.steps
    assert final["step"] == steps
    assert final["eval_accuracy"] >= 0.97, final
    assert undocumented_metrics(logged_keys(tmp_path)) == set()
    assert seconds < 120, seconds
    print(f"{recipe}: eval accuracy {final['eval_accuracy']:.4f} after {steps} steps in {seconds:.1f} s")


@pytest.fixture(scope="module")
def run_of(tmp_path_factory):
    """`run_of(layout)`: the small ResNet trained STEPS steps on that layout ("one_device": one
    device), once per module: (metrics, final model state)."""
    done = {}

    def run(layout: str) -> tuple[list[dict], dict]:
        if layout not in done:
            run_dir = tmp_path_factory.mktemp(layout)
            if layout == "one_device":
                done[layout] = _train(_resnet(run_dir, None), jax.devices()[:1])[1:]
                losses = [m["loss"] for m in done[layout][0]]
                assert len(losses) == STEPS and losses[-1] < losses[0]
            else:
                done[layout] = _train(_resnet(run_dir, layout))[1:]
        return done[layout]

    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resnet_layouts_train_like_one_device(run_of, layout):
    """BatchNorm's statistics span the global batch on every layout: the losses and running
    averages of one device."""
    (got, state), (expected, expected_state) = run_of(layout), run_of("one_device")
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in expected], rtol=1e-5, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state, expected_state)


def test_resnet_resumes_bitwise_with_its_running_averages_and_onto_another_layout(tmp_path, run_of):
    """Saved at step 3 of STEPS (one device): resumed there, the run is the uninterrupted one
    bitwise, BatchNorm's running averages included; resumed on fsdp=4 x data=2 (the averages
    resharded over fsdp), the same to float rounding. (The references are the layout tests' runs.)"""
    saved_at = STEPS // 2
    logged, uninterrupted = run_of("one_device")
    expected = [m["loss"] for m in logged]
    run_dir, one_device = tmp_path / "run", jax.devices()[:1]
    loop.train(_resnet(run_dir, None, saved_at, checkpoint={"every": saved_at}), one_device)
    shutil.copytree(run_dir, tmp_path / "moved")
    resumed = loop.train(_resnet(run_dir, None, checkpoint={"every": saved_at}), one_device)
    assert [m["loss"] for m in metrics(run_dir)] == expected  # bitwise
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.model_state), uninterrupted)
    export_params(run_dir, tmp_path / "resnet.npz")  # the running averages travel with the parameters
    exported = np.load(tmp_path / "resnet.npz")
    np.testing.assert_array_equal(exported["stem.norm.var"], uninterrupted["stem"]["norm"]["var"])
    assert "stem.norm.scale" in exported and "head.kernel" in exported

    moved = loop.train(_resnet(tmp_path / "moved", "fsdp4_data2"))
    np.testing.assert_allclose([m["loss"] for m in metrics(tmp_path / "moved")], expected, rtol=1e-5, atol=0)
    assert moved.state.model_state["stem"]["norm"]["mean"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(moved.state.model_state), uninterrupted)
