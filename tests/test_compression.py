"""Compressed gradient reduction (parallel/compression.py): PowerSGD and int8 with error feedback.

Each compresses the gradient reduction over the data-parallel axes in the compiled step's own
collectives, trains like the exact reduction, and carries its error feedback through checkpoints.
"""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from conftest import make_config

from jaxdist import cli, loop, models
from jaxdist.observe import hlo
from jaxdist.observe.memory import compiled_trainer
from jaxdist.config import load
from jaxdist.parallel import compression
from jaxdist.train.state import abstract_model

pytestmark = pytest.mark.slow

DATA4 = {"mesh": {"data": 4, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"}}
MIXED = {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}


def losses_by_step(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def mean_last(losses: dict[int, float], logged: int = 5) -> float:
    """The mean of the last `logged` losses logged (steps 80 to 120 at every 10)."""
    return float(np.mean([losses[step] for step in sorted(losses)[-logged:]]))


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory) -> dict[str, dict[int, float]]:
    """120 steps of the tiny GPT on data=4, exact and with each compression."""
    runs = {}
    for method in ("none", "powersgd", "int8"):
        run_dir = tmp_path_factory.mktemp(method)
        cfg = make_config(run_dir, **DATA4, train={"steps": 120, "grad_compression": method}, log={"every": 10},
                          checkpoint={"every": 0})
        loop.train(cfg, devices=jax.devices()[:4])
        runs[method] = losses_by_step(run_dir)
    return runs


def test_compressed_training_ends_where_the_exact_run_does(long_runs):
    exact = mean_last(long_runs["none"])
    assert exact < long_runs["none"][1] - 2.0  # it learned
    assert abs(mean_last(long_runs["powersgd"]) - exact) < 0.03 * exact
    assert abs(mean_last(long_runs["int8"]) - exact) < 0.01 * exact
    # Compression changes the numbers: each run is its own, not the exact one again.
    assert long_runs["powersgd"][120] != long_runs["none"][120] != long_runs["int8"][120]
    assert list(long_runs["int8"]) == [1, *range(10, 121, 10)]


def _collective_bytes(cfg) -> int:
    trainer, _ = compiled_trainer(cfg, jax.devices()[:4])
    return sum(sum(by_dtype.values()) for by_dtype in hlo.bytes_per_call(trainer.compiled_text()).values())


def test_the_compiled_step_sends_a_fraction_of_the_exact_bytes(tmp_path):
    """gpt_406m's shapes on data=4: the collectives' bytes counted in the compiled step's HLO (its
    layers scanned, to compile faster: the same shapes, stacked)."""
    base = load("gpt_406m", [f"run_dir={tmp_path}", "mesh.data=4", "mesh.fsdp=1", "rules.preset=dp",
                             "train.global_batch=4", "model.seq_len=256", "precision.compute=float32",
                             "model.impl.scan_layers=true"])
    sent = {method: _collective_bytes(base.model_copy(update={"train": base.train.model_copy(
        update={"grad_compression": method})})) for method in ("none", "powersgd", "int8")}
    assert sent["none"] > 4 * 400e6  # every float32 gradient, once
    assert sent["none"] / sent["powersgd"] >= 100, sent  # 177x: rank-4 factors of 1024-wide matrices
    assert sent["none"] / sent["int8"] >= 3, sent


def _run(run_dir, layout, steps, **train):
    cfg = make_config(run_dir, **layout, train={"steps": steps, "microbatches": 2, **train},
                      checkpoint={"every": 4})
    return loop.train(cfg)


@pytest.mark.parametrize("method", ["powersgd", "int8"])
def test_error_feedback_is_checkpointed_and_resumes_exactly(tmp_path, method, capsys):
    """data2 x fsdp2 x tensor2 with accumulation; the resumed run's losses and state are the
    uninterrupted run's, and the error feedback is in the checkpoint."""
    whole = _run(tmp_path / "whole", MIXED, 8, grad_compression=method)
    errors = [leaf for leaf in jax.tree.leaves(whole.state.compression.error)]
    assert errors and all(leaf.shape[0] == 4 for leaf in errors)
    assert max(float(np.abs(np.asarray(leaf)).max()) for leaf in errors) > 0

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "4", resumed_dir / "checkpoints" / "4")
    resumed = _run(resumed_dir, MIXED, 8, grad_compression=method)
    out = capsys.readouterr().out
    assert "resuming from step 4" in out and "error feedback starts fresh" not in out
    want, got = losses_by_step(tmp_path / "whole"), losses_by_step(resumed_dir)
    assert list(got) == [5, 6, 7, 8]
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6, atol=0)
    for a, b in zip(jax.tree.leaves(whole.state.compression), jax.tree.leaves(resumed.state.compression)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_error_feedback_moves_to_another_layout_of_as_many_shards(tmp_path, capsys):
    """Saved on data2 x fsdp2 x tensor2, resumed on data=4: four batch shards both times."""
    _run(tmp_path / "whole", MIXED, 8, grad_compression="powersgd")
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "4", resumed_dir / "checkpoints" / "4")
    trainer = loop.train(make_config(resumed_dir, **DATA4, train={"steps": 8, "microbatches": 2,
                                                                    "grad_compression": "powersgd"}),
                         devices=jax.devices()[:4])
    out = capsys.readouterr().out
    assert "resuming from step 4" in out and "error feedback starts fresh" not in out
    # Each device holds its own shard's error feedback.
    assert {shard.data.shape[0] for leaf in jax.tree.leaves(trainer.state.compression.error)
            for shard in leaf.addressable_shards} == {1}
    want, got = losses_by_step(tmp_path / "whole"), losses_by_step(resumed_dir)
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5, atol=0)

    # On two batch shards the saved error feedback does not fit: it starts fresh, and the log says so.
    fewer = tmp_path / "fewer"
    (fewer / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "4", fewer / "checkpoints" / "4")
    loop.train(make_config(fewer, mesh={"data": 2, "fsdp": 1, "tensor": 2}, rules={"preset": "tp"},
                           train={"steps": 5, "grad_compression": "powersgd"}), devices=jax.devices()[:4])
    out = capsys.readouterr().out
    assert "resuming from step 4" in out and "error feedback starts fresh" in out


