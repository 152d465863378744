"""`jaxdist plan`: memory per device from the compiled step, without allocating the state."""

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import make_config

from jaxdist import cli, config, models
from jaxdist.commands import plan
from jaxdist.errors import UserError
from jaxdist.models.gpt import flops_per_token
from jaxdist.observe import memory
from jaxdist.observe.scaling import model_size
from jaxdist.train.state import abstract_model

pytestmark = pytest.mark.slow

SMALL = {"model": {"d_model": 64, "layers": 2, "heads": 4, "seq_len": 64, "vocab": 256},
         "train": {"global_batch": 16}, "mesh": {"data": 2, "fsdp": 4, "tensor": 1}, "rules": {"preset": "fsdp"}}


def test_gpt_1b4_under_fsdp8_holds_an_eighth_of_the_parameters_per_device(devices):
    # Scanned layers: the same parameters as the recipe's unrolled ones, compiled much faster here.
    cfg = config.load("configs/gpt_1b4.yaml", ["mesh.fsdp=8", "model.impl.scan_layers=true", "precision.compute=float32"])
    result = memory.make_plan(cfg, devices)
    params = model_size(cfg).params
    assert result.mesh == "data=1 x stage=1 x fsdp=8 x tensor=1" and result.devices == 8
    assert abs(result.params - params * 4 / 8) <= 0.05 * params * 4 / 8
    assert abs(result.opt_state - 2 * params * 4 / 8) <= 0.05 * 2 * params * 4 / 8  # AdamW: two moments
    assert result.temporaries > 0
    assert result.flops == flops_per_token(cfg) * 8 * 1024 / 8  # the recipe's batch of 8 sequences, per device
    assert result.total >= result.params + result.opt_state + result.temporaries


def test_the_llama3_8b_recipe_fits_8_devices_of_80_gb(devices):
    """The recipe as written: its layout (fsdp=8, one sequence of 8,192 per device, blocks recomputed)
    holds an eighth of the 8.0B parameters and their Adam moments per device, and the compiled step,
    temporaries included, stays under 80 GB. (The whole recipe compiles: its layers are scanned.)"""
    cfg = config.load("configs/llama3_8b.yaml")
    result = memory.make_plan(cfg, devices)
    params = model_size(cfg).params
    assert 8.0e9 < params < 8.1e9  # Llama 3.1 8B: 8,030,261,248
    assert result.mesh == "data=1 x stage=1 x fsdp=8 x tensor=1" and result.devices == 8
    assert abs(result.params - params * 4 / 8) <= 0.01 * params * 4 / 8
    assert abs(result.opt_state - 2 * params * 4 / 8) <= 0.01 * 2 * params * 4 / 8
    assert result.temporaries > 0 and result.total < 80e9, result


def test_over_the_device_memory_the_cheapest_change_that_fits_is_suggested(tmp_path, devices):
    cfg = make_config(tmp_path, **SMALL)
    # Cheapest first, as measured (docs/performance.md), then the wider fsdp that keeps the devices.
    tried = memory.savings(cfg, devices)
    assert tried == [["model.impl.remat=mlp"], ["train.microbatches=2"], ["train.microbatches=4"],
                     ["model.impl.remat=full"], ["train.microbatches=8"],
                     ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]]
    whole = memory.make_plan(cfg, devices)
    remat = memory.make_plan(config.with_overrides(cfg, ["model.impl.remat=full"]), devices)
    assert remat.temporaries < whole.temporaries and remat.params == whole.params
    limit = (whole.total + remat.total) // 2
    overrides, fitted = memory.suggest(cfg, limit, devices)
    assert fitted.total <= limit < whole.total
    for cheaper in tried[:tried.index(overrides)]:
        try:
            cheaper_plan = memory.make_plan(config.with_overrides(cfg, cheaper), devices)
        except UserError:  # e.g. more microbatches than the per-device batch has rows
            continue
        assert cheaper_plan.total > limit, cheaper
    # Compiled for CPU, only the state and batch are judged: the temporaries are not a GPU's.
    verdict = memory.report(cfg, devices, limit).splitlines()[-1]
    assert verdict == (f"the state and batch take {memory._gb(whole.held)} of {memory._gb(limit)} per device "
                       f"({whole.held / limit:.0%}), leaving {memory._gb(limit - whole.held)} for temporaries and code: "
                       f"the CPU compile's ({memory._gb(whole.temporaries + whole.code)}) would not fit; "
                       f"run jaxdist plan on the GPU host for the verdict")
    assert memory.report(cfg, devices, whole.total + 1).splitlines()[-1].endswith(
        " would fit; run jaxdist plan on the GPU host for the verdict")


