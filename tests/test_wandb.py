"""`log.wandb=true`: the config and the same values as metrics.jsonl in a W&B run (offline here, under
run_dir/wandb), read back from W&B's own run file; a resumed run continues the same W&B run; without
wandb installed, one line and exit 2."""

import json
import struct
import sys
from pathlib import Path

import pytest
from conftest import make_config

from jaxdist import cli, loop
from jaxdist.errors import UserError
from jaxdist.observe import wandb_log
from jaxdist.observe.metrics import tensorboard_tag

pytestmark = pytest.mark.slow

wandb_internal = pytest.importorskip("wandb.proto.wandb_internal_pb2")  # the `wandb` extra, in the `test` extra

OFFLINE = {"every": 1, "wandb": True, "wandb_mode": "offline", "wandb_project": "jaxdist-test"}


def run_records(path: Path) -> list:
    """The protobuf records of a W&B run file (run-ID.wandb): a 7-byte header (":W&B", magic, version),
    then LevelDB's log format: 32 KiB blocks of chunks (CRC 4 bytes, length 2, type 1, data), type 1
    a whole record, 2/3/4 its first/middle/last piece."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    found, at, pieces = [], 7, b""
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # too little left in a block for a chunk header: padding
            at += 32768 - at % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        pieces += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            found.append(wandb_internal.Record.FromString(pieces))
            pieces = b""
    return found


def logged(run_dir: Path) -> tuple[dict[int, dict], dict, set[str]]:
    """Every offline W&B run in run_dir: history (step -> key -> value), the config, the run ids."""
    history, config, ids = {}, {}, set()
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in run_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
                history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history, config, ids


def test_offline_run_holds_the_config_and_metrics_jsonl_values(tmp_path):
    run_dir = tmp_path / "run"
    loop.train(make_config(run_dir, train={"steps": 3}, log=OFFLINE, checkpoint={"every": 3}))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history, config, ids = logged(run_dir)
    assert sorted(history) == [1, 2, 3] and [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        expected = {tensorboard_tag(k): v for k, v in line.items() if k != "step"}
        assert history[line["step"]] == expected  # every key, equal to the last bit
    assert [history[s]["train/loss"] for s in (1, 2, 3)] == [line["loss"] for line in lines]
    assert "train/startup_compile_s" in history[1] and "train/startup_compile_s" not in history[2]
    assert config["train"]["steps"] == 3 and config["model"]["d_model"] == 64 and config["log"]["wandb"] is True
    assert ids == {(run_dir / "wandb" / "run_id").read_text()}

    # Resumed in the same run_dir: the same W&B run goes on.
    loop.train(make_config(run_dir, train={"steps": 4}, log=OFFLINE, checkpoint={"every": 3}))
    history, _, resumed = logged(run_dir)
    assert resumed == ids and len(list(run_dir.glob("wandb/offline-run-*"))) == 2
    assert history[4]["train/loss"] == json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


def test_without_wandb_installed_one_line_and_exit_2(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    assert cli.main(["train", "tiny", "log.wandb=true", f"run_dir={tmp_path / 'run'}"]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "jaxdist: error: log.wandb=true needs Weights & Biases: pip install 'jaxdist[wandb]', or set log.wandb=false"]
    assert not (tmp_path / "run").exists()  # nothing started


def test_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored W&B login
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = make_config(tmp_path / "run", log={"wandb": True})
    with pytest.raises(UserError) as err:
        wandb_log.WandbRun(cfg, tmp_path / "run")
    assert str(err.value) == ("log.wandb=true: Weights & Biases did not start: No API key configured. Use `wandb login` "
                              "to log in. Or set log.wandb_mode=offline to keep the run in run_dir/wandb only")


class _FailingRun:
    step = 0

    def log(self, values, step):
        raise OSError(28, "No space left on device")

    def finish(self):
        raise RuntimeError("the W&B service is gone")


def test_a_failing_wandb_is_one_warning_and_the_run_goes_on(capsys):
    run = wandb_log.WandbRun.__new__(wandb_log.WandbRun)  # as `__init__` leaves it, with a run that fails
    run._run = _FailingRun()
    run.log(3, {"loss": 1.0})
    run.log(4, {"loss": 0.9})  # not asked again
    run.close()
    assert capsys.readouterr().err.splitlines() == [
        "jaxdist: warning: log.wandb: Weights & Biases failed at step 3 ([Errno 28] No space left on device); it gets "
        "no more of this run's steps, which metrics.jsonl and tb/ hold"]
    run._run = _FailingRun()
    run.close()
    assert capsys.readouterr().err.splitlines() == [
        "jaxdist: warning: log.wandb: Weights & Biases failed to finish the run (the W&B service is gone); "
        "metrics.jsonl and tb/ hold every step"]
