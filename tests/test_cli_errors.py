"""Bad input exits with code 2 and one line naming the key and the fix, before any compile."""

import pytest
import yaml
from conftest import TINY_GPT

from jaxdist import cli


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    raw = {**TINY_GPT, "run_dir": str(tmp_path / "run"), "mesh": {"data": 1, "fsdp": 4, "tensor": 2}}
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "override, must_mention",
    [
        ("train.stepz=5", ["train.stepz", "unknown key", "steps"]),
        ("train.steps=abc", ["train.steps", "'abc'", "integer"]),
        ("model.nrom=rmsnorm", ["model.nrom", "unknown key"]),
        ("model.scan_layers=false", ["model.scan_layers", "unknown key", "impl.scan_layers"]),
        ("mesh.fsdp=3", ["mesh.fsdp=3", "6 devices", "8 are present"]),
        ("train.global_batch=10", ["train.global_batch=10", "4 batch shards (the batch is split over mesh.data x mesh.fsdp)", "multiple of 4"]),
        ("mesh.tensor=8", ["mesh", "mesh.tensor=8"]),
        ("optim.lr=-1", ["optim.lr", "greater than 0"]),
        ("rules.preset=zero3", ["rules.preset", "dp, fsdp, tp, fsdp_tp"]),
        ("model.d_model=66", ["model.d_model=66", "model.heads=4"]),
    ],
)
def test_bad_config_exits_2_with_one_line(config_file, capsys, compiles, override, must_mention):
    code = cli.main(["train", str(config_file), override])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: "), err
    for text in must_mention:
        assert text in err, (text, err)
    assert compiles.count == 0
    assert not (config_file.parent / "run").exists()


def test_heads_not_divisible_by_tensor(config_file, capsys, compiles):
    code = cli.main(["train", str(config_file), "mesh.fsdp=1", "mesh.tensor=8"])
    err = capsys.readouterr().err
    assert code == 2 and "model.heads=4 is not divisible by mesh.tensor=8" in err, err
    assert compiles.count == 0


@pytest.mark.parametrize(
    "argv, must_mention",
    [
        (["train", "/nonexistent.yaml"], "/nonexistent.yaml does not exist"),
        (["trian", "x.yaml"], "invalid choice"),
    ],
)
def test_bad_command_line(argv, must_mention, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = cli.main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and must_mention in err and err.count("\n") == 1, err


def test_bad_yaml(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {steps: [1, 2\n")
    assert cli.main(["train", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_version_names_jaxdist_and_its_libraries(capsys):
    from jaxdist import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("python ") and "jaxdist 0." in line and "jax 0." in line and "orbax-checkpoint" in line
