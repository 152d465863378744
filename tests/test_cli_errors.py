"""Bad input exits with code 2 and one line naming the key and the fix, before any compile."""

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import SMALL_RESNET, TINY_GPT, make_classifier_config, make_config

from jaxdist import cli, config, loop, runtime

REPO = Path(__file__).resolve().parents[1]


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
        ("model.scan_layers=false", ["model.scan_layers", "unknown key", "model.impl.scan_layers"]),
        ("mesh.fsdp=3", ["mesh.fsdp=3", "6 devices", "8 are present"]),
        ("train.global_batch=10", ["train.global_batch=10", "4 batch shards (the batch is split over mesh.data x mesh.fsdp)", "multiple of 4"]),
        ("mesh.tensor=8", ["mesh", "mesh.tensor=8"]),
        ("optim.lr=-1", ["optim.lr", "greater than 0"]),
        ("rules.preset=zero3", ["rules.preset", "dp, fsdp, tp, fsdp_tp"]),
        ("model.d_model=66", ["model.d_model=66", "model.heads=4"]),
        ("rules.params.embd=tensor", ["rules.params.embd=tensor", "'embd' is not a logical name", "embed, mlp"]),
        ("rules.activations.sequence=tensor", ["rules.activations.sequence=tensor", "batch, seq, length"]),
        ("rules.params.=fsdp", ["rules.params.=fsdp", "'' is not a logical name of a parameter"]),
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