def test_plan_command_prints_the_plan_and_allocates_nothing(tmp_path, capsys):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(make_config(tmp_path / "run", **SMALL).to_yaml())
    gc.collect()  # arrays other tests left to the collector would otherwise vanish during the command
    before = jax.live_arrays()
    assert cli.main(["plan", str(config_file), "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plan: mesh data=2 x stage=1 x fsdp=4 x tensor=1 (8 cpu devices)"
    assert out[1].startswith("per device: parameters ") and "temporaries" in out[1]
    assert out[1].endswith(" MFLOP per step"), out[1]  # a small step's work in a unit that shows it
    assert out[2].startswith("collectives per step and device (train.grad_compression none): all-gather ")
    assert out[3].startswith("compiled for CPU: parameters, optimizer state, model state, compute copies and batch "
                             "are exact on any device; temporaries and code are CPU XLA's, not a GPU's")
    assert out[4].startswith("the state and batch take ") and " of 80.00 GB per device (0%)" in out[4]
    gc.collect()
    created = [array for array in jax.live_arrays() if all(array is not old for old in before)]
    assert created == []  # nothing allocated for the state


@pytest.mark.parametrize("count, text", [(2.5e12, "2.50 TFLOP"), (3.2e9, "3.20 GFLOP"), (4e6, "4.00 MFLOP")])
def test_flops_print_in_the_largest_unit_they_fill(count, text):
    assert memory._flop(count) == text


@pytest.mark.parametrize("text, size", [("80GB", 80e9), ("16GiB", 16 * 2**30), ("512 MB", 512e6), ("1e9", 1e9)])
def test_device_memory_sizes_parse(text, size):
    assert plan.parse_bytes(text) == size


def test_a_bad_device_memory_is_a_user_error():
    with pytest.raises(UserError, match="--device-memory 'lots'"):
        plan.parse_bytes("lots")


def test_a_wider_fsdp_keeps_the_device_count(tmp_path):
    filled = make_config(tmp_path, mesh={"data": 2, "fsdp": -1}, rules={"preset": "dp"})
    assert memory.savings(filled)[-1] == ["mesh.data=1", "mesh.fsdp=-1", "rules.preset=fsdp"]
    fixed = make_config(tmp_path, mesh={"data": 2, "fsdp": 4})
    assert memory.savings(fixed)[-1] == ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp_tp"]


def test_a_wider_fsdp_is_tried_on_the_resolved_mesh(devices):
    # mesh.data=-1 (the digits recipes) fills the 8 devices with replicas, which fsdp=8 splits instead.
    filled = config.load("digits_mlp", ["model.hidden=[2048,2048]"])
    assert memory.savings(filled)[-1] == ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]
    # Under tp the weights stay split over tensor and are split over fsdp too.
    tensor = config.load("configs/tiny.yaml", ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4",
                                                       "rules.preset=tp"])
    assert memory.savings(tensor)[-1] == ["mesh.data=1", "mesh.fsdp=2", "rules.preset=fsdp_tp"]
    # One replica: nothing to widen fsdp with.
    assert all("mesh.data=1" not in each for each in memory.savings(config.with_overrides(tensor, ["mesh.data=1",
                                                                                                  "mesh.fsdp=2"])))


