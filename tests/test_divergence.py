"""A run that diverges without a NaN (a learning rate far too large) is stopped by the loss-spike
guard before a diverged checkpoint replaces a sane one, and can go on from an older checkpoint with
a sane learning rate and clipping added."""

import errno
import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import make_config

from jaxdist import loop
from jaxdist.checkpoint import Checkpoints, DataPosition, run_meta
from jaxdist.errors import NonFiniteError, UserError
from jaxdist.train.spikes import ARMED_AFTER, LossStats
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

ONE_DEVICE = {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "rules": {"preset": "fsdp"}}


def test_the_guard_is_armed_after_enough_steps_and_flags_a_loss_far_above_the_average():
    stats = LossStats.create()
    for _ in range(ARMED_AFTER - 1):
        stats = stats.updated(jnp.float32(2.0), jnp.bool_(True))
    assert not bool(stats.is_spike(jnp.float32(1e9), 5.0))  # not armed yet
    stats = stats.updated(jnp.float32(2.0), jnp.bool_(True))
    assert int(stats.count) == ARMED_AFTER and float(stats.average) == pytest.approx(2.0)
    assert not bool(stats.is_spike(jnp.float32(9.9), 5.0)) and bool(stats.is_spike(jnp.float32(10.1), 5.0))
    assert not bool(stats.is_spike(jnp.float32(1e9), None))  # off
    skipped = stats.updated(jnp.float32(1e9), jnp.bool_(False))  # a dropped step's loss is not averaged
    assert (float(skipped.average), int(skipped.count)) == (float(stats.average), int(stats.count))
    negative = LossStats(average=jnp.float32(-3.0), count=jnp.int32(50))
    assert not bool(negative.is_spike(jnp.float32(1.0), 5.0))  # a loss that can be negative has no scale


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir, **sections):
    return loop.train(make_config(run_dir, **ONE_DEVICE, **sections), devices=jax.devices()[:1])


def saved(run_dir) -> list[int]:
    with Checkpoints(run_dir / "checkpoints", create=False) as store:
        return store.steps()


def test_finite_divergence_is_stopped_and_an_older_checkpoint_goes_on_with_clipping(tmp_path, capsys):
    run_dir = tmp_path / "run"
    no_clip = {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "clip_norm": None}
    train(run_dir, train={"steps": 12}, optim=no_clip, checkpoint={"every": 2, "keep": 2})
    assert saved(run_dir) == [8, 10, 12]  # the 2 newest whose next step was sane, and the last
    sane = {r["step"]: r["loss"] for r in records(run_dir)}

    # A learning rate of 1e6: step 13 starts from sane parameters, its update wrecks them, and
    # step 14's loss is huge but finite.
    capsys.readouterr()
    with pytest.raises(NonFiniteError) as halted:
        train(run_dir, train={"steps": 30}, optim={**no_clip, "lr": 1e6}, checkpoint={"every": 1, "keep": 2})
    message = str(halted.value)
    spike = records(run_dir)[-1]
    assert spike["step"] == 14 and spike["loss_spike"] == 1 and math.isfinite(spike["loss"])
    assert spike["loss"] > 1e3 * sane[12]
    assert re.fullmatch(
        r"step 14: the loss [\d.e+]+ is [\d.e+]+ times its running average [\d.]+ \(more than "
        r"train.loss_spike=5: diverging\); stopped without saving it; the last sane checkpoint, step 12, is intact; "
        rf"the checkpoints of the diverging steps were moved to diverged-13 in {run_dir / 'checkpoints'} \(rename "
        r"one back to resume from it\)", message), message
    # Checkpoint 13, saved after the update that diverged, never rotated out the sane ones.
    assert saved(run_dir) == [10, 12]
    assert (run_dir / "checkpoints" / "diverged-13").is_dir()

    # An older kept checkpoint, a sane learning rate and clipping, which the checkpoint was saved without.
    train(run_dir, train={"steps": 16}, optim={**no_clip, "clip_norm": 1.0},
          checkpoint={"every": 2, "keep": 2, "resume_step": 10})
    out = capsys.readouterr().out
    assert "moved checkpoint 12 to " in out and "resuming from step 10 " in out
    assert "config changed: checkpoint.keep=" not in out and "optim.clip_norm=None->1.0" in out
    resumed = {r["step"]: r["loss"] for r in records(run_dir)}
    assert list(resumed) == list(range(1, 17))
    assert all(resumed[step] == sane[step] for step in range(1, 11))  # history before the resume step kept
    assert all(math.isfinite(resumed[step]) and resumed[step] < 2 * sane[10] for step in range(11, 17))
    assert (run_dir / "checkpoints" / "superseded-12").is_dir()
    # A requeue of the same command goes on from the newest checkpoint, not back to step 10.
    train(run_dir, train={"steps": 18}, optim={**no_clip, "clip_norm": 1.0},
          checkpoint={"every": 2, "keep": 2, "resume_step": 10})
    out = capsys.readouterr().out
    assert "checkpoint.resume_step=10 was taken by an earlier start: going on from its newest checkpoint, step 16" in out
    assert [r["step"] for r in records(run_dir)] == list(range(1, 19))


