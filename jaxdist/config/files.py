"""Configs from YAML files, recipes and dotted overrides, checked into a `Config`, with every error
one line naming the key; and every key described (`jaxdist config show`)."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Hashable, Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from jaxdist.config import registry
from jaxdist.config.base import ModelSection, OptimizerSection, shown as _shown
from jaxdist.config.root import DEFAULT_MODEL, DEFAULT_OPTIMIZER, Config
from jaxdist.errors import UserError


def describe(cfg: Config) -> list[tuple[str, str, str, str]]:
    """Every leaf key of `cfg` as (dotted key, value, type, description), in declaration order."""
    return list(_describe_section(cfg, ""))


def _describe_section(section: BaseModel, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from _describe_section(value, f"{prefix}{name}.")
        else:
            shown = value if isinstance(value, str) else json.dumps(value)
            kind = ("|".join(_sections_of(section)) if isinstance(section, (ModelSection, OptimizerSection))
                    and name == "name" else _type_name(field.annotation))
            yield f"{prefix}{name}", shown, kind, field.description or ""


def _type_name(annotation: Any) -> str:
    """A field's type as a user writes its values: `int`, `float | null`, `auto|xla|pallas`."""
    if get_origin(annotation) is Annotated:
        return _type_name(get_args(annotation)[0])
    if get_origin(annotation) is Literal:
        return "|".join(str(choice) for choice in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(annotation))
    if annotation is type(None):
        return "null"
    if get_origin(annotation) is dict:
        return "mapping"
    if get_origin(annotation) is list:
        return f"list[{_type_name(get_args(annotation)[0])}]"
    return getattr(annotation, "__name__", str(annotation))


class DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice (YAML forbids it; PyYAML alone would keep the last)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that raises `DuplicateKey` on a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself rejects it, with its own message
            if key in seen:
                raise DuplicateKey(f"key '{key}' appears twice in one mapping (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def recipes_folder() -> Path:
    """Where the recipes are: the package `jaxdist.configs` (the repository's `configs/`, installed or
    mapped there by an editable install), else, for a source tree on the path that is not installed
    (PYTHONPATH=.), that tree's own `configs/`."""
    try:
        return Path(str(importlib.resources.files("jaxdist.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "configs"


def recipes() -> list[str]:
    """Names of the recipes that ship with jaxdist (`configs/NAME.yaml`)."""
    return sorted(recipe.stem for recipe in recipes_folder().glob("*.yaml"))


def _locate(path: str | Path) -> Path:
    """`path` itself, or the recipe it names when it is a bare name (no suffix, no folder) and no
    file; a `UserError` for a directory that names no recipe."""
    path = Path(path)
    if not (path.is_file() or path.suffix or len(path.parts) != 1):
        recipe = recipes_folder() / f"{path}.yaml"
        if recipe.is_file():
            return recipe
        if not path.is_dir():
            raise UserError(f"config {path} is neither a file nor a recipe; recipes: {', '.join(recipes())}")
    if path.is_dir():
        raise UserError(f"config {path} is a directory; pass the path of a YAML file in it, or a recipe: "
                        f"{', '.join(recipes())}")
    return path


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads a YAML file or a recipe by name (or the defaults, when path is None) and applies
    `key.sub=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = _locate(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist: pass the path of a YAML file, or a recipe: "
                            f"{', '.join(recipes())}")
        try:
            raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except UnicodeDecodeError as err:
            raise UserError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                            f"{err.start}); save it as UTF-8") from None
        except yaml.YAMLError as err:
            raise UserError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return from_dict(raw)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with dotted `key.sub=value` overrides applied, as on the command line."""
    raw = cfg.model_dump(mode="json")
    for override in overrides:
        _apply_override(raw, override)
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> Config:
    """A checked `Config` from nested dicts (a YAML file's content); a one-line `UserError` otherwise."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise UserError(_describe(err, raw)) from None


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise UserError(f"override {override!r} is not of the form key.sub=value (e.g. train.steps=100)")
    try:
        value = yaml.load(text, Loader=UniqueKeyLoader) if text else ""
    except yaml.YAMLError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override {override!r}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(err: ValidationError, raw: Any) -> str:
    """The first validation error as one line: the dotted key, what is wrong, and the fix."""
    first = err.errors()[0]
    loc = first["loc"]
    key = ".".join(str(part) for part in loc)
    kind = first["type"]
    if kind == "model_type" and (section := _section_of(loc, raw)) is not None:
        return _not_a_section(key, first["input"], section)
    if kind == "invalid_key":
        where = f"in {'.'.join(str(part) for part in loc[:-1])}" if loc[:-1] else "at the top level"
        section = _section_of(loc[:-1], raw)
        known = ", ".join(section.model_fields) if section else ""
        return f"config: key {_shown(first['input'])} {where} is not a name (keys are text); known keys here: {known}"
    if kind == "extra_forbidden":
        section = _section_of(loc[:-1], raw)
        known = ", ".join(section.model_fields) if section else ""
        if inner := _inner_section_with(section, str(loc[-1])):
            return (f"config: unknown key '{key}'; it is {'.'.join(map(str, loc[:-1]))}.{inner}.{loc[-1]} (the "
                    f"{inner} section: {section.model_fields[inner].description})")
        if section is not None and loc[:-1] in (("model",), ("optim",)):
            name = section.model_fields["name"].default
            others = ", ".join(other for other in _sections_of(section) if other != name)
            what = "models" if loc[0] == "model" else "optimizers"
            return f"config: unknown key '{key}' for {loc[0]}.name={name}; its keys: {known} (other {what}: {others})"
        return f"config: unknown key '{key}'; known keys here: {known}"
    if kind == "value_error":
        return f"config: {first['msg'].removeprefix('Value error, ')}"
    message = first["msg"]  # a sentence: "Input should be ..."
    return f"config: {key}={_shown(first.get('input'))}: {message[:1].lower()}{message[1:]}"


def _inner_section_with(section: type[BaseModel] | None, key: str) -> str | None:
    """The field of `section` that is itself a section holding `key` (`impl` for a GPT's scan_layers)."""
    for name, field in (section.model_fields.items() if section is not None else ()):
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and key in annotation.model_fields:
            return name
    return None


def _not_a_section(key: str, given: Any, section: type[BaseModel]) -> str:
    """The error line for a section given as something other than a mapping of its keys (an empty
    `train:` in YAML is None)."""
    if section in (ModelSection, OptimizerSection):  # its keys are those of the one its name picks
        *names, last = _sections_of(section)
        keys = f"{key}.name: {', '.join(names)} or {last}, and that one's"
    else:
        keys = ", ".join(section.model_fields)
    if given is None:
        return f"config: {key} is empty; give its keys ({keys}) or leave the section out for its defaults"
    return f"config: {key}={_shown(given)}: {key} is a section: give it a mapping of its keys ({keys})"


def _sections_of(section: BaseModel | type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The registered sections a model or optimizer section is one of, by name."""
    kind = section if isinstance(section, type) else type(section)
    return registry.model_sections() if issubclass(kind, ModelSection) else registry.optimizer_sections()


def _section_of(loc: tuple, raw: Any) -> type[BaseModel] | None:
    """The section class at `loc` of the config `raw` was validated as (the model's and the
    optimizer's by the name `raw` gives them; the base class where that name is not known)."""
    model: type[BaseModel] = Config
    node = raw
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        if part in ("model", "optim") and model is Config:
            base, default = ((ModelSection, DEFAULT_MODEL) if part == "model" else (OptimizerSection, DEFAULT_OPTIMIZER))
            name = node.get("name", default) if isinstance(node, dict) else None
            model = _sections_of(base).get(name, base) if isinstance(name, str) else base
            continue
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error as one line: what it was reading and the problem, each with its line and column."""
    if not isinstance(err, yaml.MarkedYAMLError) or not (err.context or err.problem):
        return _first_line(err)
    parts = [f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
             for text, mark in ((err.context, err.context_mark), (err.problem, err.problem_mark)) if text]
    return " ".join(": ".join(parts).split())
