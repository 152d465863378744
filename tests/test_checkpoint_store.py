"""Checkpoint integrity, model mismatches, export, stop signals: no training needed."""

import json
import os
import shutil
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import TINY_GPT, disk_full_past, logged_steps, make_config
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from jaxdist import cli, models
from jaxdist.checkpoint import (
    CheckpointMismatch,
    Checkpoints,
    DamagedCheckpoint,
    DataPosition,
    plan_resume,
    abstract_state,
    run_meta,
)
from jaxdist.observe.metrics import drop_after
from jaxdist.parallel.mesh import make_mesh
from jaxdist.train.preemption import StopSignals
from jaxdist.train.state import abstract_model
from jaxdist.train.trainer import Trainer


def plan(cfg):
    """Where a start with `cfg` resumes from (the checkpoints' metadata only)."""
    return plan_resume(cfg, abstract_model(models.get(cfg.model.name).create(cfg), cfg.seed).params, print).position


def sharded_tree(mesh, scale: float):
    """A small train-state-like pytree, split over all 8 devices."""
    split = NamedSharding(mesh, PartitionSpec("fsdp"))
    return {
        "step": jax.device_put(jnp.array(int(scale), jnp.int32), NamedSharding(mesh, PartitionSpec())),
        "params": {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4) * scale, split),
                   "b": jax.device_put(jnp.ones(8) * scale, split)},
    }


@pytest.fixture
def mesh(devices):
    return make_mesh(data=1, fsdp=8, tensor=1)


# The deliberately failed read leaves a TensorStore callback that fires after Orbax's asyncio loop
# closed ("Event loop is closed", raised inside the library and ignored there): not ours to fix.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_latest_falls_back_with_a_warning(tmp_path, mesh, capsys):
    store = Checkpoints(tmp_path, keep=5)
    for step in (1, 2):
        store.save(step, sharded_tree(mesh, step), {"step": step})
    store.close()
    for chunk in (tmp_path / "2" / "state" / "d").iterdir():  # the array data of step 2 is lost
        chunk.unlink()

    store = Checkpoints(tmp_path, keep=5)
    restored = store.restore_latest(abstract_state(sharded_tree(mesh, 0)))
    assert restored.step == 1 and restored.meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.arange(32.0).reshape(8, 4))
    assert restored.state["params"]["w"].sharding.spec == PartitionSpec("fsdp")
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / '2'} is unreadable" in err and "falling back to the one before" in err
    assert store.steps() == [1] and (tmp_path / "unreadable-2").is_dir()
    store.save(2, sharded_tree(mesh, 7), {"step": 2})  # the step can be written again
    store.close()
    with Checkpoints(tmp_path) as store:
        assert store.restore(2, abstract_state(sharded_tree(mesh, 0))).meta == {"step": 2}
    for chunk in (tmp_path / "2" / "state" / "d").iterdir():  # and be lost again
        chunk.unlink()
    with Checkpoints(tmp_path) as store:
        assert store.restore_latest(abstract_state(sharded_tree(mesh, 0))).step == 1
    assert sorted(path.name for path in tmp_path.glob("unreadable-*")) == ["unreadable-2", "unreadable-2-2"]


def test_a_step_directory_of_stray_files_is_set_aside(tmp_path, mesh):
    with Checkpoints(tmp_path) as store:
        store.save(1, sharded_tree(mesh, 1), {"step": 1})
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "notes.txt").write_text("not a checkpoint")
    with Checkpoints(tmp_path) as store:
        assert store.steps() == [1, 5]
        with pytest.raises(DamagedCheckpoint, match="has no readable metadata of its state"):
            store.saved_shapes(5)
        assert store.restore_latest(abstract_state(sharded_tree(mesh, 0))).step == 1
    assert (tmp_path / "unreadable-5" / "notes.txt").is_file()


def test_reads_wait_for_the_write_in_progress(tmp_path, mesh):
    with Checkpoints(tmp_path) as store:
        store.save(1, sharded_tree(mesh, 1), {"step": 1})
        restored = store.restore_latest(abstract_state(sharded_tree(mesh, 0)))  # right after the async save
        assert restored.step == 1 and restored.meta == {"step": 1}
        assert not list(tmp_path.glob("unreadable-*"))
        store.save(2, sharded_tree(mesh, 2), {"step": 2})
        assert store.steps() == [1, 2] and store.meta(2) == {"step": 2}
        np.testing.assert_array_equal(store.read_parts(2, ("params",))[0]["params"]["b"], np.full(8, 2.0))


