"""Principle 10 for checkpoints: damaged ones are detected and set aside; other failures are errors."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
import yaml
from conftest import TINY_GPT, make_config
from data_helpers import prepared, random_documents
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from jaxdist import cli, config, loop, models
from jaxdist.checkpoint import (
    Checkpoints,
    DamagedCheckpoint,
    DataPosition,
    RunCheckpoints,
    plan_resume,
    abstract_state,
    array_digests,
    export_params,
    is_damage,
)
from jaxdist.checkpoint import integrity
from jaxdist.checkpoint.integrity import agree, parsing
from jaxdist.data import loader, sources
from jaxdist.errors import UserError
from jaxdist.parallel.feed import BatchRows
from jaxdist.parallel.mesh import make_mesh
from jaxdist.train.state import abstract_model
from jaxdist.train.trainer import Trainer

# Failed reads leave TensorStore callbacks that fire after Orbax's asyncio loop closed ("Event loop
# is closed", raised inside the library and ignored there): not ours to fix.
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def plan(cfg):
    """Where a start with `cfg` resumes from (the checkpoints' metadata only)."""
    return plan_resume(cfg, abstract_model(models.get(cfg.model.name).create(cfg), cfg.seed).params, print).position


def state_on(mesh, scale: float):
    """A 4 MiB array (written in several chunks) and a small one, split over the mesh."""
    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    return {"w": jax.device_put(jnp.arange(2**20, dtype=jnp.float32).reshape(1024, 1024) * scale, split),
            "b": jax.device_put(jnp.ones(8, jnp.bfloat16) * scale, split)}


@pytest.fixture
def mesh(devices):
    return make_mesh(data=1, fsdp=8, tensor=1)


@pytest.fixture
def two_steps(tmp_path, mesh):
    with Checkpoints(tmp_path, keep=5) as store:
        for step in (1, 2):
            store.save(step, state_on(mesh, step), {"step": step})
    return tmp_path


def largest_data_file(step_dir):
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_bytes(path, count: int = 8, span: tuple[int, int] | None = None) -> None:
    """Flips `count` bytes in the middle of the file (of its bytes `span`, if given)."""
    data = bytearray(path.read_bytes())
    start, end = span or (0, len(data))
    for i in range((start + end) // 2, (start + end) // 2 + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_digests_do_not_depend_on_the_layout(devices):
    values = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    layouts = [NamedSharding(make_mesh(data=d, fsdp=8 // d, tensor=1), PartitionSpec(*spec))
               for d, spec in ((1, ("fsdp",)), (2, ("data", "fsdp")), (4, (None, ("data", "fsdp"))), (8, ()))]
    digests = [array_digests({"x": jax.device_put(values, sharding)}) for sharding in layouts]
    assert all(d == digests[0] for d in digests) and digests[0] == array_digests({"x": values})
    changed = values.copy()
    changed.view(np.uint32)[5, 7] ^= 1  # one bit of one element
    assert array_digests({"x": changed}) != digests[0]


def test_flipped_bytes_are_detected_and_the_previous_one_restored(two_steps, mesh, capsys):
    flip_bytes(largest_data_file(two_steps / "2"))
    with Checkpoints(two_steps, create=False) as store:
        with pytest.raises(DamagedCheckpoint, match="w differ from the digests"):
            store.restore(2, abstract_state(state_on(mesh, 0)))
        assert store.steps() == [1, 2]  # restore alone sets nothing aside
    with Checkpoints(two_steps) as store:
        other = make_mesh(data=2, fsdp=4, tensor=1)  # verified in another layout too
        restored = store.restore_latest(abstract_state(state_on(other, 0)))
        assert restored.step == 1 and store.steps() == [1]
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(state_on(mesh, 1)["w"]))
    err = capsys.readouterr().err
    assert f"checkpoint {two_steps / '2'} is unreadable (DamagedCheckpoint: w differ from the digests" in err
    assert (two_steps / "unreadable-2").is_dir()


def test_truncated_file_is_set_aside(two_steps, mesh, capsys):
    data = largest_data_file(two_steps / "2")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with Checkpoints(two_steps) as store:
        assert store.restore_latest(abstract_state(state_on(mesh, 0))).step == 1
        assert store.steps() == [1]
    assert "is unreadable" in capsys.readouterr().err and (two_steps / "unreadable-2").is_dir()


@pytest.mark.parametrize("error", [MemoryError("out of host memory"), RuntimeError("transient")], ids=repr)
def test_other_errors_propagate_and_set_nothing_aside(two_steps, mesh, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", fail)
    with Checkpoints(two_steps) as store:
        with pytest.raises(type(error), match=str(error)):
            store.restore_latest(abstract_state(state_on(mesh, 0)))
        assert store.steps() == [1, 2]
    assert not list(two_steps.glob("unreadable-*"))


def test_damage_is_told_from_other_errors():
    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = ValueError('OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database')
    assert is_damage(wrapped) and is_damage(FileNotFoundError("x")) and is_damage(DamagedCheckpoint("x"))
    assert is_damage(json.JSONDecodeError("bad", "{", 1))
    assert is_damage(UnicodeDecodeError("utf-8", b"\x9a", 0, 1, "invalid start byte"))
    assert not is_damage(MemoryError()) and not is_damage(RuntimeError("transient"))
    assert not is_damage(ValueError("RESOURCE_EXHAUSTED: out of memory")) and not is_damage(PermissionError("x"))
    assert not is_damage(KeyError("step")) and not is_damage(TypeError("x"))  # a bug, unless met in `parsing`


@pytest.mark.parametrize("error", [KeyError("tree_metadata"), TypeError("'int' object is not subscriptable"),
                                   AttributeError("'list' object has no attribute 'get'"), AssertionError(),
                                   IndexError("list index out of range"), ValueError("6 is not a valid KeyType"),
                                   UnicodeDecodeError("utf-8", b"\x9a", 0, 1, "invalid start byte")], ids=repr)
def test_what_parsing_metadata_raises_on_malformed_content_is_damage(error):
    with pytest.raises(DamagedCheckpoint, match="the metadata of x is malformed") as caught:
        with parsing("the metadata of x"):
            raise error
    assert caught.value.__cause__ is error and is_damage(caught.value)


@pytest.mark.parametrize("error", [MemoryError(), PermissionError(13, "Permission denied"), RuntimeError("x"),
                                   ValueError("RESOURCE_EXHAUSTED: out of memory"),
                                   ValueError("PERMISSION_DENIED: Error opening file")], ids=repr)
def test_other_errors_pass_through_parsing_unchanged(error):
    with pytest.raises(type(error)) as caught:
        with parsing("the metadata of x"):
            raise error
    assert caught.value is error and not is_damage(caught.value)


def test_tensorstore_errors_pass_through_parsing_to_be_judged_by_their_code():
    data_loss = ValueError("DATA_LOSS: Error decoding b-tree node")
    with pytest.raises(ValueError, match="DATA_LOSS") as caught:
        with parsing("the metadata of x"):
            raise data_loss
    assert caught.value is data_loss and is_damage(caught.value)


def test_processes_agree_on_a_failed_read():
    """Every process reaches the same verdict; the gather stands in for process_allgather."""
    damaged = ValueError("DATA_LOSS: checksum mismatch")
    agree(None, gather=lambda code: [code, 0])  # all read it: nothing raised
    with pytest.raises(DamagedCheckpoint, match="process 1 found it damaged"):
        agree(None, gather=lambda code: [code, 1])
    with pytest.raises(ValueError, match="DATA_LOSS"):
        agree(damaged, gather=lambda code: [0, code])
    # Damage on one process and another failure on a second: an error everywhere, not a set-aside.
    with pytest.raises(RuntimeError, match="process 2 failed to read it") as caught:
        agree(damaged, gather=lambda code: [0, code, 2])
    assert not is_damage(caught.value)
    with pytest.raises(MemoryError):
        agree(MemoryError(), gather=lambda code: [1, code])


def saved_steps(directory) -> list[int]:
    with Checkpoints(directory, create=False) as store:
        return store.steps()


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_resume_skips_a_corrupt_checkpoint_and_repeats_the_run(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"steps": 8}, checkpoint={"every": 4}, mesh={"data": 2, "fsdp": 4, "tensor": 1})
    loop.train(cfg)
    uninterrupted = losses(tmp_path)
    flip_bytes(largest_data_file(tmp_path / "checkpoints" / "8"))
    loop.train(cfg)
    captured = capsys.readouterr()
    assert f"checkpoint {tmp_path / 'checkpoints' / '8'} is unreadable" in captured.err
    assert "resuming from step 4" in captured.out
    assert losses(tmp_path) == uninterrupted  # steps 5-8 again, bitwise


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (needs root to mount): a disk that can really fill up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> None:
    with open(disk / "filler", "wb", buffering=0) as out:  # unbuffered: nothing left to flush on close
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_disk_full_stops_with_one_line_and_keeps_the_last_checkpoint(small_disk, monkeypatch, capsys):
    run_dir = small_disk / "run"
    config_file = small_disk / "run.yaml"
    raw = {**TINY_GPT, "run_dir": str(run_dir), "train": {**TINY_GPT["train"], "steps": 8}, "checkpoint": {"every": 2}}
    config_file.write_text(yaml.safe_dump(raw))
    save = Checkpoints.save

    def save_then_fill_the_disk(self, step, state, meta):
        save(self, step, state, meta)
        if step == 2:
            self.wait()
            fill(small_disk)

    monkeypatch.setattr(Checkpoints, "save", save_then_fill_the_disk)
    assert cli.main(["train", str(config_file)]) == 2
    # The run stops on whichever write meets the full disk first: the metrics of step 3 or checkpoint 4.
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist:")]
    assert len(err) == 1 and err[0].startswith("jaxdist: error: could not write "), err
    assert "No space left on device" in err[0] and ("metrics.jsonl at step 3" in err[0] or (
        f"checkpoint {run_dir / 'checkpoints' / '4'}" in err[0] and "the newest complete checkpoint is step 2" in err[0]))
    assert saved_steps(run_dir / "checkpoints") == [2]  # the partial step 4 is not listed

    monkeypatch.undo()
    (small_disk / "filler").unlink()
    assert cli.main(["train", str(config_file)]) == 0
    assert "resuming from step 2" in capsys.readouterr().out  # verified against its digests
    # keep=3 of the checkpoints confirmed by a sane next step, and the last one, which no step followed.
    assert saved_steps(run_dir / "checkpoints") == [2, 4, 6, 8]


def test_shard_cut_short_after_a_run_is_one_line_and_the_checkpoint_restores(tmp_path, capsys):
    path, manifest = prepared(tmp_path, random_documents(200, seed=1), eval_fraction=0.1,
                              chunk_tokens=64, records_per_shard=32)
    raw = {**TINY_GPT, "run_dir": str(tmp_path / "run"), "train": {**TINY_GPT["train"], "steps": 4},
           "checkpoint": {"every": 2}, "data": {"source": "arrayrecord", "path": str(path)}}
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(config_file)]) == 0
    shard = path / manifest["splits"]["train"]["files"][1]
    os.truncate(shard, shard.stat().st_size // 3)
    capsys.readouterr()
    assert cli.main(["train", str(config_file), "train.steps=8"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist:")]
    assert len(err) == 1 and f"shard {shard.name}" in err[0] and "prepare the data again" in err[0], err
    assert saved_steps(tmp_path / "run" / "checkpoints") == [2, 4]
    cfg = make_config(tmp_path / "run")
    with Checkpoints(tmp_path / "run" / "checkpoints", create=False) as store:
        store.restore(4, abstract_state(Trainer.from_config(cfg).state))  # verified against its digests


def corrupt_one_record(path, manifest, shard) -> None:
    """Flips one byte halfway through what the writer put before its zero padding (records, then
    their index): the shard still opens with every record counted, and one record fails its hash."""
    data = bytearray(shard.read_bytes())
    data[len(data[: len(data) // 2].rstrip(b"\0")) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    tokens = sources.ArrayRecordTokens(path, manifest, "train")
    chunk, failing = manifest["chunk_tokens"], []
    for index in range(-(-len(tokens) // chunk)):
        try:
            tokens[index * chunk : index * chunk + 1]
        except UserError:
            failing.append(index)
    assert len(failing) == 1, failing


def first_unreadable_batch(cfg) -> int:
    """The index of the first train batch the pipeline cannot read (batch b feeds step b + 1)."""
    batches = loader.train_iterator(cfg, BatchRows(cfg.train.global_batch, tuple(range(cfg.train.global_batch))))
    for index in range(100):
        try:
            next(batches)
        except UserError:
            return index
    raise AssertionError("no batch failed")


def test_corrupt_record_met_mid_run_is_one_line_and_the_checkpoints_restore(tmp_path, capfd):
    path, manifest = prepared(tmp_path, random_documents(12, seed=3), eval_fraction=0.1,
                              chunk_tokens=16, records_per_shard=32)
    shard = path / manifest["splits"]["train"]["files"][1]
    intact = shard.read_bytes()
    corrupt_one_record(path, manifest, shard)
    data = {"source": "arrayrecord", "path": str(path)}
    failing = first_unreadable_batch(make_config(tmp_path / "run", data=data, train={"global_batch": 8}))
    assert failing >= 2  # read mid-run, after a checkpoint
    raw = {**TINY_GPT, "run_dir": str(tmp_path / "run"), "train": {"steps": failing + 2, "global_batch": 8},
           "checkpoint": {"every": 1, "keep": 100}, "data": data}
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    capfd.readouterr()
    assert cli.main(["train", str(config_file)]) == 2
    captured = capfd.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error: ") and f"shard {shard.name} is corrupt" in err[0], err
    # Step `failing` completed before its next batch failed: its state is good and saved, none after.
    assert f"error after step {failing}: saved the last good state" in captured.out
    assert saved_steps(tmp_path / "run" / "checkpoints") == list(range(1, failing + 1))

    shard.write_bytes(intact)
    assert cli.main(["train", str(config_file)]) == 0
    assert f"resuming from step {failing}" in capfd.readouterr().out  # verified against its digests
    assert saved_steps(tmp_path / "run" / "checkpoints")[-1] == failing + 2



# Damage to each file of a checkpoint. What each file of a step directory is (orbax-checkpoint
# 0.12, one process), and whether what a restore returns can depend on it. Orbax merges each
# process's OCDBT database into one at save: `state/manifest.ocdbt` and its B-tree (`state/d/`)
# point into the per-process data files directly, so the per-process manifests and B-tree nodes
# are never read again. `_CHECKPOINT_METADATA` holds Orbax's handler names and timestamps: listing
# reads the commit time only (the directory's time if the file does not decode), and restores use
# jaxdist's own handlers. `commit_success.txt` marks a commit on object stores that cannot rename
# (GCS); on a file system nothing reads it.
MATTERS, HARMLESS = "matters", "harmless"
ROLES = {
    "_CHECKPOINT_METADATA": HARMLESS,
    "commit_success.txt": HARMLESS,
    "meta/metadata": MATTERS,
    "digests/metadata": MATTERS,
    "state/_METADATA": MATTERS,
    "state/manifest.ocdbt": MATTERS,
    "state/d/ B-tree node": MATTERS,
    "state/ocdbt.process_0/d/ array data": MATTERS,
    "state/ocdbt.process_0/manifest.ocdbt": HARMLESS,
    "state/ocdbt.process_0/d/ B-tree node": HARMLESS,
}
# How an OCDBT B-tree node begins; the other files of a `d/` folder hold the arrays' raw bytes
# (the state is written uncompressed).
_NODE = bytes.fromhex("0cdb20de")


def role(step_dir: Path, relative: str) -> str:
    """Which of `ROLES` the file `relative` of checkpoint directory `step_dir` has ("unknown": none)."""
    if relative.endswith("commit_success.txt"):
        return "commit_success.txt"
    folder = relative.rpartition("/")[0]
    if folder.endswith("/d"):
        node = (step_dir / relative).read_bytes()[:4] == _NODE
        relative = f"{folder}/ {'B-tree node' if node else 'array data'}"
    return relative if relative in ROLES else "unknown"


def checkpoint_files(step_dir: Path, file_role: str | None = None) -> list[str]:
    """The files of `step_dir` (those of `file_role` only, if given), relative to it."""
    files = sorted(str(path.relative_to(step_dir)) for path in step_dir.rglob("*") if path.is_file())
    return [relative for relative in files if file_role is None or role(step_dir, relative) == file_role]


def truncate(path: Path, span: tuple[int, int] | None = None) -> None:
    """Cuts the file short in the middle (of its bytes `span`, if given)."""
    start, end = span or (0, path.stat().st_size)
    path.write_bytes(path.read_bytes()[: (start + end) // 2])


def garbage(path: Path, span: tuple[int, int] | None = None) -> None:
    """As many bytes, none of them valid UTF-8 (nor JSON, nor OCDBT, nor zstd), all over the file."""
    path.write_bytes(b"\x9a" * path.stat().st_size)


DAMAGE = {"flip": flip_bytes, "truncate": truncate, "garbage": garbage}


def write_config(run_dir: Path) -> Path:
    """A config file for 3 steps of the tiny GPT in `run_dir`, saving after each."""
    raw = {**TINY_GPT, "run_dir": str(run_dir), "train": {**TINY_GPT["train"], "steps": 3}, "checkpoint": {"every": 1}}
    config_file = run_dir.parent / f"{run_dir.name}.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    return config_file


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run of 3 steps saved after each one, as a run stopped after step 2 leaves it (checkpoints
    1 and 2), and the losses of the uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert cli.main(["train", str(write_config(run_dir))]) == 0
    shutil.rmtree(run_dir / "checkpoints" / "3")
    return run_dir, losses(run_dir)


def array_values(step_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of the arrays' values in each data file of checkpoint `step_dir`, as the
    state's index (the B-tree a restore reads, under state/d/) points to them. A process writes its
    own B-tree nodes into these files at times, after the values; nothing reads those at a restore."""
    state = ts.KvStore.open(f"file://{step_dir / 'state'}/").result()
    ranges: dict[str, list[tuple[int, int]]] = {}

    def walk(node: str) -> None:
        for entry in ts.ocdbt.dump(state, node).result()["entries"]:
            if "location" in entry:  # a child node
                walk(entry["location"])
            elif "indirect_value" in entry:  # value:<folder>:<file>:<offset>:<length>
                where, offset, length = entry["indirect_value"].removeprefix("value:").rsplit(":", 2)
                folder, file = where.split(":", 1)
                ranges.setdefault(f"state/{folder}{file}", []).append((int(offset), int(offset) + int(length)))
            else:
                assert "inline_value" in entry, entry

    walk(ts.ocdbt.dump(state).result()["versions"][-1]["root"]["location"])
    return ranges


def damaged_copy(saved_run, directory: Path, relative: str, damage) -> Path:
    """A copy of the saved run in `directory`, file `relative` of its checkpoint 2 damaged: a data
    file in the largest array value it holds (the middle of the file may be a B-tree node)."""
    run_dir = directory / relative.replace("/", "_")
    shutil.copytree(saved_run[0], run_dir)
    step_dir = run_dir / "checkpoints" / "2"
    values = array_values(step_dir).get(relative)
    if values:
        damage(step_dir / relative, span=max(values, key=lambda value: value[1] - value[0]))
    else:
        damage(step_dir / relative)
    return run_dir


def resume(run_dir: Path) -> tuple[DataPosition, dict]:
    """What `jaxdist train` on `run_dir` restores before its first step, without training: where it
    resumes from and the state (host arrays), through the loop's own plan and restore."""
    cfg = config.load(str(write_config(run_dir)))
    abstract = abstract_model(models.get(cfg.model.name).create(cfg), cfg.seed)
    checkpoints = RunCheckpoints(cfg, plan_resume(cfg, abstract.params, print), print)
    trainer = Trainer.from_config(cfg, abstract=abstract)
    position = checkpoints.resume(trainer)
    checkpoints.close()
    return position, jax.tree.map(np.asarray, trainer.state)


@pytest.fixture(scope="module")
def saved_states(saved_run, tmp_path_factory):
    """The states that resuming the undamaged run restores, from checkpoint 2 and from checkpoint 1."""
    states = {}
    for step in (2, 1):
        run_dir = tmp_path_factory.mktemp("intact") / "run"
        shutil.copytree(saved_run[0], run_dir)
        for newer in range(step + 1, 3):
            shutil.rmtree(run_dir / "checkpoints" / str(newer))
        states[step] = resume(run_dir)
        assert states[step][0].step == step
    return states


def assert_resumed(run_dir: Path, relative: str, file_role: str, saved_states, capsys) -> str:
    """A restart of the run with file `relative` (of `file_role`) of checkpoint 2 damaged: checkpoint 2
    set aside and step 1's position and state restored bit for bit if something reads the file, else
    step 2's. Returns what was printed to stderr."""
    capsys.readouterr()
    position, state = resume(run_dir)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, (relative, err)
    checkpoints = run_dir / "checkpoints"
    if ROLES[file_role] == MATTERS:
        assert position.step == 1, relative
        assert f"checkpoint {checkpoints / '2'} is unreadable" in err, (relative, err)
        assert (checkpoints / "unreadable-2" / relative).is_file() and saved_steps(checkpoints) == [1]
    else:
        assert position.step == 2 and "is unreadable" not in err and "not verified" not in err, (relative, err)
        assert not list(checkpoints.glob("unreadable-*"))
    assert f"resuming from step {position.step} (" in out, (relative, out)
    saved_position, saved_state = saved_states[position.step]
    assert position == saved_position, relative
    jax.tree.map(lambda got, saved: np.testing.assert_array_equal(got, saved, err_msg=relative), state, saved_state)
    return err


def test_every_file_of_a_checkpoint_has_a_known_role(saved_run):
    step_dir = saved_run[0] / "checkpoints" / "2"
    roles = {relative: role(step_dir, relative) for relative in checkpoint_files(step_dir)}
    assert "unknown" not in roles.values(), roles
    assert set(roles.values()) == set(ROLES), roles  # every role has a file to damage


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("file_role", ROLES)
def test_damage_to_any_file_is_set_aside_or_does_not_matter(saved_run, saved_states, tmp_path, capsys,
                                                           file_role, damage):
    """Each file of checkpoint 2 that has `file_role`, damaged in turn, and the run started again:
    no traceback; the checkpoint is set aside and step 1's state restored, or, for the files nothing
    reads, step 2's with every array matching its digest. Either way bit for bit what was saved."""
    step_dir = saved_run[0] / "checkpoints" / "2"
    for relative in checkpoint_files(step_dir, file_role):
        run_dir = damaged_copy(saved_run, tmp_path, relative, DAMAGE[damage])
        assert_resumed(run_dir, relative, file_role, saved_states, capsys)


@pytest.mark.parametrize("relative, damage", [("state/manifest.ocdbt", "garbage"), ("commit_success.txt", "flip")])
def test_a_damaged_checkpoint_and_the_run_goes_on_as_uninterrupted(saved_run, tmp_path, capsys, relative, damage):
    """`jaxdist train` itself, with a file that matters and one that does not damaged: the losses
    after the restart are those of the uninterrupted run, bit for bit."""
    run_dir = damaged_copy(saved_run, tmp_path, relative, DAMAGE[damage])
    capsys.readouterr()
    assert cli.main(["train", str(write_config(run_dir))]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert f"resuming from step {1 if ROLES[relative] == MATTERS else 2} (" in out, out
    assert losses(run_dir) == saved_run[1]


@pytest.mark.parametrize(("relative", "content"), [
    ("meta/metadata", "[]"), ("meta/metadata", '{"step": 2, "data": {"example": "many"}}'),
    ("digests/metadata", "null"), ("state/_METADATA", "{}"), ("state/_METADATA", '{"tree_metadata": [7]}'),
])
def test_metadata_that_decodes_but_is_malformed_is_set_aside(saved_run, saved_states, tmp_path, capsys,
                                                             relative, content):
    """JSON that parses, in place of what was written: what it lacks is damage, not a traceback."""
    run_dir = damaged_copy(saved_run, tmp_path, relative, lambda path: path.write_text(content))
    assert "is malformed" in assert_resumed(run_dir, relative, relative, saved_states, capsys)


@pytest.fixture(scope="module")
def exported_params(saved_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "params.safetensors"
    export_params(saved_run[0], out, step=2)
    return load_file(out)


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("file_role", ROLES)
def test_export_of_a_damaged_checkpoint_refuses_or_writes_the_saved_params(
        saved_run, exported_params, tmp_path, file_role, damage):
    """Export reads the params and the meta: damage it meets is one line naming the older step;
    damage elsewhere (the optimizer state's data) leaves what it writes the saved params."""
    step_dir = saved_run[0] / "checkpoints" / "2"
    for relative in checkpoint_files(step_dir, file_role):
        run_dir = damaged_copy(saved_run, tmp_path, relative, DAMAGE[damage])
        out = tmp_path / "params.safetensors"
        try:
            export_params(run_dir, out, step=2)
        except UserError as err:
            assert ROLES[file_role] == MATTERS, (relative, err)
            assert f"checkpoint {run_dir / 'checkpoints' / '2'} is damaged" in str(err), relative
            assert str(err).endswith("pass --step with an older one: 1")
        else:
            exported = load_file(out)
            assert exported.keys() == exported_params.keys(), relative
            for name, array in exported_params.items():
                np.testing.assert_array_equal(exported[name], array, err_msg=f"{relative}: {name}")
            out.unlink()


def test_processes_agree_on_the_metadata_before_resuming(saved_run, tmp_path, monkeypatch, capsys):
    """Reading a checkpoint's metadata is collective: another process's damage sets the
    checkpoint aside here too, though this process read it well."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    others = iter([integrity.DAMAGED])  # process 1's outcome of its first read (step 2), then OK

    def with_another_process(err):
        integrity.agree(err, gather=lambda code: [code, next(others, integrity.OK)])

    monkeypatch.setattr("jaxdist.checkpoint.restore.agree", with_another_process)
    position = plan(make_config(run_dir))
    assert position.step == 1
    assert "process 1 found it damaged" in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "unreadable-2").is_dir()


def test_saved_digests_are_read_before_the_processes_agree(two_steps, mesh, monkeypatch):
    """A process that cannot read the digests tells the others before any of them computes the
    digests of what it read (a collective computation the others would otherwise wait in)."""
    garbage(two_steps / "2" / "digests" / "metadata")
    outcomes = []

    def recording(err):
        outcomes.append(integrity.outcome(err))
        integrity.agree(err, gather=lambda code: [code])

    monkeypatch.setattr("jaxdist.checkpoint.restore.agree", recording)
    with Checkpoints(two_steps, create=False) as checkpoints:
        with pytest.raises(UnicodeDecodeError) as caught:
            checkpoints.restore(2, abstract_state(state_on(mesh, 0)))
    assert outcomes == [integrity.DAMAGED] and is_damage(caught.value)


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), MemoryError()], ids=repr)
def test_failing_to_read_metadata_for_other_reasons_sets_nothing_aside(saved_run, tmp_path, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    monkeypatch.setattr(ocp.CheckpointManager, "item_metadata", fail)
    with pytest.raises(type(error)):
        plan(make_config(run_dir))
    assert not list((run_dir / "checkpoints").glob("unreadable-*"))
