"""Principle 5: everything resumes, anywhere. Stopped, preempted or killed runs continue exactly."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import TINY_GPT, make_config

from jaxdist import cli, loop
from jaxdist.checkpoint import Checkpoints, abstract_state
from jaxdist.data import stream

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
SAVED_LAYOUT = {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}
# Where the layout is not the point.
ONE_DEVICE = {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"}}


def saved_steps(checkpoints: Path) -> list[int]:
    with Checkpoints(checkpoints, create=False) as store:
        return store.steps()


def losses_by_step(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def config(run_dir, **sections):
    return make_config(run_dir, **SAVED_LAYOUT, train={"steps": STEPS}, **sections)


def write_config_file(run_dir: Path, **overrides) -> Path:
    raw = {key: dict(value) for key, value in TINY_GPT.items()} | SAVED_LAYOUT | {"run_dir": str(run_dir)}
    raw["train"] = {**raw["train"], "steps": STEPS}
    for section, values in overrides.items():
        raw[section] = {**raw.get(section, {}), **values}
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclasses.dataclass
class Reference:
    run_dir: Path
    losses: dict[int, float]
    final_state: list[np.ndarray]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    """The uninterrupted 12-step run on data=2 x fsdp=2 x tensor=2, checkpointed at steps 6 and 12."""
    run_dir = tmp_path_factory.mktemp("reference")
    trainer = loop.train(config(run_dir, checkpoint={"every": 6}))
    assert saved_steps(run_dir / "checkpoints") == [6, 12]
    losses = losses_by_step(run_dir)
    assert list(losses) == list(range(1, STEPS + 1)) and losses[12] < losses[1] - 0.5
    return Reference(run_dir, losses, [np.asarray(leaf) for leaf in jax.tree.leaves(trainer.state)])


@pytest.fixture
def at_log_of_step(monkeypatch):
    """Runs `action()` when the loop logs `step` (after that step, before the next one)."""

    def install(step: int, action):
        write = loop.MetricsWriter.write

        def write_then_act(self, logged_step, values):
            write(self, logged_step, values)
            if logged_step == step:
                action()

        monkeypatch.setattr(loop.MetricsWriter, "write", write_then_act)

    return install


def test_error_after_step_6_saves_it_and_resume_is_bitwise(tmp_path, reference, at_log_of_step, monkeypatch, capsys):
    def fail():
        raise OSError("disk full")

    at_log_of_step(6, fail)
    with pytest.raises(OSError, match="disk full"):
        loop.train(config(tmp_path, checkpoint={"every": 4}))
    assert "error after step 6: saved the last good state in" in capsys.readouterr().out
    assert saved_steps(tmp_path / "checkpoints") == [4, 6]

    monkeypatch.undo()
    loop.train(config(tmp_path, checkpoint={"every": 4}))
    assert "resuming from step 6" in capsys.readouterr().out
    # Bitwise: the resumed run is the uninterrupted one, step for step.
    assert losses_by_step(tmp_path) == reference.losses


def test_a_resume_on_a_host_of_other_cores_resolves_its_own_workers_and_reads_the_same_batches(
        tmp_path, reference, at_log_of_step, monkeypatch, capsys):
    """data.workers: auto resolves per host; the count is in the run's config and its checkpoints,
    and a resume that resolves another one reads on exactly where the run stopped."""
    def fail():
        raise OSError("disk full")

    at_log_of_step(6, fail)
    monkeypatch.setattr(stream, "SOURCES_WITH_WORKERS", ("stdlib",))  # as an image folder would be read
    monkeypatch.setattr(stream, "usable_cores", lambda: 4)  # -> 2 worker processes
    with pytest.raises(OSError, match="disk full"):
        loop.train(config(tmp_path, checkpoint={"every": 4}))
    assert "read in 2 worker processes" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["workers"] == 2
    with Checkpoints(tmp_path / "checkpoints", create=False) as store:
        assert store.meta(6)["config"]["data"]["workers"] == 2

    monkeypatch.undo()
    monkeypatch.setattr(stream, "SOURCES_WITH_WORKERS", ("stdlib",))
    monkeypatch.setattr(stream, "usable_cores", lambda: 2)  # -> read in the training process
    loop.train(config(tmp_path, checkpoint={"every": 4}))
    out = capsys.readouterr().out
    assert ("; config changed: data.workers=2->0; data.workers only spreads the reading over processes: the "
            "batches stay the same") in out
    assert "read in the training process" in out
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["workers"] == 0
    assert losses_by_step(tmp_path) == reference.losses


def test_an_error_right_after_a_save_says_that_step_is_saved(tmp_path, monkeypatch, capsys):
    def fail_after_step_4(self, step):
        if step == 4:
            raise OSError("lost the network")

    monkeypatch.setattr(loop.StopSignals, "requested", fail_after_step_4)
    with pytest.raises(OSError, match="lost the network"):
        loop.train(make_config(tmp_path, **ONE_DEVICE, train={"steps": 6}, checkpoint={"every": 4}),
                   devices=jax.devices()[:1])
    saved_in = tmp_path / "checkpoints" / "4"
    assert f"error after step 4, whose checkpoint is saved in {saved_in}" in capsys.readouterr().out
    assert saved_steps(tmp_path / "checkpoints") == [4]


def test_a_run_with_saving_off_makes_no_checkpoint_directory(tmp_path, capsys):
    loop.train(make_config(tmp_path, **ONE_DEVICE, train={"steps": 2}, checkpoint={"every": 0}),
               devices=jax.devices()[:1])
    assert "no checkpoint saved" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists()


def test_sigterm_saves_at_the_step_reached_exits_0_and_resumes(tmp_path, reference, at_log_of_step, monkeypatch, capsys):
    handler_before = signal.getsignal(signal.SIGTERM)

    def sigterm():
        # A real signal to this very process, mid-run; never without the loop's handler in place.
        assert signal.getsignal(signal.SIGTERM) is not handler_before, "the loop installed no SIGTERM handler"
        os.kill(os.getpid(), signal.SIGTERM)

    at_log_of_step(4, sigterm)
    config_file = write_config_file(tmp_path / "run", checkpoint={"every": 3})
    assert cli.main(["train", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert "stopped by SIGTERM after step 4; checkpoint saved in" in out and "to resume from step 4" in out
    assert saved_steps(tmp_path / "run" / "checkpoints") == [3, 4]
    assert signal.getsignal(signal.SIGTERM) is handler_before

    monkeypatch.undo()
    assert cli.main(["train", str(config_file)]) == 0
    assert "resuming from step 4" in capsys.readouterr().out
    assert losses_by_step(tmp_path / "run") == reference.losses


def test_a_sigterm_while_the_last_checkpoint_is_written_keeps_it(tmp_path, monkeypatch, capsys):
    handler_before = signal.getsignal(signal.SIGTERM)
    close = loop.RunCheckpoints.close

    def sigterm_then_close(self, wait=True):
        # A real signal as the last save is being finished; never without the loop's handler in place.
        assert signal.getsignal(signal.SIGTERM) is not handler_before, "no handler while the last save is written"
        os.kill(os.getpid(), signal.SIGTERM)
        close(self, wait)

    monkeypatch.setattr(loop.RunCheckpoints, "close", sigterm_then_close)
    loop.train(make_config(tmp_path, **ONE_DEVICE, train={"steps": 3}, checkpoint={"every": 3}),
               devices=jax.devices()[:1])
    assert saved_steps(tmp_path / "checkpoints") == [3]
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_a_refused_resume_leaves_the_run_config_as_saved(tmp_path, reference, capsys):
    shutil.copytree(reference.run_dir, tmp_path / "run")
    saved_config = (tmp_path / "run" / "config.yaml").read_text()
    config_file = write_config_file(tmp_path / "run", optim={"name": "sgd"})  # another optimizer state
    assert cli.main(["train", str(config_file)]) == 2
    assert "resume with the config it was saved with" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.yaml").read_text() == saved_config


def test_a_file_where_the_checkpoints_go_is_refused_before_compiling(tmp_path, capsys, compiles):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")
    assert cli.main(["train", str(write_config_file(run_dir))]) == 2
    assert capsys.readouterr().err == (f"jaxdist: error: run_dir={run_dir}: {run_dir / 'checkpoints'} is a file, "
                                       f"where the checkpoints go; move it away or use another run_dir\n")
    assert compiles.count == 0


def test_data_epochs_end_the_run_at_the_same_example_after_a_batch_change(tmp_path, capsys):
    tokens = np.random.default_rng(0).integers(0, 256, (64, 33))
    np.savez(tmp_path / "tokens.npz", inputs=tokens[:, :-1], targets=tokens[:, 1:])

    def run(data: dict, train: dict):
        loop.train(make_config(tmp_path / "run", **ONE_DEVICE,
                               data={"source": "arrays", "path": str(tmp_path / "tokens.npz"), "eval_fraction": 0.0,
                                     **data}, train=train, checkpoint={"every": 1}), devices=jax.devices()[:1])

    run({}, {"steps": 2, "global_batch": 16})
    run({"epochs": 1}, {"global_batch": 32})  # the epoch's other 32 examples: one step at the new batch
    assert "resuming from step 2" in capsys.readouterr().out
    assert list(losses_by_step(tmp_path / "run")) == [1, 2, 3]


def _save_in_progress(checkpoints: Path, after: int) -> Path | None:
    """Orbax's temporary directory of a checkpoint being written, for a step after `after`."""
    for path in checkpoints.glob("*.orbax-checkpoint-tmp*"):
        if int(path.name.split(".")[0]) > after:
            return path
    return None


