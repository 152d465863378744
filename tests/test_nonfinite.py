"""Principle 10: a non-finite step never updates the state, never reaches a checkpoint, and stops the
run with one line (exit code 3), at once (train.on_nonfinite=halt) or after too many in a row (skip)."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import make_config
from flax import nnx

from jaxdist import cli, models
from jaxdist.config import TrainConfig
from jaxdist.checkpoint import Checkpoints, abstract_state
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import precision
from jaxdist.train.optim import build_optimizer
from jaxdist.train.options import InitOptions, StepLayout, StepOptions
from jaxdist.train.state import abstract_model, init_state
from jaxdist.train.step import make_train_step
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

# Linear warmup from 0 to a learning rate of 1e30: step 1 (rate 0) changes nothing, step 2 (5e29)
# makes the weights huge but finite, and step 3's loss is not finite.
EXPLODES_AT_STEP_3 = {"lr": 1e30, "clip_norm": None, "warmup_steps": 2, "schedule": "linear"}
BAD_STEP = 3


class Linear(nnx.Module):
    """A float32 linear classifier."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.initializers.normal(0.5)(rngs.params(), (16, 4), jnp.float32), out_sharding=("embed", "vocab"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...]


def _loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def _strict_records(run_dir) -> list[dict]:
    def refuse(token):
        raise ValueError(f"metrics.jsonl holds {token}, which is not JSON")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


def _all_finite(tree) -> bool:
    return all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(tree))


def _train_cli(tmp_path, capsys, train=None, **sections):
    """(exit code, stderr, config) of `jaxdist train` on the tiny GPT, exploding at step 3."""
    cfg = make_config(tmp_path / "run", train={"steps": 8, **(train or {})}, optim=EXPLODES_AT_STEP_3, **sections)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    code = cli.main(["train", str(config_file)])
    return code, capsys.readouterr().err, cfg


def _saved(cfg, steps) -> dict[int, object]:
    """The train states checkpointed at `steps`, restored into the config's shardings."""
    target = abstract_state(Trainer.from_config(cfg).state)
    with Checkpoints(f"{cfg.run_dir}/checkpoints", create=False) as store:
        assert store.steps() == steps
        return {step: jax.device_get(store.restore(step, target).state) for step in steps}


def test_verdict_under_each_precision():
    """Which steps are dropped (apply=False) and which are bad (halt or count towards the limit)."""
    nan, inf = float("nan"), float("inf")
    big, minimum = precision.LossScale.create(2.0**15, 10), precision.LossScale.create(1.0, 10)
    cases = [  # (loss, grad_norm, loss scale) -> (apply, bad)
        ((2.0, 1.0, None), (True, False)),
        ((nan, nan, None), (False, True)),
        ((2.0, inf, None), (False, True)),
        ((2.0, 1.0, big), (True, False)),
        ((2.0, inf, big), (False, False)),  # a float16 overflow: the scaler halves the scale
        ((2.0, inf, minimum), (False, True)),  # no scale left to blame
        ((nan, nan, big), (False, True)),  # the loss is computed unscaled
    ]
    for (loss, norm, scale), expected in cases:
        apply, bad = precision.verdict(jnp.float32(loss), jnp.float32(norm), scale)
        assert (bool(apply), bool(bad)) == expected, (loss, norm, scale)


def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged():
    trainer = Trainer(Linear, _loss, optax.adam(1e-2), mesh_lib.make_mesh(data=8, fsdp=1), rules_lib.preset("dp"))
    rng = np.random.default_rng(0)
    clean = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, 4, 16).astype(np.int32)}
    poisoned = {"x": clean["x"].copy(), "y": clean["y"]}
    poisoned["x"][3, 5] = np.nan  # one bad example: the loss and every gradient are NaN

    def snapshot():
        return jax.device_get((trainer.state.params, trainer.state.opt_state))

    metrics = trainer.step(clean)
    assert (int(metrics["nonfinite"]), int(metrics["skipped_steps"])) == (0, 0)
    before = snapshot()

    metrics = trainer.step(poisoned)
    assert math.isnan(float(metrics["loss"]))
    assert (int(metrics["nonfinite"]), int(metrics["skipped_steps"])) == (1, 1)
    jax.tree.map(np.testing.assert_array_equal, snapshot(), before)  # bit for bit: params and Adam moments
    assert (int(trainer.state.step), int(trainer.state.skipped_steps)) == (2, 1)  # its data is consumed

    for _ in range(2):  # training goes on from the kept state
        metrics = trainer.step(clean)
        assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))
        assert (int(metrics["nonfinite"]), int(metrics["skipped_steps"])) == (0, 1)
    assert not np.array_equal(jax.device_get(trainer.state.params)["w"], before[0]["w"])
    assert _all_finite(snapshot())


