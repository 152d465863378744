"""`jaxdist config show`: every key with its value, type and meaning; recipes load by name."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from jaxdist import cli, config
from jaxdist.commands import config_show
from jaxdist.config import Config, model_sections, optimizer_sections
from jaxdist.errors import UserError


def _fields_without_description(model: type[BaseModel], prefix: str = "") -> list[str]:
    missing = []
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            missing += _fields_without_description(field.annotation, f"{prefix}{name}.")
    return missing


def test_every_config_field_has_a_description():
    assert _fields_without_description(Config) == []
    for name, section in model_sections().items():  # `model:` is one of these, by model.name
        assert _fields_without_description(section, f"model[{name}].") == []
    for name, section in optimizer_sections().items():  # and `optim:` one of these, by optim.name
        assert _fields_without_description(section, f"optim[{name}].") == []


def _shown(capsys, *argv: str) -> dict[str, list[str]]:
    assert cli.main(["config", "show", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "value", "type", "meaning"]
    # Aligned columns: every row's value starts where the header's does.
    assert all(line[lines[0].index("value") - 2:lines[0].index("value")] == "  " for line in lines)
    return {line.split()[0]: line.split(None, 3)[1:] for line in lines[1:]}


def test_show_lists_defaults_with_types_and_meanings(capsys):
    rows = _shown(capsys)
    assert rows["train.global_batch"][:2] == ["32", "int"]
    assert "all processes together" in rows["train.global_batch"][2]
    assert rows["mesh.fsdp"][:2] == ["-1", "int"]
    assert "sharded" in rows["mesh.fsdp"][2]
    assert rows["model.impl.loss_chunk"][:2] == ["0", "int"]
    assert "positions at a time" in rows["model.impl.loss_chunk"][2]
    assert rows["model.impl.remat"][1] == "none|mlp|full|dots"


def test_show_applies_the_config_and_overrides(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  global_batch: 64\n")
    assert _shown(capsys, str(path), "mesh.fsdp=4")["train.global_batch"][0] == "64"
    assert _shown(capsys, str(path), "mesh.fsdp=4")["mesh.fsdp"][0] == "4"
    assert _shown(capsys, "model.impl.loss_chunk=64")["model.impl.loss_chunk"][0] == "64"  # overrides without a file


def test_a_recipe_loads_by_name(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert config.load("gpt_406m") == config.load("configs/gpt_406m.yaml")
    assert {"tiny", "gpt_406m", "gpt_1b4"} <= set(config.recipes())


def test_an_unknown_recipe_is_one_line_listing_the_recipes(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "show", "gpt_9t"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "gpt_9t" in err and "gpt_406m" in err and "tiny" in err
    with pytest.raises(UserError, match="gpt_9t"):
        config.load("gpt_9t")


def test_show_names_a_recipe(capsys):
    assert _shown(capsys, "gpt_406m")["model.impl.loss_chunk"][0] == "256"


def test_show_lists_the_configured_models_keys_and_names_the_models(capsys):
    rows = _shown(capsys, "model.name=resnet")
    model_keys = [key for key in rows if key.startswith("model.")]
    assert model_keys == ["model.name", "model.classes", "model.image_shape", "model.depth", "model.width",
                          "model.stem", "model.bn_momentum"]
    assert rows["model.name"][:2] == ["resnet", "gpt|deepseek|gemma|llama|mlp|resnet"]
    assert rows["model.depth"][:2] == ["18", "18|50"]
    assert "model.d_model" in _shown(capsys) and "model.hidden" in _shown(capsys, "digits_mlp")


def _markdown_sections(capsys, *argv: str) -> dict[str, list[list[str]]]:
    """`config show --format markdown`: each `## ` heading with the cells of its table's rows."""
    assert cli.main(["config", "show", *argv, "--format", "markdown"]) == 0
    sections: dict[str, list[list[str]]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("## "):
            rows = sections.setdefault(line[3:], [])
        elif line.startswith("| `"):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return sections


def test_markdown_has_a_table_per_section_and_every_models_keys(capsys):
    sections = _markdown_sections(capsys)
    assert list(sections)[:10] == ["top level", "mesh", "rules", "model (model.name=gpt)",
                                   "model (model.name=deepseek, its defaults)", "model (model.name=gemma, its defaults)",
                                   "model (model.name=llama, its defaults)", "model (model.name=mlp, its defaults)",
                                   "model (model.name=resnet, its defaults)", "data"]
    assert [name for name in sections if name.startswith("optim")] == [
        "optim (optim.name=adamw)", *(f"optim (optim.name={other}, its defaults)"
                                      for other in ("adafactor", "lamb", "lars", "sgd"))]
    assert ["`model.impl.scan_layers`", "`true`", "bool"] in [row[:3] for row in sections["model (model.name=gpt)"]]
    assert sections["top level"][0] == ["`seed`", "`0`", "int", "seed of parameter init, data order and sampling"]
    assert ["`mesh.fsdp`", "`-1`", "int"] == sections["mesh"][2][:3]
    # A | inside a cell is escaped, so the row keeps four cells.
    assert sections["model (model.name=gpt)"][0][:3] == ["`model.name`", "`gpt`", "gpt\\|deepseek\\|gemma\\|llama\\|mlp\\|resnet"]
    assert ["`model.hidden`", "`[256, 256]`", "list[int]"] == sections["model (model.name=mlp, its defaults)"][-1][:3]
    assert [row[0] for row in sections["model (model.name=resnet, its defaults)"]] == [
        "`model.name`", "`model.classes`", "`model.image_shape`", "`model.depth`", "`model.width`", "`model.stem`",
        "`model.bn_momentum`"]
    assert all(len(row) == 4 for rows in sections.values() for row in rows)
    shown = {row[0].strip("`") for name, rows in sections.items() if "its defaults" not in name for row in rows}
    assert shown == {key for key, *_ in config.describe(config.load(None))}


def test_markdown_of_a_config_names_the_command_and_its_model(capsys):
    sections = _markdown_sections(capsys, "digits_resnet_lars", "train.steps=7")
    assert "Generated by `jaxdist config show digits_resnet_lars train.steps=7 --format markdown`." in (
        config_show.markdown(config.load("digits_resnet_lars", ["train.steps=7"]),
                             ["digits_resnet_lars", "train.steps=7"]))
    assert "model (model.name=resnet)" in sections and "model (model.name=gpt, its defaults)" in sections
    assert ["`train.steps`", "`7`", "int"] == sections["train"][0][:3]