@pytest.mark.parametrize("recipe", ["digits_mlp", "digits_resnet_lars"])
def test_plan_for_a_classifier_counts_its_state_batch_and_flops(capsys, recipe):
    """Every registered model plans: under fsdp=8 the ResNet's kernels, BatchNorm parameters and
    running averages hold an eighth per device (all but the head's 10 biases); the batch is 64
    images of 8x8x1 float32 and their int32 labels; the FLOPs are the model's per example."""
    overrides = ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp", "train.global_batch=64"]
    assert cli.main(["plan", recipe, *overrides]) == 0  # `auto` sizes from the digits, as train takes them
    assert capsys.readouterr().out.startswith("plan: mesh data=1 x stage=1 x fsdp=8 x tensor=1 (8 cpu devices)\n")
    cfg = config.load(recipe, [*overrides, "model.classes=10", "model.image_shape=[8,8,1]"])
    result = memory.make_plan(cfg)
    abstract = abstract_model(models.get(cfg.model.name).create(cfg), cfg.seed)
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract.params))
    assert result.batch == 64 * (8 * 8 * 1 * 4 + 4) // 8
    assert result.flops == models.get(cfg.model.name).flops_per_example(cfg) * 64 / 8
    if recipe == "digits_resnet_lars":
        assert result.params == ((count - 10) // 8 + 10) * 4
        state = sum(leaf.size for leaf in jax.tree.leaves(abstract.state))
        assert result.model_state == state * 4 // 8 and "model state" in result.lines()[1]
    else:  # the hidden layers' biases (`mlp`) stay whole under fsdp
        assert result.model_state == 0
        biases = sum(cfg.model.hidden) + 10
        assert result.params == ((count - biases) // 8 + biases) * 4


def test_compiled_for_cpu_the_fit_is_judged_on_the_state_and_batch(capsys):
    """2 x 2048 hidden units: 17.40 MB of parameters and 34.80 MB of AdamW moments per replica
    exceed 40 MB whatever the temporaries; fsdp=8 splits them to an eighth."""
    assert cli.main(["plan", "digits_mlp", "model.hidden=[2048,2048]", "--device-memory", "40MB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "does not fit in 40.00 MB per device: the state and batch alone need 52.20 MB"
    assert out[-1] == ("suggestion: mesh.data=1 mesh.fsdp=8 rules.preset=fsdp -> state and batch 6.57 MB per device "
                       "(compiled; a GPU's temporaries not counted)")


def _plan_in_a_process(*args: str) -> subprocess.CompletedProcess:
    """`jaxdist plan ARGS` in a fresh process: --mock-gpus must be set before JAX's backend starts."""
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", "plan", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, cwd=root, timeout=600)


def test_mock_gpus_need_a_gpu_host_and_exclude_devices():
    if jax.default_backend() == "gpu":
        pytest.skip("the message for a host without a GPU")
    run = _plan_in_a_process("digits_mlp", "--mock-gpus", "2")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "jaxdist: error: plan --mock-gpus 2: compiling for GPUs that are not there needs one that is (a GPU host "
        "with JAX's CUDA plugin); JAX runs on cpu here")
    with pytest.raises(SystemExit) as usage:
        cli.main(["plan", "digits_mlp", "--devices", "2", "--mock-gpus", "2"])
    assert usage.value.code == 2


@pytest.mark.parametrize("visible, flags, expected", [
    (None, "", ("0", "--xla_gpu_autotune_level=0")),
    ("3,5", "--xla_gpu_autotune_level=2", ("3", "--xla_gpu_autotune_level=2")),
], ids=["defaults", "the_users_gpus_and_autotuning"])
def test_mock_gpus_compile_on_the_first_visible_gpu_without_autotuning(visible, flags, expected):
    """One real GPU stands for all N (each mock process would bring every visible one), and XLA's
    autotuning, which runs kernels on devices that are not there, is off unless XLA_FLAGS sets it."""
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env.update(XLA_FLAGS=flags, **({"CUDA_VISIBLE_DEVICES": visible} if visible else {}))
    script = ("import os, jax; from jaxdist import runtime; runtime.mock_gpus(4); "
              "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['XLA_FLAGS'], "
              "jax.config.read('mock_num_gpu_processes'))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [*expected, "4"]


# A 4-layer GPT in 2 stages, circular, small enough to compile in seconds.
_SMALL_PIPELINE = ["configs/gpt_406m.yaml", "model.layers=4", "model.d_model=512", "model.heads=8",
                   "model.seq_len=512", "train.global_batch=16", "mesh.stage=2", "mesh.fsdp=1",
                   "model.impl.scan_layers=true", "pipeline.microbatches=4", "pipeline.repeats=2"]


def _waited_rolls(out: str) -> tuple[int, int]:
    line = next(line for line in out.splitlines() if line.startswith("collectives XLA's schedule runs beside nothing"))
    waited, total = re.search(r"collective-permute (\d+) of (\d+)", line).groups()
    return int(waited), int(total)


@pytest.mark.gpu
def test_on_one_gpu_a_pipeline_is_planned_for_two_and_its_overlapped_rolls_wait_less():
    """Compiled for 2 GPUs on one: each GPU's plan, and XLA's schedule. The stage-to-stage rolls the
    next iteration uses are nearly all synchronous (the step waits for them); with
    pipeline.overlap_transfers most of them run beside compute."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    plain = _plan_in_a_process(*_SMALL_PIPELINE, "--mock-gpus", "2")
    overlapped = _plan_in_a_process(*_SMALL_PIPELINE, "pipeline.overlap_transfers=true", "--mock-gpus", "2")
    for run in (plain, overlapped):
        assert run.returncode == 0, run.stderr[-3000:]
        # After the line saying the GPU kernels were built.
        assert "plan: mesh data=1 x stage=2 x fsdp=1 x tensor=1 (2 gpu devices)" in run.stdout.splitlines()
    (plain_waited, plain_rolls), (overlapped_waited, overlapped_rolls) = map(_waited_rolls, (plain.stdout,
                                                                                            overlapped.stdout))
    print(f"rolls waited for: {plain_waited} of {plain_rolls}; overlapped {overlapped_waited} of {overlapped_rolls}")
    assert plain_waited / plain_rolls > 0.8
    assert overlapped_waited / overlapped_rolls < plain_waited / plain_rolls - 0.2