@pytest.mark.parametrize("every", [1, 2], ids=["bad_step_due_for_a_save", "bad_step_between_saves"])
def test_halt_exits_3_with_one_line_and_keeps_the_last_finite_checkpoint(tmp_path, capsys, every):
    code, err, cfg = _train_cli(tmp_path, capsys, checkpoint={"every": every})
    assert code == 3
    # Checkpoint 2 holds the huge weights that step 3 started from: set aside, never resumed from.
    checkpoints = tmp_path / "run" / "checkpoints"
    kept = "the last sane checkpoint, step 1, is intact" if every == 1 else "there is no sane checkpoint"
    assert re.fullmatch(
        rf"jaxdist: error: step {BAD_STEP}: the loss is (nan|inf); stopped without saving it; {kept}; the "
        rf"checkpoints of the diverging steps were moved to diverged-2 in {checkpoints} \(rename one back to "
        rf"resume from it\)\n", err), err
    records = _strict_records(tmp_path / "run")  # a NaN loss is written as null
    assert [r["step"] for r in records if r["nonfinite"]] == [BAD_STEP]
    assert records[-1]["step"] == BAD_STEP and records[-1]["loss"] is None
    saved = _saved(cfg, [1] if every == 1 else [])  # nothing at or after the bad step
    assert all(_all_finite(state) for state in saved.values())
    assert (checkpoints / "diverged-2" / "state").is_dir()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 as float32, on purpose
def test_an_update_that_overflows_from_finite_gradients_is_never_saved(tmp_path, capsys):
    # A learning rate past float32's range: step 1's loss and gradients are finite, its update is not.
    cfg = make_config(tmp_path / "run", train={"steps": 4}, checkpoint={"every": 1},
                      optim={"lr": 1e39, "clip_norm": None, "warmup_steps": 0, "schedule": "constant"})
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert cli.main(["train", str(config_file)]) == 3
    assert capsys.readouterr().err == (
        "jaxdist: error: step 1: the parameters are not finite, though no step's loss or gradients were "
        "(an update overflowed: is optim.lr too large?); stopped without saving it; there is no sane checkpoint\n")
    with Checkpoints(tmp_path / "run" / "checkpoints") as store:
        assert store.steps() == []
    records = _strict_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1] and math.isfinite(records[0]["grad_norm"])


def test_skip_goes_on_then_halts_after_max_consecutive_skips(tmp_path, capsys):
    code, err, cfg = _train_cli(tmp_path, capsys, checkpoint={"every": 1, "keep": 8},
                                train={"steps": 8, "on_nonfinite": "skip", "max_consecutive_skips": 2})
    last = BAD_STEP + 2  # the third bad step in a row
    assert code == 3
    # The bad steps began at 3: checkpoints 2 (step 3 started from it) to 4 hold the diverging run.
    assert re.fullmatch(
        rf"jaxdist: error: step {last}: the loss is (nan|inf) \(3 bad steps in a row, more than "
        rf"train.max_consecutive_skips=2\); stopped without saving it; the last sane checkpoint, step 1, is "
        rf"intact; the checkpoints of the diverging steps were moved to diverged-2, diverged-3, diverged-4 in "
        rf"{tmp_path / 'run' / 'checkpoints'} \(rename one back to resume from it\)\n", err), err
    records = _strict_records(tmp_path / "run")
    assert [(r["step"], r["nonfinite"], r["skipped_steps"]) for r in records] == [
        (1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 1, 2), (5, 1, 3)]
    _saved(cfg, [1])
    for step in (3, 4):  # the skipped steps saved the state of step 2, counted
        (tmp_path / "run" / "checkpoints" / f"diverged-{step}").rename(tmp_path / "run" / "checkpoints" / str(step))
    (tmp_path / "run" / "checkpoints" / "diverged-2").rename(tmp_path / "run" / "checkpoints" / "2")
    saved = _saved(cfg, [1, 2, 3, 4])
    for step in (3, 4):
        jax.tree.map(np.testing.assert_array_equal, (saved[step].params, saved[step].opt_state),
                     (saved[2].params, saved[2].opt_state))
        assert int(saved[step].skipped_steps) == step - 2


