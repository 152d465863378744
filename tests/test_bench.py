"""`jaxdist bench` times the real train step and reports what benchmarks/README.md needs to reproduce a figure."""

import json

import jax
import pytest

from jaxdist import cli, config
from jaxdist.data import loader
from jaxdist.models.gpt import flops_per_token
from jaxdist.observe import timing
from jaxdist.observe.metrics import peak_flops

pytestmark = pytest.mark.slow


def test_bench_reports_consistent_throughput_and_its_setup(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    overrides = ["model.d_model=64", "model.layers=2", "model.heads=4", "model.seq_len=32", "model.vocab=256",
                 "train.global_batch=16", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "rules.preset=fsdp_tp",
                 f"run_dir={tmp_path / 'run'}", "checkpoint.every=1"]
    assert cli.main(["bench", "configs/tiny.yaml", *overrides, "--steps", "4", "--warmup", "1", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert not (tmp_path / "run").exists()  # bench never writes a run: no checkpoints, even when a recipe sets them

    assert printed["devices"] == 8 and printed["layout"] == "data=2 x stage=1 x fsdp=2 x tensor=2"
    assert printed["step_ms"] > 0 and printed["compile_s"] > 0
    assert printed["pipeline_bubble"] == 0.0  # no stages
    assert 0 < printed["dispatch_ms"] <= printed["step_ms"] * 2
    tokens = 16 * 32
    assert abs(printed["tokens_per_sec"] - tokens / (printed["step_ms"] / 1e3)) <= 0.01 * printed["tokens_per_sec"] + 1
    assert abs(printed["tokens_per_sec_per_device"] * 8 - printed["tokens_per_sec"]) <= 8
    cfg = config.load("configs/tiny.yaml", overrides)
    peak = peak_flops(printed["device_kind"])
    if peak is None:  # CPU
        assert printed["mfu"] is None
    else:
        assert abs(printed["mfu"] - flops_per_token(cfg) * printed["tokens_per_sec_per_device"] / peak) <= 1e-4
    assert printed["jax"] == jax.__version__
    assert "--xla_gpu_dot_merger_threshold_mb=0" in printed["xla_flags"]
    # The layout moves gradients and activations across devices: the bytes per step are reported.
    assert printed["collective_mb"] and all(size >= 0 for kind in printed["collective_mb"].values() for size in kind.values())


@pytest.mark.parametrize("recipe, sizes, devices", [
    ("digits_mlp", {"hidden": [256, 256]}, 8),
    ("digits_resnet_lars", {"depth": 18, "width": 8, "stem": "small"}, 1),  # one device: a quicker compile
])
def test_bench_runs_a_classifier_on_random_images(capsys, recipe, sizes, devices):
    """Every registered model benches: random pixels and labels, examples/s, its FLOPs for MFU. The
    recipes' `auto` classes and image shape come from their data, as `train` takes them."""
    overrides = ["train.global_batch=32", f"mesh.data={devices}"]
    assert cli.main(["bench", recipe, *overrides, "--devices", str(devices), "--steps", "2", "--warmup", "0"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["model"] == recipe.split("_")[1] and {k: printed[k] for k in sizes} == sizes
    assert printed["devices"] == devices and "tokens_per_sec" not in printed
    assert abs(printed["examples_per_sec"] - 32 / (printed["step_ms"] / 1e3)) <= 0.01 * printed["examples_per_sec"] + 1
    assert abs(printed["examples_per_sec_per_device"] * devices - printed["examples_per_sec"]) <= devices
    assert printed["mfu"] is None or printed["mfu"] > 0  # None on CPU: no known peak
    # An untrained classifier's loss on random labels: near ln(10) = 2.30.
    assert 1.5 < printed["first_loss"] < 4.0
    if devices > 1:  # the same random batch on one device: the same first loss
        one_cfg = loader.resolve_model(config.load(recipe, [*overrides, "mesh.data=1"]))
        one = timing.measure(one_cfg, steps=1, warmup=0, devices=jax.devices()[:1])
        assert abs(one["first_loss"] - printed["first_loss"]) <= 1e-5 * printed["first_loss"]


def test_bench_bubble_times_one_device_on_its_share_of_the_batch(capsys):
    """`--bubble`: beside the pipelined step, one device runs the model unpipelined on the batch's
    per-device share, and the measured bubble is one minus its step time over the pipeline's. The
    share (4 rows) holds two of the pipeline's microbatches (2 rows): one device runs it as those
    too, which splits the measured bubble into what microbatches that small cost one device and
    what the pipeline costs beyond them."""
    overrides = ["model.d_model=32", "model.layers=4", "model.heads=4", "model.seq_len=16", "model.vocab=128",
                 "model.impl.loss_chunk=0", "mesh.stage=2", "mesh.fsdp=1", "mesh.tensor=1", "model.impl.scan_layers=true",
                 "pipeline.microbatches=4", "train.global_batch=8"]
    assert cli.main(["bench", "tiny", *overrides, "--devices", "2", "--steps", "2", "--warmup", "1", "--bubble"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["devices"] == 2 and printed["pipeline_bubble"] == round(1 / 5, 4)  # (S-1)/(M+S-1)
    assert printed["one_device_global_batch"] == 4 and printed["one_device_microbatches"] == 1
    step, one, same_size = (printed[key] for key in ("step_ms", "one_device_step_ms",
                                                     "one_device_at_pipeline_microbatches_step_ms"))
    assert one > 0 and same_size > 0
    assert abs(printed["pipeline_bubble_measured"] - (1 - one / step)) <= 1e-4 + 1e-2 / step
    assert printed["pipeline_microbatch_rows"] == 2 and printed["one_device_at_pipeline_microbatches"] == 2
    assert abs(printed["microbatch_cost"] - (1 - one / same_size)) <= 1e-4 + 1e-2 / same_size
    assert abs(printed["pipeline_overhead_measured"] - (1 - same_size / step)) <= 1e-4 + 1e-2 / step


def test_bench_bubble_with_accumulation_accumulates_the_one_device_share_as_far_as_it_divides(capsys):
    """Accumulating 4 microbatches of the whole batch of 8 (held whole by the stage and tensor
    devices), the pipeline splits it; one device's share is 2 rows, run as 2 microbatches of 1."""
    overrides = ["model.d_model=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab=128",
                 "model.impl.loss_chunk=0", "mesh.stage=2", "mesh.fsdp=1", "mesh.tensor=2", "model.impl.scan_layers=true",
                 "pipeline.microbatches=2", "train.global_batch=8", "train.microbatches=4"]
    assert cli.main(["bench", "tiny", *overrides, "--devices", "4", "--steps", "1", "--warmup", "0", "--bubble"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["one_device_global_batch"] == 2 and printed["one_device_microbatches"] == 2
    assert printed["one_device_step_ms"] > 0
    assert "microbatch_cost" not in printed  # the pipeline's microbatches are those 2 rows of 1
    expected = 1 - printed["one_device_step_ms"] / printed["step_ms"]
    assert abs(printed["pipeline_bubble_measured"] - expected) <= 1e-4 + 1e-2 / printed["step_ms"]


def test_bench_bubble_needs_a_pipeline(capsys, compiles):
    assert cli.main(["bench", "tiny", "mesh.fsdp=1", "mesh.tensor=1", "--devices", "1", "--bubble"]) == 2
    err = capsys.readouterr().err
    assert "bench --bubble measures a pipeline's bubble: set mesh.stage > 1" in err
    assert compiles.count == 0


@pytest.mark.parametrize("flag", ["--out", "--profile"])
def test_bench_paths_that_cannot_be_written_fail_before_compiling(tmp_path, capsys, compiles, flag):
    (tmp_path / "a_file").write_text("")
    path = tmp_path / "a_file" / "bench.json" if flag == "--out" else tmp_path / "a_file"
    overrides = ["model.d_model=32", "model.layers=1", "model.seq_len=16", "train.global_batch=8"]
    assert cli.main(["bench", "tiny", *overrides, "--steps", "1", "--warmup", "0", flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxdist: error: bench: {flag}={path} cannot be written: {tmp_path / 'a_file'} is a file, "
                   f"not a directory\n")
    assert compiles.count == 0