def test_partial_write_is_never_listed(tmp_path, mesh):
    store = Checkpoints(tmp_path)
    store.save(1, sharded_tree(mesh, 1), {"step": 1})
    store.close()
    # What a write killed mid-way leaves: Orbax's temporary directory, here holding step 1's files.
    partial = tmp_path / "2.orbax-checkpoint-tmp-1764100000"
    (tmp_path / "1").rename(partial)
    with Checkpoints(tmp_path, create=False) as store:
        assert store.steps() == []
    assert partial.exists()  # only looked at
    store = Checkpoints(tmp_path)
    assert store.steps() == []
    store.save(3, sharded_tree(mesh, 3), {"step": 3})
    store.close()
    assert not partial.exists()  # opened for writing: removed before the first save
    with Checkpoints(tmp_path, create=False) as store:
        assert store.steps() == [3]


def test_rotation_goes_past_a_step_it_must_not_delete_and_says_why(tmp_path, mesh):
    """A step that is a link (its checkpoint moved elsewhere by hand) is not jaxdist's to delete; the
    steps after it are rotated all the same, and the link is tried again at the next rotation."""
    store = Checkpoints(tmp_path / "checkpoints", keep=None)
    for step in (1, 2, 3, 4):
        store.save(step, sharded_tree(mesh, step), {"step": step})
    store.wait()
    moved = tmp_path / "moved-1"
    (tmp_path / "checkpoints" / "1").rename(moved)
    (tmp_path / "checkpoints" / "1").symlink_to(moved, target_is_directory=True)
    store.prune(keep=1)
    store.close()
    with Checkpoints(tmp_path / "checkpoints", create=False) as reopened:
        assert reopened.steps() == [1, 4]
    assert (moved / "meta").is_dir()  # what the link points to is untouched
    assert store.undeletable == {1: "a symbolic link, which jaxdist does not delete through; remove it yourself"}


def test_other_structure_is_a_mismatch_not_damage(tmp_path, mesh):
    store = Checkpoints(tmp_path)
    store.save(1, sharded_tree(mesh, 1), {"step": 1})
    store.wait()
    target = sharded_tree(mesh, 0)
    target["params"]["w2"] = target["params"]["w"]
    with pytest.raises(CheckpointMismatch, match=r"params\.w2 \(8, 4\) is in this model but not in the checkpoint"):
        store.restore_latest(abstract_state(target))
    assert store.steps() == [1]  # not set aside: the checkpoint is fine, the model is not
    store.close()


def test_restore_casts_to_the_target_dtype(tmp_path, mesh):
    store = Checkpoints(tmp_path)
    store.save(1, sharded_tree(mesh, 1.5), {"step": 1})
    store.wait()
    target = abstract_state(sharded_tree(mesh, 0))
    target["params"]["w"] = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=target["params"]["w"].sharding)
    w = store.restore(1, target).state["params"]["w"]
    store.close()
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(jnp.arange(32.0).reshape(8, 4) * 1.5, jnp.bfloat16))


def test_typed_prng_keys_restore_typed_onto_another_layout(tmp_path, mesh):
    """A state may carry typed keys (`jax.random.key`, any implementation): they come back as keys
    of the same implementation and value, split the way the target says."""
    state = sharded_tree(mesh, 1)
    state["rng"] = jax.random.key(7, impl="rbg")
    state["per_device"] = jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(mesh, PartitionSpec("fsdp")))
    store = Checkpoints(tmp_path)
    store.save(1, state, {"step": 1})
    store.wait()
    other = make_mesh(data=2, fsdp=4, tensor=1)
    target = abstract_state(sharded_tree(other, 0))
    target["rng"] = jax.ShapeDtypeStruct((), state["rng"].dtype, sharding=NamedSharding(other, PartitionSpec()))
    target["per_device"] = jax.ShapeDtypeStruct((8,), state["per_device"].dtype,
                                                sharding=NamedSharding(other, PartitionSpec(("data", "fsdp"))))
    restored = store.restore(1, target).state
    store.close()
    for name in ("rng", "per_device"):
        assert restored[name].dtype == state[name].dtype  # key<rbg>, key<fry>
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored[name])),
                                      np.asarray(jax.random.key_data(state[name])))
        assert restored[name].sharding == target[name].sharding
    assert float(jax.random.uniform(restored["rng"])) == float(jax.random.uniform(state["rng"]))


def test_typed_key_of_another_shape_is_a_mismatch(tmp_path, mesh):
    state = {"rngs": jax.random.split(jax.random.key(0), 4)}
    store = Checkpoints(tmp_path)
    store.save(1, state, {"step": 1})
    store.wait()
    with pytest.raises(CheckpointMismatch, match=r"rngs has shape \(4, 2\) in the checkpoint but \(2, 2\) in this model"):
        store.restore(1, abstract_state({"rngs": jax.random.split(jax.random.key(0), 2)}))
    store.close()


