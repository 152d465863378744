"""Principle 8: data follows the mesh. Every layout trains the same under several processes.

Each layout runs as 2 processes x 4 simulated CPU devices (and some as 4 x 2), joined by
jax.distributed, and must give the losses, gradient norms and the eval loss of the same model on
one device (each layout, run in one process of 8 devices, gives them to within 4e-7 of each other).
The rows pack documents of very different lengths (tests/conftest.py's `packed_corpus`), so the
processes and shards hold different numbers of counted tokens: the loss is still one token mean.
Every run, the reference included, compiles at XLA's lowest CPU optimization level (the suite's,
tests/conftest.py). Whatever axis crosses the processes (data, fsdp, tensor, pipeline stages, or a mix), each
process feeds the rows of the global batch its devices hold: processes holding the same rows read
the same rows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_RESNET, make_classifier_config, make_config

from jaxdist import loop
from jaxdist.commands.launch import free_port
from jaxdist.parallel import feed

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
STEPS = 4
# Eight heads, so that tensor parallelism can span all 8 devices (the only way tensor crosses
# processes: the mesh gives processes to the outer axes first).
MODEL = {"d_model": 32, "layers": 4, "heads": 8, "seq_len": 16, "vocab": "auto"}
PIPE = {"microbatches": 2}
EVAL = {"every": STEPS, "batches": 2}

# With stages the batch is split over (data, fsdp, stage), the stage innermost: under stage=2 x
# fsdp=4, 8 shards of 2 rows, stage 0's devices holding every other pair.
STAGE_0_ROWS = [0, 1, 4, 5, 8, 9, 12, 13]
STAGE_1_ROWS = [2, 3, 6, 7, 10, 11, 14, 15]

# name: (config sections, the rows of a global batch of 16 each process feeds, by process count).
LAYOUTS = {
    "data": ({"mesh": {"data": 2, "fsdp": 4}, "rules": {"preset": "fsdp"}},
             {2: [range(0, 8), range(8, 16)]}),
    "fsdp": ({"mesh": {"data": 1, "fsdp": 8}, "rules": {"preset": "fsdp"}},
             {2: [range(0, 8), range(8, 16)], 4: [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]}),
    "tensor": ({"mesh": {"data": 1, "fsdp": 1, "tensor": 8}, "rules": {"preset": "tp"}},
               {2: [range(0, 16)] * 2}),
    "stage_gpipe": ({"mesh": {"data": 1, "stage": 2, "fsdp": 4}, "rules": {"preset": "fsdp"}, "pipeline": PIPE},
                    {2: [STAGE_0_ROWS, STAGE_1_ROWS],
                     4: [STAGE_0_ROWS[:4], STAGE_0_ROWS[4:], STAGE_1_ROWS[:4], STAGE_1_ROWS[4:]]}),
    "stage_circular": ({"mesh": {"data": 1, "stage": 2, "fsdp": 4}, "rules": {"preset": "fsdp"},
                        "pipeline": {**PIPE, "repeats": 2}},
                       {2: [STAGE_0_ROWS, STAGE_1_ROWS]}),
    "stage_fsdp_tensor": ({"mesh": {"data": 1, "stage": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"},
                           "pipeline": PIPE},
                          {2: [[*range(0, 4), *range(8, 12)], [*range(4, 8), *range(12, 16)]]}),
    "stage_tensor": ({"mesh": {"data": 1, "stage": 2, "fsdp": 1, "tensor": 4}, "rules": {"preset": "tp"},
                      "pipeline": PIPE},
                     {2: [range(0, 8), range(8, 16)]}),
    "data_tensor": ({"mesh": {"data": 2, "fsdp": 1, "tensor": 4}, "rules": {"preset": "tp"}},
                    {4: [range(0, 8), range(0, 8), range(8, 16), range(8, 16)]}),
}


def layout_config(run_dir: Path, name: str, data: dict, **overrides):
    """The layout's config on `data`; `overrides` replace whole sections."""
    sections, _ = LAYOUTS[name]
    return make_config(run_dir, **{"model": MODEL, "train": {"steps": STEPS}, "eval": EVAL, "data": data, **sections,
                                   **overrides})


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_processes(cases: list, processes: int, tmp_path: Path, timeout: float = 600) -> None:
    """Trains every case (a Config) in `processes` real processes of 8 / `processes` devices each."""
    cases_file = tmp_path / f"cases-{processes}.json"
    cases_file.write_text(json.dumps([cfg.model_dump(mode="json") for cfg in cases]))
    port = free_port()
    env = {**os.environ, "JAXDIST_CPU_DEVICES": str(8 // processes), "PYTHONPATH": os.pathsep.join(sys.path),
           "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    workers = [
        subprocess.Popen([sys.executable, str(HERE / "layouts_process.py"), str(port), str(i), str(processes),
                          str(cases_file)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(processes)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=timeout)
        assert worker.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, packed_corpus):
    """The reference every layout is held to: the same model, batches and eval on one device."""
    run_dir = tmp_path_factory.mktemp("one_device")
    loop.train(make_config(run_dir, model=MODEL, train={"steps": STEPS}, eval=EVAL, data=packed_corpus,
                           mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "fsdp"}),
               devices=jax.devices()[:1])
    run = metrics(run_dir)
    assert len(run) == STEPS and run[-1]["loss"] < run[0]["loss"]
    return run


def _assert_same_training(got: list[dict], expected: list[dict]) -> None:
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in got], [m[key] for m in expected], rtol=1e-5, atol=0, err_msg=key)
    assert "eval_loss" in got[-1]
    np.testing.assert_allclose(got[-1]["eval_loss"], expected[-1]["eval_loss"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("processes", [2, 4])
def test_every_layout_across_processes_trains_like_one_device(tmp_path, one_device, packed_corpus, processes):
    names = [name for name, (_, rows) in LAYOUTS.items() if processes in rows]
    run_processes([layout_config(tmp_path / name, name, packed_corpus) for name in names], processes, tmp_path)
    for name in names:
        fed = [json.loads((tmp_path / name / f"rows-{p}.json").read_text()) for p in range(processes)]
        assert fed == [list(rows) for rows in LAYOUTS[name][1][processes]], name
        _assert_same_training(metrics(tmp_path / name), one_device)


def test_classifier_eval_is_exact_across_processes(tmp_path):
    """A BatchNorm ResNet on data=2 x fsdp=4 as 1 process x 8 devices and as 2 x 4: the same losses,
    and the same eval loss and accuracy over the whole eval split of 360 digits, which batches of
    32 do not divide (the last one is padded with rows of weight 0)."""

    def case(name):
        return make_classifier_config(tmp_path / name, SMALL_RESNET, mesh={"data": 2, "fsdp": 4},
                                      rules={"preset": "fsdp"}, train={"steps": 2, "global_batch": 32},
                                      eval={"every": 2})

    loop.train(case("one"))  # in this process, all 8 devices
    run_processes([case("two")], 2, tmp_path)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    np.testing.assert_allclose([m["loss"] for m in two], [m["loss"] for m in one], rtol=1e-5, atol=0)
    assert two[-1]["eval_accuracy"] == one[-1]["eval_accuracy"]
    np.testing.assert_allclose(two[-1]["eval_loss"], one[-1]["eval_loss"], rtol=1e-6, atol=0)
    correct = one[-1]["eval_accuracy"] * 360  # a whole number of the 360 eval images, no padding counted
    assert abs(correct - round(correct)) < 1e-9 and 0 < round(correct) < 360


def test_pipeline_saved_by_two_processes_resumes_in_one_under_another_layout(tmp_path, packed_corpus):
    """Stages on different processes save; one process with fsdp x tensor resumes; the losses after
    the resume are the uninterrupted run's."""
    steps, saved_at = 6, 3
    reference = tmp_path / "uninterrupted"
    loop.train(layout_config(reference, "stage_gpipe", packed_corpus, train={"steps": steps}, eval={"every": 0}))

    run_dir = tmp_path / "run"
    first = layout_config(run_dir, "stage_gpipe", packed_corpus, train={"steps": saved_at}, eval={"every": 0},
                          checkpoint={"every": saved_at})
    run_processes([first], 2, tmp_path)
    assert (run_dir / "checkpoints" / str(saved_at)).is_dir()
    resumed = make_config(run_dir, model=MODEL, train={"steps": steps}, mesh={"data": 1, "fsdp": 4, "tensor": 2},
                          rules={"preset": "fsdp_tp"}, checkpoint={"every": saved_at}, data=packed_corpus)
    loop.train(resumed)
    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in metrics(reference)], rtol=1e-5, atol=0)


