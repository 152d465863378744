"""Host offload (`train.offload: optimizer`): the optimizer state lives in pinned host memory and
comes to the devices a parameter at a time for the update; training, saving and resuming give the
same numbers as without it."""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import make_config

from jaxdist import cli, loop
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

LAYOUT = {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}


def losses_by_step(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def test_the_optimizer_state_lives_in_host_memory_and_trains_as_on_the_device(tmp_path, capsys):
    train = {"steps": 8}
    loop.train(make_config(tmp_path / "plain", **LAYOUT, train=train))
    offloaded = loop.train(make_config(tmp_path / "offloaded", **LAYOUT, train={**train, "offload": "optimizer"},
                                       checkpoint={"every": 4}))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(offloaded.state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(offloaded.state.params)} == {"device"}
    plain, moved = losses_by_step(tmp_path / "plain"), losses_by_step(tmp_path / "offloaded")
    assert list(moved) == list(range(1, 9))
    np.testing.assert_allclose(list(moved.values()), list(plain.values()), rtol=1e-6, atol=0)

    # Saved from host memory, resumed into it: the same losses as the uninterrupted run.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "offloaded" / "checkpoints" / "4", resumed / "checkpoints" / "4")
    trainer = loop.train(make_config(resumed, **LAYOUT, train={**train, "offload": "optimizer"}))
    assert "resuming from step 4" in capsys.readouterr().out
    again = losses_by_step(resumed)
    assert list(again) == [5, 6, 7, 8]
    np.testing.assert_allclose([again[s] for s in again], [moved[s] for s in again], rtol=1e-6, atol=0)
    for a, b in zip(jax.tree.leaves(trainer.state.opt_state), jax.tree.leaves(offloaded.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_parameters_state_comes_in_after_the_update_before(tmp_path):
    """The step copies the state in a parameter at a time: each copy-in from the second on waits on
    an optimization barrier with the update before it, so XLA cannot bring the whole state in at once
    (the peak this saves is measured on a GPU: benchmarks/reports/2026-11-28-host-offload.md)."""
    trainer = Trainer.from_config(make_config(tmp_path, **LAYOUT, train={"offload": "optimizer"}))
    batch = trainer.global_batch({key: np.zeros((16, 32), np.int32) for key in ("inputs", "targets")})
    lowered = trainer._step.lower(trainer.state, trainer.current_copies(), batch).as_text()
    leaves = len(jax.tree.leaves(trainer.state.params))
    assert lowered.count("stablehlo.optimization_barrier") == leaves - 1 > 10
    assert lowered.count('mhlo.memory_kind = "pinned_host"') > 0


def test_plan_counts_the_offloaded_state_in_host_memory(tmp_path, capsys):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(make_config(tmp_path / "run", **LAYOUT, train={"offload": "optimizer"}).to_yaml())
    assert cli.main(["plan", str(config_file)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    on_device, _, in_host, _ = line.split("; ")
    assert "optimizer state" not in on_device
    params = float(re.search(r"parameters ([\d.]+) kB", on_device).group(1))
    moments = float(re.search(r"in host memory: optimizer state ([\d.]+) kB", in_host).group(1))
    assert moments == pytest.approx(2 * params, rel=0.02)  # Adam's two moments, float32 like the parameters