def saved_run(run_dir, **sections):
    """`run_dir` with checkpoints holding the tiny GPT's initial state (`sections` changed), as steps
    3 and 5; returns its params by dotted name."""
    cfg = make_config(run_dir, mesh={"data": 2, "fsdp": 2, "tensor": 2}, **sections)
    trainer = Trainer.from_config(cfg)
    store = Checkpoints(run_dir / "checkpoints")
    for step in (3, 5):
        store.save(step, trainer.state, run_meta(cfg, trainer.mesh, DataPosition(step, step * 16)))
    store.close()
    return {k: np.asarray(v) for k, v in _flat(trainer.params).items()}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny GPT's initial state saved as checkpoints 3 and 5, made once: tests get copies."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    return run_dir, saved_run(run_dir)


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_run):
    """A run_dir whose checkpoints hold the tiny GPT's initial state, as steps 3 and 5 (its own copy,
    which the test may damage)."""
    source, params = tiny_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    raw = {**TINY_GPT, "run_dir": str(run_dir), "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(raw))
    return run_dir, params


def _flat(tree) -> dict:
    return {".".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_other_model_is_one_line_exit_2_before_compiling(tiny_checkpoint, tmp_path, capsys, compiles):
    code = cli.main(["train", str(tmp_path / "tiny.yaml"), "model.d_model=32"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "params.blocks.attn.out has shape (2, 4, 16, 64) in the checkpoint but (2, 4, 8, 32) in this model" in err
    assert "model.d_model=64->32" in err
    assert compiles.count == 0


def test_prepare_skips_unreadable_metadata(tiny_checkpoint, capsys):
    run_dir, _ = tiny_checkpoint
    (run_dir / "checkpoints" / "5" / "meta" / "metadata").write_text("{not json")
    cfg = make_config(run_dir, mesh={"data": 2, "fsdp": 2, "tensor": 2})
    assert plan(cfg) == DataPosition(step=3, example=48)
    assert "checkpoint" in capsys.readouterr().err and (run_dir / "checkpoints" / "unreadable-5").is_dir()


def test_a_meta_whose_config_sections_are_not_objects_is_damage_not_a_traceback(tiny_checkpoint, capsys):
    run_dir, _ = tiny_checkpoint
    meta_file = run_dir / "checkpoints" / "5" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["data"] = "abc"  # what a resume reads of it: data.workers
    meta_file.write_text(json.dumps(meta))
    assert plan(make_config(run_dir, mesh={"data": 2, "fsdp": 2, "tensor": 2})) == DataPosition(step=3, example=48)
    assert "its meta is malformed (config.data: " in capsys.readouterr().err


def test_set_aside_checkpoints_are_counted_with_the_space_they_hold(tiny_checkpoint, capsys):
    """Nothing deletes a set-aside checkpoint: a run that sets one aside, or starts with some
    present, says in one line how many there are and how much space they hold."""
    run_dir, _ = tiny_checkpoint
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "5" / "meta" / "metadata").write_text("{not json")
    cfg = make_config(run_dir, mesh={"data": 2, "fsdp": 2, "tensor": 2})

    def summary(count: str, size: int) -> str:
        return (f"jaxdist: warning: {checkpoints} holds {count} (unreadable-*), {size / 1e6:,.1f} MB; delete them "
                f"when you no longer need them")

    def size_of(folder) -> int:
        return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())

    plan(cfg)
    first = size_of(checkpoints / "unreadable-5")
    assert first > 10_000  # the whole checkpoint, arrays and all
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "is unreadable" in lines[0]
    assert lines[1] == summary("1 set-aside checkpoint", first)

    (checkpoints / "unreadable-9").mkdir()
    (checkpoints / "unreadable-9" / "data").write_bytes(bytes(2_500_000))
    plan(cfg)  # nothing more to set aside: the run starts with two present
    assert capsys.readouterr().err.splitlines() == [summary("2 set-aside checkpoints", first + 2_500_000)]


@pytest.mark.parametrize("suffix", ["safetensors", "npz"])
def test_export_writes_the_params(tiny_checkpoint, tmp_path, capsys, suffix):
    run_dir, params = tiny_checkpoint
    out = tmp_path / f"model.{suffix}"
    assert cli.main(["export", str(run_dir), str(out), "--step", "3"]) == 0
    assert f"params at step 3) to {out}" in capsys.readouterr().out
    exported = load_file(out) if suffix == "safetensors" else dict(np.load(out))
    assert sorted(exported) == sorted(params) and len(params) > 10
    for name, value in params.items():
        np.testing.assert_array_equal(exported[name], value)


@pytest.mark.parametrize("suffix", ["safetensors", "npz"])
def test_an_export_over_an_older_one_that_fills_the_disk_leaves_the_older_one(tiny_checkpoint, tmp_path, capsys,
                                                                               monkeypatch, suffix):
    run_dir, _ = tiny_checkpoint
    out = tmp_path / f"model.{suffix}"
    assert cli.main(["export", str(run_dir), str(out), "--step", "3"]) == 0
    older = out.read_bytes()
    capsys.readouterr()
    with disk_full_past(4096):  # the disk fills as the new file is written
        code = cli.main(["export", str(run_dir), str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"jaxdist: error: could not write {out} (File too large); the file there is left as "
                                 f"it was; free space there or fix the folder, then run again\n")
    assert out.read_bytes() == older
    assert sorted(path.name for path in tmp_path.glob(f"*model.{suffix}*")) == [out.name]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: export: "), err
    return err


def test_export_to_a_folder_nobody_can_write_fails_before_reading(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_checkpoint
    monkeypatch.setattr(Checkpoints, "read_parts", None)  # reading would fail the test
    assert cli.main(["export", str(run_dir), "/proc/params.npz"]) == 2
    assert "OUT=/proc/params.npz cannot be written (No such file or directory" in one_line_error(capsys)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see the first test's note
@pytest.mark.parametrize("damage", ["bytes_flipped", "meta_missing"])
def test_export_of_a_damaged_checkpoint_names_the_older_ones(tiny_checkpoint, tmp_path, capsys, damage):
    run_dir, _ = tiny_checkpoint
    newest = run_dir / "checkpoints" / "5"
    if damage == "bytes_flipped":
        # Every array's bytes, wherever Orbax put the params: the data files, not their small indexes.
        for path in (newest / "state").rglob("d/*"):
            if path.stat().st_size > 4096:
                data = bytearray(path.read_bytes())
                for i in range(0, len(data), 512):
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))
    else:
        (newest / "meta" / "metadata").unlink()
    out = tmp_path / "params.safetensors"
    assert cli.main(["export", str(run_dir), str(out)]) == 2
    err = one_line_error(capsys)
    assert f"checkpoint {newest} is damaged (" in err and err.endswith("; pass --step with an older one: 3\n"), err
    assert not out.exists()
    assert cli.main(["export", str(run_dir), str(out), "--step", "3"]) == 0


@pytest.mark.parametrize("command", ["export", "sample"])
@pytest.mark.parametrize("key, value, problem", [
    ("layers", 1, "the model its meta describes does not fit its saved arrays: blocks.attn.out has shape (2, 4, 16, "
                  "64) in the checkpoint but (1, 4, 16, 64) in this model"),
    ("layers", "abc", "the config in its meta is not valid (config: model.layers='abc': input should be a valid "
                      "integer"),
], ids=["layers-1-of-2", "layers-string"])
def test_checkpoint_meta_that_is_not_the_saved_model_is_one_line(tiny_checkpoint, tmp_path, capsys, command, key,
                                                                 value, problem):
    """Export and sample build the model from the checkpoint's meta: a meta edited to another model
    (or to no config at all) is one line, never a traceback nor a model cut to the meta's shapes."""
    run_dir, _ = tiny_checkpoint
    newest = run_dir / "checkpoints" / "5"
    meta = json.loads((newest / "meta" / "metadata").read_text())
    meta["config"]["model"][key] = value
    (newest / "meta" / "metadata").write_text(json.dumps(meta))
    out = tmp_path / "hf"
    argv = {"export": ["export", str(run_dir), str(out), "--format", "hf"],
            "sample": ["sample", str(run_dir), "--prompt", "def ", "--tokens", "2"]}[command]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jaxdist: error: checkpoint {newest}: {problem}"), err
    assert err.endswith("; the meta was edited or is damaged\n"), err
    assert not out.exists()


def test_bfloat16_params_export_to_safetensors_not_npz(tmp_path, capsys):
    run_dir = tmp_path / "run"
    params = saved_run(run_dir, precision={"params": "bfloat16"})
    assert cli.main(["export", str(run_dir), str(tmp_path / "p.npz")]) == 2
    err = one_line_error(capsys)
    assert ".npz cannot hold bfloat16 arrays (" in err and "export to .safetensors" in err
    assert not (tmp_path / "p.npz").exists()
    assert cli.main(["export", str(run_dir), str(tmp_path / "p.safetensors")]) == 0
    exported = load_file(tmp_path / "p.safetensors")
    assert {name: value.dtype.name for name, value in exported.items()} == {
        name: "bfloat16" for name in params}
    for name, value in params.items():
        np.testing.assert_array_equal(exported[name], value)


def test_export_without_checkpoints_is_a_user_error(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), str(tmp_path / "x.safetensors")]) == 2
    assert "holds no checkpoints" in capsys.readouterr().err


def test_stop_signals_records_the_first_and_restores_handlers():
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert stop.requested(1) is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested(1) == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is before  # a second Ctrl-C acts as usual
    assert signal.getsignal(signal.SIGINT) is before


def test_metrics_after_the_resume_step_are_dropped(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # cut by a kill
    drop_after(tmp_path, 2)
    assert logged_steps(tmp_path) == [1, 2]