def test_plans_compress_the_matrices_and_send_vectors_exactly():
    names = {"qkv": ("layers", "qkv", "embed", "heads", "head_dim"), "out": ("layers", "heads", "head_dim", "embed"),
             "norm": ("layers", "embed"), "conv": (None, None, None, None)}
    roles = {"qkv": "weight", "out": "weight", "norm": "norm", "conv": "weight"}
    shapes = {"qkv": (24, 3, 1024, 16, 64), "out": (24, 16, 64, 1024), "norm": (24, 1024), "conv": (3, 3, 64, 64)}
    abstract = {key: jax.ShapeDtypeStruct(shape, np.float32) for key, shape in shapes.items()}
    plans = compression.leaf_plans(abstract, names, roles, compression.Compression("powersgd", ("data",), rank=4))
    assert plans["qkv"].matrix == ((24, 3), 1024, 1024)  # stacked layers and q/k/v; the squarest split
    assert plans["out"].matrix == ((24,), 1024, 1024)
    assert plans["conv"].matrix == ((), 576, 64)
    assert plans["norm"].method == "exact"
    exact, compressed = compression.bytes_sent(plans, compression.Compression("powersgd", ("data",), rank=4))
    assert exact == 4 * sum(int(np.prod(s)) for s in shapes.values())
    assert compressed == 4 * (72 * 2048 * 4 + 24 * 2048 * 4 + 640 * 4 + 24 * 1024)
    int8 = compression.leaf_plans(abstract, names, roles, compression.Compression("int8", ("data",)))
    assert {key: plan.method for key, plan in int8.items()} == {"qkv": "int8", "out": "int8", "norm": "exact",
                                                                 "conv": "int8"}


