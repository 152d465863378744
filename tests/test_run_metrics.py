"""What a run logs beside the loss: MFU and memory where the device reports them, the data wait, the
parameter norm; and the same values in TensorBoard's event files."""

import json
import math
import struct
import types

import jax
import numpy as np
import pytest
from conftest import logged_keys, make_config, undocumented_metrics
from tensorboardX.proto import event_pb2

from jaxdist import loop
from jaxdist.observe.metrics import MetricsWriter, device_metrics, mfu, peak_flops, throughput
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

NAMED = ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "step_time_s", "param_norm", "data_wait_s")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("metrics") / "run"
    loop.train(make_config(run_dir, train={"steps": 4}, log={"every": 2}, eval={"every": 2}))
    return run_dir


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_peak_flops_by_device_kind():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA B200") == 2250e12
    assert peak_flops("cpu") is None
    assert mfu(1e9, 989e3, "NVIDIA H100 PCIe") == pytest.approx(1.0)
    assert mfu(1e9, 989e3, "TPU v5 lite") is None


def test_logged_steps_carry_data_wait_and_param_norm_and_no_device_numbers_on_cpu(run_dir):
    logged = records(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 4]
    for record in logged:
        assert record["data_wait_s"] >= 0
        assert record["param_norm"] > 0 and math.isfinite(record["param_norm"])
        assert not {"mfu", "memory_gb", "peak_memory_gb"} & record.keys()  # CPU: no peak, no memory statistics
    assert logged[0]["param_norm"] != logged[-1]["param_norm"]  # measured after each update


def test_every_key_a_run_writes_is_documented(run_dir):
    """docs/running.md's Metrics table lists every key: a run's (the spike guard's among them), and
    what a GPU and a classifier add (the other tests' runs check theirs: mixtures, saves, float16)."""
    gpu = types.SimpleNamespace(device_kind="NVIDIA H200",
                                memory_stats=lambda: {"bytes_in_use": 1e9, "peak_bytes_in_use": 2e9})
    on_gpu = device_metrics(1e9, 1e3, types.SimpleNamespace(local_devices=[gpu], devices=np.empty(8)))
    keys = logged_keys(run_dir) | on_gpu.keys() | throughput(1.0, None).keys()
    assert {"loss_spike", "loss_average", "mfu", "memory_gb", "examples_per_sec", "eval_loss"} <= keys
    assert undocumented_metrics(keys) == set()


def test_the_parameter_norm_is_the_sharded_parameters_norm_and_stays_out_of_the_step(tmp_path):
    """Measured where a step is logged, by a program of its own: inside the step its reduction kept
    XLA from writing the compute copies in the update's pass (a second read of every parameter)."""
    cfg = make_config(tmp_path, mesh={"data": 2, "fsdp": 4, "tensor": 1})
    trainer = Trainer.from_config(cfg, devices=jax.devices()[:8])
    tokens = np.random.default_rng(0).integers(0, 256, (16, 33))
    metrics = trainer.step({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    assert "param_norm" not in metrics
    leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(jax.device_get(trainer.state.params))]
    expected = math.sqrt(sum(float(np.sum(leaf * leaf)) for leaf in leaves))
    norm = trainer.param_norm()
    assert norm.sharding.is_fully_replicated
    assert float(norm) == pytest.approx(expected, rel=1e-6)


def scalars(tb_dir) -> dict[str, dict[int, float]]:
    """Every scalar in the event files: tag -> step -> value (TFRecord framing: length, its CRC, data, CRC)."""
    found: dict[str, dict[int, float]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


def test_a_non_finite_value_is_null_in_the_jsonl_and_a_gap_in_tensorboard(tmp_path, caplog):
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"loss": 2.5, "grad_norm": 1.0})
    writer.write(2, {"loss": float("nan"), "grad_norm": float("inf")})
    writer.write(3, {"loss": 2.0, "grad_norm": 0.5})
    writer.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 2.5, "grad_norm": 1.0}, {"step": 2, "loss": None, "grad_norm": None},
        {"step": 3, "loss": 2.0, "grad_norm": 0.5}]
    assert scalars(tmp_path / "tb") == {"train/loss": {1: 2.5, 3: 2.0}, "train/grad_norm": {1: 1.0, 3: 0.5}}
    assert not caplog.records  # and no warning per value on stderr


def test_tensorboard_holds_every_logged_metric(run_dir):
    logged = records(run_dir)
    events = scalars(run_dir / "tb")
    for key in NAMED + ("eval_loss",):
        tag = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        expected = {r["step"]: r[key] for r in logged if key in r}
        assert expected, key
        assert events[tag].keys() == expected.keys(), tag
        for step, value in expected.items():
            assert events[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)