def _cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxdist.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE.parent)


def test_replicas_that_read_different_rows_stop_before_training(tmp_path, packed_corpus):
    """Two processes holding the same rows (tensor parallelism across them) but given different data
    (here, by different seeds) stop with one line, exit 2, before compiling the step."""
    port = free_port()
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "4", "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = []
    for process in range(2):
        cfg = layout_config(tmp_path / "run", "tensor", packed_corpus, seed=process)
        config_file = tmp_path / f"{process}.yaml"
        config_file.write_text(cfg.to_yaml())
        runs.append(_cli("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process),
                         "--init-timeout", "60", "train", str(config_file), env=env))
    for run in runs:
        _, stderr = run.communicate(timeout=240)
        assert run.returncode == 2, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, stderr[-3000:]
        assert lines[0].startswith("jaxdist: error: the first global batch disagrees across processes: rows 0..15 "
                                   "differ between processes 0 vs processes 1")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=2", "mesh.fsdp=4", "train.global_batch=12"],
     "train.global_batch=12 is not divisible by the 8 batch shards (the batch is split over mesh.data x mesh.fsdp); "
     "use a multiple of 8"),
    (["mesh.data=2", "mesh.fsdp=4", "rules.activations.batch=data", "train.global_batch=3"],
     "train.global_batch=3 is not divisible by the 2 batch shards (the batch is split over mesh.data); "
     "use a multiple of 2"),
], ids=["data_x_fsdp", "batch_rule_data_only"])
def test_a_batch_the_shards_cannot_split_is_a_user_error(tmp_path, capsys, compiles, overrides, message):
    from jaxdist import cli

    config_file = tmp_path / "c.yaml"
    config_file.write_text(make_config(tmp_path / "run").to_yaml())
    assert cli.main(["train", str(config_file), *overrides]) == 2
    assert capsys.readouterr().err.strip() == f"jaxdist: error: {message}"
    assert compiles.count == 0