def test_a_resumed_run_counts_the_bad_steps_in_a_row_from_its_checkpoint(tmp_path, capsys):
    # Steps 3 and 4 are bad and skipped; the run ends at step 4, saved with its count of 2.
    code, err, cfg = _train_cli(tmp_path, capsys, checkpoint={"every": 1, "keep": 8},
                                train={"steps": 4, "on_nonfinite": "skip", "max_consecutive_skips": 2})
    assert (code, err) == (0, "")
    with Checkpoints(tmp_path / "run" / "checkpoints", create=False) as store:
        assert [store.meta(step)["bad_steps_in_a_row"] for step in store.steps()] == [0, 0, 1, 2]
    # Resumed, step 5 is the third bad step in a row, not the first.
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_copy(update={
        "train": cfg.train.model_copy(update={"steps": 8})}).model_dump(mode="json")))
    assert cli.main(["train", str(config_file)]) == 3
    captured = capsys.readouterr()
    assert re.fullmatch(
        r"jaxdist: error: step 5: the loss is (nan|inf) \(3 bad steps in a row, more than "
        r"train.max_consecutive_skips=2\); stopped without saving it; the last sane checkpoint, step 1, is intact; "
        r"the checkpoints of the diverging steps were moved to diverged-2, diverged-3, diverged-4 in .*\n",
        captured.err), captured.err
    # The schedule is a function of train.steps: the resume line says that it changed.
    assert ("config changed: train.steps=4->8; optim.schedule=linear now decays over train.steps=8, not 4, so "
            "the learning rate changes where the run resumes") in captured.out


def test_guard_adds_no_copy_of_the_state_and_keeps_donation(tmp_path):
    """The keep-old-state select is fused into the update: the compiled step's argument and output
    bytes are the same, the donated state is still aliased, and temporaries grow by far less than
    the state (measured on CPU: 3.6% of it for this model; a second copy would be 100%)."""
    cfg = make_config(tmp_path, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                      model={"d_model": 128})
    layout = layout_lib.from_config(cfg, jax.devices()[:1])
    entry = models.get("gpt")
    abstract = abstract_model(entry.create(cfg), cfg.seed)
    tx, schedule = build_optimizer(cfg.optim, cfg.train, abstract.names, abstract.roles)
    step_layout = StepLayout(layout.mesh, layout.rules)
    state, shardings, graphdef, _ = init_state(entry.create(cfg), tx, step_layout,
                                               InitOptions(seed=cfg.seed, abstract=abstract))
    tokens = np.zeros((cfg.train.global_batch, cfg.model.seq_len), np.int32)
    batch = feed.assemble({"inputs": tokens, "targets": tokens}, feed.batch_sharding(layout.mesh, layout.rules))
    memory = {}
    for guard in (False, True):
        step = make_train_step(graphdef, entry.loss, tx, step_layout, shardings,
                               StepOptions(schedule=schedule, nonfinite_guard=guard))
        memory[guard] = step.lower(state, None, batch).compile().memory_analysis()
    off, on = memory[False], memory[True]
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert on.argument_size_in_bytes == off.argument_size_in_bytes
    assert on.alias_size_in_bytes == off.alias_size_in_bytes >= state_bytes - 64  # donation works
    assert abs(on.output_size_in_bytes - off.output_size_in_bytes) <= 64  # one more scalar metric
    assert on.temp_size_in_bytes - off.temp_size_in_bytes < 0.1 * state_bytes


def test_an_error_right_after_a_bad_step_halts_for_the_step_and_saves_nothing():
    """A bad step whose flag is not read yet, then another error (a corrupt batch, say): the run
    halts for the bad step, and the save after an error does not run."""
    from jaxdist.errors import NonFiniteError
    from jaxdist.loop import NonFiniteGuard

    guard = NonFiniteGuard(TrainConfig(on_nonfinite="halt"))
    saved = []
    try:
        with guard.halting():
            guard.record(3, {"nonfinite": 1, "loss": float("nan"), "grad_norm": float("nan")})
            raise RuntimeError("corrupt record")
    except RuntimeError:
        saved.append("the save after an error ran")
    assert saved == []
    assert isinstance(guard.halted, NonFiniteError) and str(guard.halted) == "step 3: the loss is nan"
    assert guard.halted.first_bad_step == 3
    # Without a bad step the other error goes on as it was.
    ok = NonFiniteGuard(TrainConfig(on_nonfinite="halt"))
    with pytest.raises(RuntimeError, match="corrupt record"), ok.halting():
        ok.record(3, {"nonfinite": 0, "loss": 1.0, "grad_norm": 1.0})
        raise RuntimeError("corrupt record")