@pytest.mark.parametrize("override, message", [
    ("seed=-1", "config: seed=-1: input should be greater than or equal to 0"),
    ("seed=4294967296", "config: seed=4294967296: input should be less than 4294967296"),
    ("optim.lr=inf", "config: optim.lr='inf': input should be a finite number"),
    ("optim.lr=.nan", "config: optim.lr=nan: input should be a finite number"),
    ("optim.clip_norm=.inf", "config: optim.clip_norm=inf: input should be a finite number"),
    ("sample.temperature=Infinity", "config: sample.temperature='Infinity': input should be a finite number"),
    ("model.mlp_ratio=inf", "config: model.mlp_ratio='inf': input should be a finite number"),
    ("model.mlp_ratio=0.001", "config: model.mlp_ratio=0.001 makes the MLP's hidden width int(model.d_model x "
                              "model.mlp_ratio) = 0; it needs at least 1: model.mlp_ratio >= 1/64"),
])
def test_out_of_range_value_is_one_exact_line(config_file, capsys, compiles, override, message):
    assert cli.main(["train", str(config_file), override]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0


# YAML reads true/false, yes/no and on/off as booleans, which pydantic alone would take as 1 and 0.
_NOT_A_BOOLEAN = "not a boolean (YAML reads true/false, yes/no and on/off as booleans)"


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=true"], f"config: train.steps=true: input should be a valid integer, {_NOT_A_BOOLEAN}"),
    (["mesh.tensor=yes"], f"config: mesh.tensor=true: input should be a valid integer, {_NOT_A_BOOLEAN}"),
    (["checkpoint.every=off"], f"config: checkpoint.every=false: input should be a valid integer, {_NOT_A_BOOLEAN}"),
    (["data.epochs=on"], f"config: data.epochs=true: input should be a valid integer, {_NOT_A_BOOLEAN}"),
    (["optim.lr=true"], f"config: optim.lr=true: input should be a valid number, {_NOT_A_BOOLEAN}"),
    (["optim.clip_norm=no"], f"config: optim.clip_norm=false: input should be a valid number, {_NOT_A_BOOLEAN}"),
    (["model.name=mlp", "model.hidden=[64, true]"],
     f"config: model.hidden=[64, true]: each item should be a valid integer, {_NOT_A_BOOLEAN}"),
])
def test_a_boolean_is_not_a_number(config_file, capsys, compiles, overrides, message):
    assert cli.main(["train", str(config_file), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0


_OBJECT_STORAGE = ("names object storage or another URL ({scheme}), which jaxdist does not read or write yet; use a "
                   "local path, or mount the bucket (gcsfuse, mountpoint-s3) and give the path it is mounted at")


@pytest.mark.parametrize("argv, named, scheme", [
    (["train", "CONFIG", "run_dir=gs://bucket/runs/tiny"], "config: run_dir=gs://bucket/runs/tiny", "gs://"),
    (["train", "CONFIG", "data.source=arrayrecord", "data.path=s3://bucket/corpus"],
     "config: data.path=s3://bucket/corpus", "s3://"),
    (["train", "CONFIG", "data.source=arrayrecord", "data.mixture=[{name: web, path: 'az://c/web', weight: 1}]"],
     "config: data.mixture path=az://c/web", "az://"),
    (["train", "CONFIG", "model.init_from=hf:gs://bucket/Llama-3.2-1B"],
     "model.init_from=hf:gs://bucket/Llama-3.2-1B", "gs://"),
    (["export", "RUN", "gs://bucket/model", "--format", "hf"], "export: OUT=gs://bucket/model", "gs://"),
    (["export", "s3://bucket/run", "model.npz"], "export: RUN_DIR=s3://bucket/run", "s3://"),
    (["data", "prepare", "docs.txt", "--out", "file:///data/shards"], "data prepare: --out=file:///data/shards",
     "file://"),
], ids=["run_dir", "data.path", "mixture", "init_from", "export_out", "export_run_dir", "prepare_out"])
def test_a_path_to_object_storage_is_one_line_before_anything_starts(config_file, tmp_path, monkeypatch, capsys,
                                                                      compiles, argv, named, scheme):
    """Read as local paths they made folders named gs: here, a TensorBoard thread's traceback and an
    Orbax KeyError at the first save."""
    monkeypatch.chdir(tmp_path)
    argv = [str(config_file) if arg == "CONFIG" else str(tmp_path / "run") if arg == "RUN" else arg for arg in argv]
    assert cli.main(argv) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {named} {_OBJECT_STORAGE.format(scheme=scheme)}\n"
    assert compiles.count == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == [config_file.name]  # no gs: folder, no run


@pytest.mark.parametrize("source, message", [
    ("arrayrecord", "data.eval_fraction=0.2 does not apply to data.source=arrayrecord: its eval split was made by "
                    "`jaxdist data prepare` (--eval-fraction); drop data.eval_fraction, or prepare the data again with "
                    "--eval-fraction 0.2"),
    ("digits", "data.eval_fraction=0.2 does not apply to data.source=digits, whose split is fixed (360 images held out "
               "for eval); drop data.eval_fraction"),
])
def test_an_eval_fraction_the_source_would_ignore_is_refused(tmp_path, capsys, compiles, source, message):
    from data_helpers import prepared, random_documents

    if source == "digits":
        cfg = make_classifier_config(tmp_path / "run", {"name": "mlp"})
    else:
        cfg = make_config(tmp_path / "run", data={"source": source, "path": str(prepared(tmp_path, random_documents(4))[0])})
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    assert cli.main(["train", str(path), "data.eval_fraction=0.2"]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0


def test_booleans_and_numbers_still_load():
    cfg = config.load(None, ["model.impl.scan_layers=no", "optim.name=sgd", "optim.nesterov=yes", "data.augment.flip=on",
                             "train.steps=3", "optim.lr=1e-3", "optim.clip_norm=2", "model.mlp_ratio=3"])
    assert (cfg.model.impl.scan_layers, cfg.optim.nesterov, cfg.data.augment.flip) == (False, True, True)
    assert (cfg.train.steps, cfg.optim.lr, cfg.optim.clip_norm, cfg.model.mlp_ratio) == (3, 1e-3, 2.0, 3.0)


def test_seed_takes_the_whole_unsigned_32_bit_range(tmp_path):
    assert config.load(None, ["seed=0"]).seed == 0 and config.load(None, ["seed=4294967295"]).seed == 2**32 - 1


# The parameters' sizes that the model's keys decide, against the mesh axes the rules split them
# over: reported by the key, before the placement would report a parameter (blocks/attn/out).
@pytest.mark.parametrize("overrides, message", [
    (["mesh.fsdp=8", "mesh.tensor=1", "model.d_model=100"],
     "model.d_model=100 is not divisible by mesh.fsdp=8, over which rules.preset=fsdp_tp splits embed, the embedding "
     "dimension of every weight; use a multiple of 8"),
    (["mesh.fsdp=8", "mesh.tensor=1", "rules.preset=fsdp", "model.d_model=100"],
     "model.d_model=100 is not divisible by mesh.fsdp=8, over which rules.preset=fsdp splits embed, the embedding "
     "dimension of every weight; use a multiple of 8"),
    (["model.vocab=257"],
     "model.vocab=257 is not divisible by mesh.tensor=2, over which rules.preset=fsdp_tp splits vocab, the "
     "vocabulary of the token embedding and the output head; use a multiple of 2"),
    (["mesh.fsdp=1", "mesh.tensor=8", "rules.preset=tp", "model.heads=8", "model.vocab=260"],
     "model.vocab=260 is not divisible by mesh.tensor=8, over which rules.preset=tp splits vocab, the vocabulary of "
     "the token embedding and the output head; use a multiple of 8"),
    (["mesh.fsdp=1", "mesh.tensor=8"],
     "model.heads=4 is not divisible by mesh.tensor=8, over which rules.preset=fsdp_tp splits heads, the attention "
     "heads of every attention weight; use a multiple of 8"),
    (["model.mlp_ratio=1.03"],
     "model.mlp_ratio=1.03 makes the MLP's hidden width int(model.d_model x model.mlp_ratio) = 65, which is not "
     "divisible by mesh.tensor=2, over which rules.preset=fsdp_tp splits mlp; pick a model.mlp_ratio that makes it a "
     "multiple of 2"),
    (["rules.params.embed=null", "rules.params.head_dim=fsdp", "model.d_model=120"],
     "model.d_model=120 makes the head dimension model.d_model / model.heads = 30, which is not divisible by "
     "mesh.fsdp=4, over which rules.params.head_dim=fsdp splits head_dim; pick a model.d_model that makes it a "
     "multiple of 4"),
    (["rules.params.length=tensor", "model.seq_len=33"],
     "model.seq_len=33 is not divisible by mesh.tensor=2, over which rules.params.length=tensor splits length, the "
     "positions of the learned position embedding; use a multiple of 2"),
], ids=["d_model_fsdp_tp", "d_model_fsdp", "vocab_fsdp_tp", "vocab_tp", "heads", "mlp_ratio", "head_dim_override",
        "seq_len_override"])
def test_a_model_size_the_rules_cannot_split_is_named_by_its_key(config_file, capsys, compiles, overrides, message):
    assert cli.main(["train", str(config_file), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0
    assert not (config_file.parent / "run").exists()


@pytest.mark.parametrize("model, overrides, message", [
    ({"name": "mlp", "hidden": [100]}, ["mesh.fsdp=8", "rules.preset=fsdp"],
     "model.hidden=[100] makes the width of hidden layer 1 (model.hidden[0]) = 100, which is not divisible by "
     "mesh.fsdp=8, over which rules.preset=fsdp splits embed; pick a model.hidden that makes it a multiple of 8"),
    ({"name": "mlp", "hidden": [256, 100]}, ["mesh.fsdp=1", "mesh.tensor=8", "rules.preset=tp"],
     "model.hidden=[256, 100] makes the width of hidden layer 2 (model.hidden[1]) = 100, which is not divisible by "
     "mesh.tensor=8, over which rules.preset=tp splits mlp; pick a model.hidden that makes it a multiple of 8"),
    ({**SMALL_RESNET, "width": 6}, ["mesh.data=2", "mesh.fsdp=4", "rules.preset=fsdp"],
     "model.width=6 is not divisible by mesh.fsdp=4, over which rules.preset=fsdp splits conv_out, the output channels "
     "of every convolution (each a multiple of model.width); use a multiple of 4"),
    ({**SMALL_RESNET, "width": 4}, ["mesh.fsdp=4", "mesh.tensor=2"],
     "model.width=4 is not divisible by mesh.tensor=2 x mesh.fsdp=4 = 8, over which rules.preset=fsdp_tp splits "
     "conv_out, the output channels of every convolution (each a multiple of model.width); use a multiple of 8"),
], ids=["mlp_hidden_fsdp", "mlp_hidden_tp", "resnet_width_fsdp", "resnet_width_fsdp_tp"])
def test_a_classifier_size_the_rules_cannot_split_is_named_by_its_key(tmp_path, capsys, compiles, model, overrides,
                                                                       message):
    path = tmp_path / "c.yaml"
    path.write_text(make_classifier_config(tmp_path / "run", model).to_yaml())
    assert cli.main(["train", str(path), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0


def test_sizes_the_rules_do_not_split_need_not_divide(tmp_path):
    from jaxdist.parallel import layout

    cfg = config.load(None, ["model.mlp_ratio=1.03", "mesh.fsdp=4", "mesh.tensor=2", "rules.params.mlp=null",
                             f"run_dir={tmp_path}"])
    placed = layout.from_config(cfg)  # the 263-wide MLP is whole on every device
    assert cfg.model.mlp_dim == 263 and placed.rules.params["mlp"] == () and placed.mesh.shape["tensor"] == 2
    # The fsdp preset splits no attention weight over tensor (here only the MLP's): 4 heads on mesh.tensor=8
    # are whole on every device.
    cfg = config.load(None, ["rules.preset=fsdp", "rules.params.mlp=tensor", "mesh.fsdp=1", "mesh.tensor=8",
                             "model.heads=4", f"run_dir={tmp_path}"])
    placed = layout.from_config(cfg)
    assert placed.rules.params["heads"] == () and placed.mesh.shape["tensor"] == 8


# An axis that no rule names splits nothing: its devices would each repeat the others' work. Refused by every
# command that lays the config out, before anything compiles or is written.
_TENSOR_UNUSED = ("uses mesh axis 'tensor', so its 2 devices would each repeat the same work; set mesh.tensor=1, or "
                  "use rules.preset=tp / fsdp_tp, which split weights over tensor")


@pytest.mark.parametrize("command, overrides, message", [
    ("train", ["mesh.data=4", "mesh.fsdp=1", "rules.preset=dp"],
     f"mesh.tensor=2, but no parameter or activation rule of rules.preset=dp {_TENSOR_UNUSED}"),
    ("rules", ["mesh.data=4", "mesh.fsdp=1", "rules.preset=dp"],
     f"mesh.tensor=2, but no parameter or activation rule of rules.preset=dp {_TENSOR_UNUSED}"),
    ("plan", ["rules.preset=fsdp"],
     f"mesh.tensor=2, but no parameter or activation rule of rules.preset=fsdp {_TENSOR_UNUSED}"),
    ("train", ["rules.preset=fsdp", "rules.params.mlp=null", "rules.activations.seq=null"],
     "mesh.tensor=2, but no parameter or activation rule of rules.preset=fsdp, rules.params.mlp=null, "
     f"rules.activations.seq=null {_TENSOR_UNUSED}"),
    ("train", ["mesh.data=2", "mesh.fsdp=2", "rules.preset=tp", "rules.activations.batch=data"],
     "mesh.fsdp=2, but no parameter or activation rule of rules.preset=tp, rules.activations.batch=data uses mesh "
     "axis 'fsdp', so its 2 devices would each repeat the same work; set mesh.fsdp=1, or use rules.preset=fsdp / "
     "fsdp_tp, which split weights over fsdp"),
], ids=["dp_train", "dp_rules", "fsdp_plan", "overrides_named", "fsdp_out_of_the_batch"])
def test_a_mesh_axis_no_rule_uses_is_refused(config_file, capsys, compiles, command, overrides, message):
    assert cli.main([command, str(config_file), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0
    assert not (config_file.parent / "run").exists()


# Activation specs are made only as the step is traced, after the run directory is written: their rules
# are checked before, by `train` and `rules` alike.
_SEQ_ON_FSDP = ("rules: an activation (batch, seq, embed) maps both 'batch' and 'seq' to mesh axis 'fsdp'; a mesh "
                "axis can split only one dimension: change rules.activations.seq or rules.activations.batch")


@pytest.mark.parametrize("command, overrides, message", [
    ("train", ["rules.activations.seq=fsdp"], _SEQ_ON_FSDP),
    ("rules", ["rules.activations.seq=fsdp"], _SEQ_ON_FSDP),
    ("train", ["rules.activations.heads=data", "mesh.data=2", "mesh.fsdp=2"],
     "rules: an activation (batch, length, heads, head_dim) maps both 'batch' and 'heads' to mesh axis 'data'; a "
     "mesh axis can split only one dimension: change rules.activations.heads or rules.activations.batch"),
], ids=["seq_train", "seq_rules", "heads"])
def test_activation_rules_that_clash_are_refused_before_the_run(config_file, capsys, compiles, command, overrides,
                                                                message):
    assert cli.main([command, str(config_file), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0
    assert not (config_file.parent / "run").exists()


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


@pytest.mark.parametrize("argv", [["export", "run", "out.npz", "a=1"], ["build-kernels", "a=1"],
                                  ["plot", "run", "--out", "x.png", "a=1"], ["data", "prepare", "x.txt", "--out", "d", "a=1"]],
                         ids=lambda argv: argv[0])
def test_overrides_for_a_command_that_takes_none(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: a=1 ({argv[0]} takes no key=value overrides)" in one_line_error(capsys)


@pytest.mark.parametrize("command, choices", [("config", "{show}"), ("data", "{prepare}")])
def test_a_missing_subcommand_is_named_by_its_choices(command, choices, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command])
    assert exit_info.value.code == 2
    assert f"the following arguments are required: {choices} (see jaxdist --help)" in one_line_error(capsys)


@pytest.mark.parametrize("command", [["config", "show"], ["train"], ["doctor", "--config"]], ids=lambda c: c[0])
def test_a_directory_as_the_config(tmp_path, capsys, command):
    assert cli.main([*command, str(tmp_path)]) == 2
    assert f"config {tmp_path} is a directory; pass the path of a YAML file in it, or a recipe: " in one_line_error(capsys)


def test_bad_yaml(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {steps: [1, 2\n")
    assert cli.main(["train", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("text, where", [
    ("train:\n\tsteps: 2\n",
     "while scanning for the next token: found character '\\t' that cannot start any token (line 2, column 1)"),
    ("train: {steps: [1, 2\n",
     "while parsing a flow sequence (line 1, column 16): expected ',' or ']', but got '<stream end>' (line 2, column 1)"),
    ("train:\n  steps: 2: 3\n", "mapping values are not allowed here (line 2, column 11)"),
])
def test_bad_yaml_names_the_problem_and_where(tmp_path, capsys, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["train", str(path)]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: config file {path} is not valid YAML: {where}\n"


_TRAIN_KEYS = ("steps, global_batch, microbatches, grad_reduction, fsdp_gather, on_nonfinite, max_consecutive_skips, "
               "loss_spike, offload, grad_compression, grad_compression_rank, grad_compression_start, "
               "grad_compression_axes")
_AXIS_RULE = "use a mesh axis (data, stage, fsdp, expert, tensor), a list of them, or null (replicated)"


@pytest.mark.parametrize("text, overrides, message", [
    ("{}", ["rules.params.embed=5"], f"config: rules.params.embed=5: {_AXIS_RULE}"),
    ("{}", ["rules.activations.batch=[data, 1]"], f"config: rules.activations.batch=['data', 1]: {_AXIS_RULE}"),
    ("rules: {params: {1: fsdp}}", [], "config: key 1 in rules.params is not a logical name (names are text, e.g. embed)"),
    ("train:\n", [], f"config: train is empty; give its keys ({_TRAIN_KEYS}) or leave the section out for its defaults"),
    ("data: {augment: }", [], "config: data.augment is empty; give its keys (crop_padding, flip) or leave the section "
                              "out for its defaults"),
    ("train: 5", [], f"config: train=5: train is a section: give it a mapping of its keys ({_TRAIN_KEYS})"),
    ("model:\n", [], "config: model is empty; give its keys (model.name: gpt, deepseek, gemma, llama, mlp or resnet, and that one's) or "
                     "leave the section out for its defaults"),
    ("optim: 3", [], "config: optim=3: optim is a section: give it a mapping of its keys (optim.name: adafactor, "
                     "adamw, lamb, lars or sgd, and that one's)"),
    ("1: 2", [], "config: key 1 at the top level is not a name (keys are text); known keys here: seed, run_dir, mesh, "
                 "rules, model, data, train, optim, precision, log, eval, checkpoint, pipeline, sample, profile"),
    ("train: {1: 2}", [], f"config: key 1 in train is not a name (keys are text); known keys here: {_TRAIN_KEYS}"),
    ("train: {on: 2}", [], f"config: key true in train is not a name (keys are text); known keys here: {_TRAIN_KEYS}"),
    ("model: {name: mlp, 2.5: 1}", [], "config: key 2.5 in model is not a name (keys are text); known keys here: "
                                       "name, classes, image_shape, hidden"),
])
def test_a_key_is_named_as_the_user_wrote_it(tmp_path, capsys, compiles, text, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert cli.main(["train", str(path), *overrides]) == 2
    assert one_line_error(capsys) == f"jaxdist: error: {message}\n"
    assert compiles.count == 0


def test_version_names_jaxdist_and_its_libraries(capsys):
    from jaxdist import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("python ") and "jaxdist 0." in line and "jax 0." in line and "orbax-checkpoint" in line


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: "), err
    return err


def test_not_utf8_config(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train: {steps: 2}\n# caf\xe9\n".encode("latin-1"))
    assert cli.main(["train", str(path)]) == 2
    assert "is not UTF-8 text (byte 0xe9 at offset 23)" in one_line_error(capsys)


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  steps: 2\n  steps: 3\n", "steps", "lines 2 and 3"),
    ("seed: 1\ntrain: {steps: 2}\nseed: 2\n", "seed", "lines 1 and 3"),
])
def test_duplicate_keys_are_refused(tmp_path, capsys, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    assert cli.main(["train", str(path)]) == 2
    assert f"key '{key}' appears twice in one mapping ({lines})" in one_line_error(capsys)


@pytest.mark.parametrize("in_file", [True, False], ids=["file", "override"])
def test_empty_run_dir(config_file, capsys, compiles, in_file):
    if in_file:
        config_file.write_text(config_file.read_text().replace(f"run_dir: {config_file.parent / 'run'}", 'run_dir: ""'))
    code = cli.main(["train", str(config_file), *([] if in_file else ["run_dir="])])
    assert code == 2 and "run_dir='' is empty" in one_line_error(capsys)
    assert compiles.count == 0


def _unwritable_run_dirs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    return {
        "is_a_file": (a_file, "is a file, not a directory"),
        "under_a_file": (a_file / "run", f"cannot be written: {a_file} is a file, not a directory"),
        "in_proc": (Path("/proc/jaxdist-run"), "cannot be written (No such file or directory"),
        "read_only": (read_only / "run", "cannot be written (Permission denied"),
    }


@pytest.mark.parametrize("case", ["is_a_file", "under_a_file", "in_proc", "read_only"])
def test_unwritable_run_dir(config_file, tmp_path, capsys, compiles, monkeypatch, case):
    run_dir, message = _unwritable_run_dirs(tmp_path)[case]
    if case == "read_only" and os.geteuid() == 0:
        # Root writes into a 0o555 directory: the kernel's answer to anyone else is given here instead.
        mkdir = Path.mkdir

        def refuse_under_read_only(path, *args, **kwargs):
            if run_dir.parent in (path, *path.parents) and path != run_dir.parent:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return mkdir(path, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse_under_read_only)
    assert cli.main(["train", str(config_file), f"run_dir={run_dir}"]) == 2
    err = one_line_error(capsys)
    assert f"run_dir={run_dir} " in err and message in err, err
    assert compiles.count == 0


@pytest.mark.parametrize("argv, message", [
    (["bench", "c.yaml", "--steps", "-1"], "argument --steps: -1 is not a positive integer"),
    (["bench", "c.yaml", "--warmup", "-1"], "argument --warmup: -1 is not a non-negative integer"),
    (["bench", "c.yaml", "--devices", "0"], "argument --devices: 0 is not a positive integer"),
    (["launch", "-n", "0", "--", "train", "c.yaml"], "argument -n/--num: 0 is not a positive integer"),
    (["launch", "-n", "2", "--devices-per-process", "0", "--", "train", "c.yaml"], "argument --devices-per-process"),
    (["launch", "-n", "2", "--timeout", "nan", "--", "train", "c.yaml"], "argument --timeout: nan is not a positive"),
    (["launch", "-n", "2", "--max-restarts", "-1", "--", "train", "c.yaml"], "argument --max-restarts: -1 is not"),
    (["scale", "c.yaml", "--hosts", "-2"], "argument --hosts: -2 is not a positive integer"),
    (["scale", "c.yaml", "--hosts", "2", "--network-gbs", "0"], "argument --network-gbs: 0 is not a positive number"),
    (["data", "prepare", "x.txt", "--out", "d", "--chunk-tokens", "0"], "argument --chunk-tokens: 0 is not"),
    (["data", "prepare", "x.txt", "--out", "d", "--records-per-shard", "-3"], "argument --records-per-shard"),
    (["doctor", "--megabytes", "-1"], "argument --megabytes: -1 is not a positive number"),
    (["export", "run", "out.npz", "--step", "-1"], "argument --step: -1 is not a non-negative integer"),
    (["--num-processes", "0", "train", "c.yaml"], "argument --num-processes: 0 is not a positive integer"),
    (["--init-timeout", "x", "train", "c.yaml"], "argument --init-timeout: 'x' is not a positive integer"),
    (["launch", "-n", "2", "--timeout", "-1e3", "--", "train", "c.yaml"], "argument --timeout: -1e3 is not a positive"),
], ids=lambda value: "_".join(value)[:40] if isinstance(value, list) else None)
def test_bad_numbers_on_the_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in one_line_error(capsys)


def test_a_doctor_buffer_the_host_cannot_hold_is_one_line_before_anything_runs(capsys, compiles):
    assert cli.main(["doctor", "--megabytes", "1e7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "jaxdist: error: doctor --megabytes 1e+07: timing collectives of 1e+07 MB per device needs at least "
        "251,658.2 GB of memory, more than this host has ("), err
    assert "); pass at most --megabytes " in err and compiles.count == 0


@pytest.mark.parametrize("value", ["-5GB", "=-5GB"], ids=["spaced", "joined"])
def test_a_negative_device_memory_is_named(config_file, capsys, compiles, value):
    """A value starting with '-' is the option's value, not an unknown option."""
    argv = ["plan", str(config_file), "--device-memory" + value] if value.startswith("=") else \
        ["plan", str(config_file), "--device-memory", value]
    assert cli.main(argv) == 2
    assert one_line_error(capsys) == "jaxdist: error: --device-memory '-5GB': give a positive size such as 80GB or 16GiB\n"
    assert compiles.count == 0


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_more_devices_than_there_are(config_file, capsys, compiles, command):
    assert cli.main([command, str(config_file), "--devices", "16"]) == 2
    assert f"{command} --devices 16: only 8 devices here; pass at most 8" in one_line_error(capsys)
    assert compiles.count == 0


def test_npz_without_the_model_arrays(config_file, tmp_path, capsys, compiles):
    np.savez(tmp_path / "rows.npz", tokens=np.zeros((64, 32), np.int32))
    code = cli.main(["train", str(config_file), "data.source=arrays", f"data.path={tmp_path / 'rows.npz'}"])
    assert code == 2
    err = one_line_error(capsys)
    assert f"data.path={tmp_path / 'rows.npz'} lacks the array(s) inputs, targets" in err and "holds tokens" in err
    assert compiles.count == 0


def test_export_to_an_unwritable_path(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "sub" / "params.npz"
    assert cli.main(["export", str(tmp_path / "run"), str(out)]) == 2
    assert f"OUT={out} cannot be written: {tmp_path / 'a_file'} is a file" in one_line_error(capsys)


def test_a_dropped_ctrl_c_during_start_up_stops_before_the_ready_line(tmp_path, monkeypatch, capsys):
    # The KeyboardInterrupt of a Ctrl-C that lands in a garbage-collector callback (JAX registers
    # one, and compiling runs it often) is dropped by Python; the run remembers it and stops before
    # it says it is ready.
    monkeypatch.setattr(runtime, "interrupted", lambda: True)
    with pytest.raises(KeyboardInterrupt):
        loop.train(make_config(tmp_path, train={"steps": 3}), devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "mesh " in out and "ready to train" not in out and "step " not in out


def test_ctrl_c_before_the_step_compiled_exits_130(config_file, tmp_path):
    """SIGINT while the step compiles (after the mesh line, before the loop's own handler): exit 130, one line."""
    # Nothing cached and XLA's full optimisation (not the suite's quick flags, with which the compile
    # took 0.4 s): the signal lands in the compile, not after the step is ready.
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), JAXDIST_CPU_DEVICES="8", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.Popen([sys.executable, "-m", "jaxdist.cli", "train", str(config_file)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in run.stdout:
            if line.startswith("mesh "):
                run.send_signal(signal.SIGINT)
                break
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130, err[-3000:]
    assert err == "jaxdist: interrupted\n"
    assert "ready to train" not in out


# A train whose start-up (the step's compile, say) takes minutes: the signal lands before the loop's
# own handlers are in place.
_SLOW_START = """
import sys, time
from jaxdist import cli
from jaxdist.commands import train

def starting(args):
    print("compiling", flush=True)
    time.sleep(120)

train.run = starting
sys.exit(cli.main(["train", sys.argv[1]]))
"""


def test_sigterm_before_the_steps_is_the_one_line_of_an_interrupt_and_exit_143(config_file):
    """A scheduler's SIGTERM while the step compiles stops the command as a Ctrl-C does: the same one
    line, and exit code 143 (128 + SIGTERM), as a shell reports a program that SIGTERM stopped."""
    run = subprocess.Popen([sys.executable, "-c", _SLOW_START, str(config_file)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        assert run.stdout.readline() == "compiling\n"
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert (run.returncode, err) == (cli.TERMINATED_EXIT, "jaxdist: interrupted\n")
    assert cli.TERMINATED_EXIT == 128 + signal.SIGTERM


_DROPPED_INTERRUPT = """
import gc, os, signal
from jaxdist import runtime
from jaxdist.train.preemption import StopSignals

runtime.remember_interrupts()
gc.callbacks.append(lambda phase, info: phase == "start" and os.kill(os.getpid(), signal.SIGINT))
gc.collect()  # the KeyboardInterrupt is raised inside the callback, where Python drops it
gc.callbacks.clear()
print("went on", runtime.interrupted())
try:
    with StopSignals():
        print("stepped")
except KeyboardInterrupt:
    print("stopped before the steps")
"""


def test_a_ctrl_c_that_python_drops_still_stops_the_run_before_its_steps():
    """A KeyboardInterrupt raised inside a garbage-collector callback (JAX registers one) is dropped
    by Python; the interrupt is remembered, the loop refuses to start its steps, nothing is printed."""
    run = subprocess.run([sys.executable, "-c", _DROPPED_INTERRUPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (run.returncode, run.stdout, run.stderr) == (0, "went on True\nstopped before the steps\n", "")


_HALF_BUILT = """
import sys
from jaxdist import cli
from jaxdist.commands import train

class HalfBuilt:  # like a library object whose constructor the interrupt cut short
    def __del__(self):
        self.thread.is_alive()

def interrupted(args):
    cli.KEPT = HalfBuilt()  # finalized as the interpreter exits
    raise KeyboardInterrupt

train.run = interrupted
sys.exit(cli.main(["train", sys.argv[1]]))
"""


_THREAD_LOGS_AT_EXIT = """
import logging, sys, threading
from jaxdist import cli
from jaxdist.commands import train

def log_when_the_process_ends():  # like Orbax's future-signaling thread finding its executor shut down
    threading.main_thread().join()
    logging.getLogger("absl").error("_SignalingThread.run() raised an exception: cannot schedule new futures")

def interrupted(args):
    threading.Thread(target=log_when_the_process_ends).start()
    raise KeyboardInterrupt

train.run = interrupted
sys.exit(cli.main(["train", sys.argv[1]]))
"""


_THREAD_RAISES_AT_EXIT = _THREAD_LOGS_AT_EXIT.replace(
    'logging.getLogger("absl").error(', "raise RuntimeError(")


@pytest.mark.parametrize("program", [_HALF_BUILT, _THREAD_LOGS_AT_EXIT, _THREAD_RAISES_AT_EXIT],
                         ids=["finalizer", "thread_log", "thread_raise"])
def test_ctrl_c_leaves_one_line_when_a_half_built_object_fails_at_exit(config_file, program):
    """What the interrupt cut short may fail as the process exits, in a finalizer or in a library's
    background thread that logs its error: the promise is still the one line."""
    run = subprocess.run([sys.executable, "-c", program, str(config_file)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "JAXDIST_CPU_DEVICES": "8"}, cwd=REPO, timeout=120)
    assert (run.returncode, run.stderr) == (130, "jaxdist: interrupted\n")


_CTRL_C_WHILE_IMPORTING = """
import sys

class CtrlC:  # a Ctrl-C that lands while grain, which `data prepare` needs, is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "grain":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from jaxdist import cli
sys.exit(cli.main(["data", "prepare", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_ctrl_c_while_the_command_line_imports_exits_130(tmp_path):
    """Beyond what `import jaxdist` loads, the command imports what it needs inside main(), so an
    interrupt during those imports is the same one line as one before training."""
    (tmp_path / "a.txt").write_text("some text")
    run = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_IMPORTING, str(tmp_path / "a.txt"), str(tmp_path / "out")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         timeout=120)
    assert (run.returncode, run.stderr) == (130, "jaxdist: interrupted\n")
    assert not (tmp_path / "out").exists()


# A sitecustomize module: before the program runs, it turns the first import of JAX into a Ctrl-C.
_CTRL_C_AT_JAX = """
import sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
"""

# What the `jaxdist` console script runs.
_CONSOLE_SCRIPT = """
import sys
from jaxdist.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("start", [["-c", _CONSOLE_SCRIPT], ["-m", "jaxdist.cli"]], ids=["console_script", "module"])
def test_ctrl_c_while_the_command_starts_exits_130(tmp_path, start):
    """`import jaxdist` and the command line's module import no JAX, so a Ctrl-C however early in a
    command's start lands inside main(): the one line, no traceback."""
    (tmp_path / "sitecustomize.py").write_text(_CTRL_C_AT_JAX)
    run = subprocess.run([sys.executable, *start, "rules", "tiny"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}, timeout=120)
    assert (run.returncode, run.stderr) == (130, "jaxdist: interrupted\n")


@pytest.mark.parametrize("argv", [["config", "show"], ["--version"]], ids=["config_show", "version"])
def test_a_closed_stdout_ends_the_command_quietly(argv):
    """`jaxdist config show | head`: the reader leaves before the command is done. Here it is gone
    before the first write (a pipe whose read end is closed), so every write finds it gone: the
    command stops with exit 141 (128 + SIGPIPE) and nothing on stderr, not a BrokenPipeError
    traceback nor the interpreter's complaint about the final flush."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        run = subprocess.run([sys.executable, "-m", "jaxdist.cli", *argv], stdout=write_end, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=120)
    finally:
        os.close(write_end)
    assert (run.returncode, run.stderr) == (cli.STDOUT_CLOSED_EXIT, "")


def test_the_next_command_in_a_process_forgets_an_earlier_interrupt():
    """A program that runs several commands (a notebook, a sweep) starts each one uninterrupted, and the
    hook that drops garbage-collector interrupts wraps Python's once, not once per command."""
    runtime.remember_interrupts()
    with pytest.raises(KeyboardInterrupt):
        runtime._interrupt(signal.SIGINT, None)  # what Ctrl-C runs
    assert runtime.interrupted()
    hook = sys.unraisablehook
    runtime.remember_interrupts()
    assert not runtime.interrupted() and sys.unraisablehook is hook