def test_batch_rule_decides_the_rows_each_process_feeds(devices):
    """With the batch split over `data` only, fsdp holds replicas: every fsdp device holds the same rows."""
    from jaxdist.parallel import layout

    cfg = make_config("unused", mesh={"data": 2, "fsdp": 4}, rules={"preset": "fsdp", "activations": {"batch": "data"}},
                      train={"global_batch": 6})
    run_layout = layout.from_config(cfg, devices)
    assert run_layout.batch_shards == 2
    assert run_layout.process_rows(6).rows == tuple(range(6))  # one process holds both shards
    shards = feed.batch_shards(run_layout.batch_sharding, 6)
    assert shards == [range(0, 3), range(3, 6)]
    # Replicas agree or not by their digests: process 1 holds shard 0 only and read other values.
    digests = np.array([[11, 22], [12, -1], [-1, 22]])
    assert feed.disagreeing_replicas(digests, shards) == "rows 0..2 differ between processes 0 vs processes 1"
    assert feed.disagreeing_replicas(digests[[0, 2]], shards) is None


def test_bench_feeds_each_process_its_rows(capsys, tmp_path):
    """`jaxdist bench` over stages on two processes starts from the one-process first loss: the
    random batch is drawn globally and each process feeds the rows its devices hold."""
    from jaxdist import cli
    from test_multihost import run_jaxdist

    program = ["bench", "configs/tiny.yaml", "model.d_model=32", "model.layers=4", "model.heads=8", "model.seq_len=16",
               "mesh.stage=2", "mesh.fsdp=4", "mesh.tensor=1", "pipeline.microbatches=2", "train.global_batch=16",
               "--steps", "1", "--warmup", "0"]
    assert cli.main(program) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    result = run_jaxdist("launch", "-n", "2", "--devices-per-process", "4", "--log", str(tmp_path / "launch.log"), "--",
                         *program)
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads(next(line[4:] for line in result.stdout.splitlines() if line.startswith("[0] {")))
    assert two["layout"] == one["layout"] == "data=1 x stage=2 x fsdp=4 x tensor=1"
    assert one["pipeline_microbatches"] == 2 and one["pipeline_bubble"] == round(1 / 3, 4)  # (S-1)/(M+S-1)
    np.testing.assert_allclose(two["first_loss"], one["first_loss"], rtol=1e-6)