def test_a_missing_resume_step_names_the_checkpoints_there(tmp_path):
    train(tmp_path / "run", train={"steps": 4}, checkpoint={"every": 2})
    with pytest.raises(UserError, match=r"checkpoint.resume_step=3: there is no checkpoint of step 3 in .* \(complete "
                                        r"checkpoints: 2, 4\); pick one of those"):
        train(tmp_path / "run", train={"steps": 6}, checkpoint={"every": 2, "resume_step": 3})


def test_keep_every_keeps_those_checkpoints_for_good(tmp_path):
    train(tmp_path / "run", train={"steps": 10}, checkpoint={"every": 1, "keep": 2, "keep_every": 4})
    assert saved(tmp_path / "run") == [4, 8, 9, 10]


def test_an_old_checkpoint_that_cannot_be_deleted_is_one_warning_and_the_rest_still_rotate(tmp_path, capsys,
                                                                                          monkeypatch):
    """An old step the file system will not delete (EBUSY on NFS, say) is said once and tried again at
    each save; the steps after it still rotate, and the summary counts what is left behind."""
    run_dir = tmp_path / "run"
    busy = run_dir / "checkpoints" / "2"
    rmtree = shutil.rmtree

    def busy_for_step_2(path, *args, **kwargs):
        if Path(path) == busy:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", busy_for_step_2)
    train(run_dir, train={"steps": 5}, checkpoint={"every": 1, "keep": 1})
    assert saved(run_dir) == [2, 4, 5]  # 1 and 3 deleted; the confirmed newest, the last, and the one that stayed
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"jaxdist: warning: could not delete old checkpoint {busy} (Device or resource busy); "
                                f"it is kept, and deleting it is tried again at the next save"]
    summary = f"last checkpoint: step 5 in {run_dir / 'checkpoints'}; 1 old checkpoint could not be removed (step 2)"
    assert summary in out


def test_a_checkpoint_saved_before_the_loss_statistics_existed_resumes(tmp_path, capsys):
    cfg = make_config(tmp_path / "run", **ONE_DEVICE, train={"steps": 4})
    trainer = Trainer.from_config(cfg, jax.devices()[:1])
    older = trainer.state.replace(loss_stats=None)  # the train state as earlier versions saved it
    with Checkpoints(tmp_path / "run" / "checkpoints") as store:
        store.save(2, older, run_meta(cfg, trainer.mesh, DataPosition(2, 32)))
    resumed = loop.train(cfg, devices=jax.devices()[:1])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming from step 2 "))
    assert line.endswith("; the loss statistics of the loss-spike guard start fresh (the checkpoint has none)")
    assert int(resumed.state.loss_stats.count) == 2  # steps 3 and 4, counted from a fresh start
    assert [r["step"] for r in records(tmp_path / "run")] == [3, 4]