@pytest.mark.parametrize("overrides, message", [
    (["train.grad_compression=powersgd", "train.grad_reduction=per_microbatch"],
     "train.grad_compression=powersgd compresses each batch shard's own gradients: set train.grad_reduction=per_step"),
    (["train.grad_compression=int8", "train.grad_compression_axes=[tensor]"],
     "train.grad_compression_axes=['tensor']: the gradients are reduced over the data-parallel mesh axes "
     "['data', 'fsdp']; name one or more of those"),
    (["train.grad_compression=topk"], "train.grad_compression"),
])
def test_bad_compression_settings_are_one_line(tmp_path, capsys, overrides, message):
    code = cli.main(["train", "tiny", f"run_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_scale_shows_what_each_compression_sends_between_hosts(capsys):
    """gpt_406m on 2 hosts x 8 GPUs joined at 1.25 GB/s (10 Gb/s Ethernet): the data axis's bytes
    and the predicted step for each option."""
    assert cli.main(["scale", "gpt_406m", "--hosts", "2", "--network-gbs", "1.25"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.strip().split(" ")[0] in compression.METHODS}
    assert set(rows) == set(compression.METHODS)
    (none_sent, none_net, none_ms, none_step) = rows["none"]
    assert none_sent == pytest.approx(1.021, abs=1e-3)  # bfloat16 matmul gradients, float32 others
    assert none_ms == pytest.approx(none_net * 1e3 / 1.25, rel=1e-2)
    assert rows["powersgd"][0] < none_sent / 100 and rows["powersgd"][3] < none_step / 2
    assert none_sent / 3 < rows["int8"][0] < none_sent / 2  # a byte a number against bfloat16's two, mostly


def test_compression_starts_after_the_exact_warm_up(tmp_path):
    """train.grad_compression_start=3: three steps as the exact reduction, then PowerSGD's."""
    runs = {}
    for name, train in (("exact", {}), ("warm", {"grad_compression": "powersgd", "grad_compression_start": 3})):
        trainer = loop.train(make_config(tmp_path / name, **DATA4, train={"steps": 6, **train}),
                             devices=jax.devices()[:4])
        runs[name] = losses_by_step(tmp_path / name)
    np.testing.assert_allclose([runs["warm"][s] for s in (1, 2, 3, 4)], [runs["exact"][s] for s in (1, 2, 3, 4)],
                               rtol=1e-6, atol=0)  # step 4's loss is from the parameters of 3 exact updates
    assert abs(runs["warm"][5] - runs["exact"][5]) > 1e-5  # then compressed
    assert int(trainer.state.compression.reductions) == 6


def test_a_pipeline_compresses_its_stages_gradients_over_the_batch_axes(tmp_path):
    """stage=2 x data2 x fsdp2: each stage's layer gradients cross data and fsdp compressed."""
    runs = {}
    for method in ("none", "powersgd"):
        cfg = make_config(tmp_path / method, mesh={"data": 2, "stage": 2, "fsdp": 2, "tensor": 1},
                          rules={"preset": "fsdp"}, impl={"scan_layers": True}, pipeline={"microbatches": 2},
                          train={"steps": 6, "grad_compression": method})
        loop.train(cfg)
        runs[method] = losses_by_step(tmp_path / method)
    assert runs["powersgd"][6] != runs["none"][6]
    np.testing.assert_allclose(list(runs["powersgd"].values()), list(runs["none"].values()), rtol=0.01)


@pytest.mark.parametrize("model", [{"biases": "all"}, {"name": "llama", "kv_heads": 4, "biases": "qkv"}],
                         ids=["gpt2", "qwen2"])
def test_powersgd_sends_every_bias_and_norm_exactly(model):
    """By their roles, not their shapes: at this width the (qkv, heads, head_dim) biases would be
    smaller as rank-4 factors, and are still sent whole."""
    cfg = make_config("unused", model={**model, "d_model": 1024, "heads": 16, "layers": 2, "vocab": 512})
    abstract = abstract_model(models.get(cfg.model.name).create(cfg), 0)
    chosen = compression.Compression("powersgd", ("data",), rank=4)
    plans = compression.leaf_plans(abstract.params, abstract.names, abstract.roles, chosen)
    leaves = list(zip(jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, compression.LeafPlan)),
                      jax.tree.leaves(abstract.roles)))
    vectors = [plan for plan, role in leaves if role in ("bias", "norm")]
    assert any(len(plan.shape) == 4 for plan in vectors)  # (layers, qkv, heads, head_dim)
    assert all(plan.method == "exact" for plan in vectors)
    assert all(plan.method == "powersgd" for plan, role in leaves if role == "weight")
    _, sent = compression.bytes_sent(plans, chosen)
    factors = sum(4 * math.prod(p.matrix[0]) * (p.matrix[1] + p.matrix[2]) * 4 for p, _ in leaves if p.matrix)
    whole = sum(4 * math.prod(p.shape) for p, _ in leaves if p.method == "exact")
    assert sent == factors + whole and whole >= sum(4 * math.prod(p.shape) for p in vectors)