def test_kill_9_during_an_async_save_then_resume(tmp_path, reference, capsys):
    run_dir = tmp_path / "run"
    config_file = write_config_file(run_dir, checkpoint={"every": 1})
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "JAXDIST_CPU_DEVICES": "8",
        # Reuse this session's compiled programs (tests/conftest.py sets the cache).
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or "",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    run = subprocess.Popen([sys.executable, "-m", "jaxdist.cli", "train", str(config_file)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while True:
        assert run.poll() is None, f"the run ended (rc {run.returncode}) before a save could be killed"
        assert time.monotonic() < deadline, "no save in progress seen"
        partial = _save_in_progress(run_dir / "checkpoints", after=2)
        if partial is None:
            time.sleep(0.001)
            continue
        run.send_signal(signal.SIGSTOP)  # freeze it, then make sure the write is still unfinished
        step = int(partial.name.split(".")[0])
        if partial.exists() and not (run_dir / "checkpoints" / str(step)).exists():
            break
        run.send_signal(signal.SIGCONT)
    run.kill()
    run.communicate(timeout=60)

    complete = saved_steps(run_dir / "checkpoints")
    assert step not in complete and complete[-1] == step - 1
    loop.train(config(run_dir, checkpoint={"every": 1}))
    assert not partial.exists()  # the killed write was removed before the first new save
    assert f"resuming from step {step - 1}" in capsys.readouterr().out
    assert losses_by_step(run_dir) == reference.losses  # every step once, bitwise
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == STEPS


@pytest.mark.parametrize(
    "layout, embed_shard",
    [
        ({"mesh": {"data": 1, "fsdp": 8, "tensor": 1}, "rules": {"preset": "fsdp"}}, (256, 8)),
        ({"mesh": {"data": 8, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"}}, (256, 64)),
    ],
    ids=["fsdp8", "data8"],
)
def test_restore_onto_another_layout(tmp_path, reference, layout, embed_shard, capsys):
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(reference.run_dir / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    trainer = loop.train(make_config(tmp_path, **layout, train={"steps": 11}, checkpoint={"every": 0}))
    assert "resuming from step 6" in capsys.readouterr().out
    assert {shard.data.shape for shard in trainer.params["embed"].addressable_shards} == {embed_shard}

    resumed = losses_by_step(tmp_path)
    assert list(resumed) == [7, 8, 9, 10, 11]
    np.testing.assert_allclose(list(resumed.values()), [reference.losses[s] for s in resumed], rtol=1e-5, atol=0)
    assert saved_steps(tmp_path / "checkpoints") == [6]  # checkpoint.every=0 saves nothing

    # The final checkpoint restores onto this layout bit for bit, with its metadata.
    with Checkpoints(reference.run_dir / "checkpoints", create=False) as store:
        restored = store.restore(12, abstract_state(trainer.state))
    leaves = jax.tree.leaves(restored.state)
    assert len(leaves) == len(reference.final_state) > 40
    for leaf, saved, sharding in zip(leaves, reference.final_state, jax.tree.leaves(trainer.state_shardings)):
        np.testing.assert_array_equal(np.asarray(leaf), saved)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    meta = restored.meta
    assert meta["step"] == 12 and meta["data"] == {"example": 12 * 16, "seed": 0}
    assert meta["mesh"] == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "tensor": 2} and meta["process_count"] == 1
    assert meta["config"]["model"]["d_model"] == 64 and meta["versions"]["jax"] == jax.__version__


def test_resume_on_half_the_devices(tmp_path, reference, capsys):
    """A checkpoint saved on 8 devices resumes on 4 (as after losing a host), same global batch."""
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(reference.run_dir / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    half = {"mesh": {"data": 1, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}
    trainer = loop.train(make_config(tmp_path, **half, train={"steps": 11}), devices=jax.devices()[:4])
    assert "resuming from step 6" in capsys.readouterr().out
    assert len(trainer.mesh.devices.flat) == 4

    resumed = losses_by_step(tmp_path)
    assert list(resumed) == [7, 8, 9, 10, 11]
    np.testing.assert_allclose(list(resumed.values()), [reference.losses[s] for s in resumed], rtol=1e-5, atol=0)
