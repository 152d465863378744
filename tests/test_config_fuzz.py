"""Random invalid configs and overrides exit 2 with one line naming the broken key, before any compile.

The invalid values are derived from the pydantic fields of `jaxdist.config.Config`, so new fields
are fuzzed without touching this file.
"""

import string
import types
import typing

import annotated_types
import pytest
import yaml
from conftest import TINY_GPT
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from jaxdist import cli
from jaxdist.config import MESH_AXES, Config

# The base config: 8 devices as data=1 x fsdp=4 x tensor=2, so 4 batch shards.
MESH = {"data": 1, "fsdp": 4, "tensor": 2}
BATCH_SHARDS = 4


def sections() -> dict[str, type[BaseModel]]:
    """Each section of the default config by its dotted key, the model's and optimizer's as registered
    for their default names (gpt, adamw), nested ones (model.impl) too."""
    found: dict[str, type[BaseModel]] = {}

    def walk(section: BaseModel, prefix: str) -> None:
        for name in type(section).model_fields:
            value = getattr(section, name)
            if isinstance(value, BaseModel):
                found[f"{prefix}{name}"] = type(value)
                walk(value, f"{prefix}{name}.")

    walk(Config(), "")
    return found


def leaf_fields() -> list[tuple[str, typing.Any]]:
    """(dotted key, pydantic FieldInfo) of every scalar field, top level and in each section."""
    found = [(name, field) for name, field in Config.model_fields.items() if name not in sections()]
    for section, model in sections().items():
        found += [(f"{section}.{name}", field) for name, field in model.model_fields.items()
                  if typing.get_origin(field.annotation) is not dict and f"{section}.{name}" not in sections()]
    return found


def _kinds(annotation) -> set:
    """The scalar types (or Literal choices) a field accepts, None dropped."""
    if typing.get_origin(annotation) is typing.Literal:
        return {("literal", typing.get_args(annotation))}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation) if arg is not type(None)))
    return {annotation}


def wrong_values(annotation) -> list[str]:
    """YAML texts of values of the wrong type for a field."""
    kinds = _kinds(annotation)
    if any(isinstance(kind, tuple) for kind in kinds):
        return ["no_such_choice", "[1]"]
    if kinds <= {int}:
        return ["abc", "1.5", "[1]", "{a: 1}", "true", "off"]
    if kinds <= {float}:
        return ["abc", "[1]", "{a: 1}", ".inf", "-.inf", ".nan", "yes"]
    if kinds <= {bool}:
        return ["maybe", "[1]", "2"]
    return ["[1, 2]", "{a: 1}"]  # str


def out_of_range(field) -> list[str]:
    """Values just outside each bound of a field (gt, ge, lt, le): zero and negative sizes among them."""
    values = []
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Gt):
            values += [bound.gt, bound.gt - 1]
        elif isinstance(bound, annotated_types.Ge):
            values += [bound.ge - 1, bound.ge - 5]
        elif isinstance(bound, annotated_types.Lt):
            values += [bound.lt, bound.lt + 1]
        elif isinstance(bound, annotated_types.Le):
            values += [bound.le + 1]
    return [str(value) for value in values]


FIELDS = leaf_fields()
BOUNDED = [(key, value) for key, field in FIELDS for value in out_of_range(field)]
WRONG_TYPES = [(key, value) for key, field in FIELDS for value in wrong_values(field.annotation)]
KNOWN = {"": set(Config.model_fields)} | {name: set(model.model_fields) for name, model in sections().items()}
NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)


@st.composite
def unknown_key(draw) -> tuple[list[str], str]:
    """An unknown key at the top level, in a section, or with more levels below it."""
    section = draw(st.sampled_from(sorted(KNOWN)))
    name = draw(NAMES.filter(lambda n: n not in KNOWN[section]))
    key = f"{section}.{name}" if section else name
    below = draw(st.lists(NAMES, max_size=2))
    return [".".join([key, *below]) + "=1"], key


@st.composite
def bad_mesh(draw) -> tuple[list[str], list[str]]:
    """Mesh sizes that are invalid themselves (0, < -1) or do not cover the 8 devices."""
    sizes = draw(st.fixed_dictionaries({axis: st.sampled_from([-2, -1, 0, 1, 2, 3, 4, 5, 6, 8]) for axis in MESH_AXES}))
    fills = [axis for axis, size in sizes.items() if size == -1]
    fixed = 1
    for size in sizes.values():
        fixed *= size if size > 0 else 1
    valid = all(size > 0 or size == -1 for size in sizes.values()) and len(fills) <= 1 and (
        8 % fixed == 0 if fills else fixed == 8)
    if valid:  # make it invalid: an axis that cannot divide 8
        sizes[draw(st.sampled_from([a for a in MESH_AXES if a not in fills]))] = draw(st.sampled_from([3, 5, 7]))
    changed = [f"mesh.{axis}" for axis, size in sizes.items() if size != 1]
    return [f"mesh.{axis}={size}" for axis, size in sizes.items()], changed or [f"mesh.{axis}" for axis in MESH_AXES]


def case(kind: str):
    """(overrides, dotted keys of which the error line must name one) for one kind of invalid input."""
    if kind == "unknown":
        return unknown_key().map(lambda drawn: (drawn[0], [drawn[1]]))
    if kind in ("bounded", "wrong_type"):
        pairs = BOUNDED if kind == "bounded" else WRONG_TYPES
        return st.sampled_from(pairs).map(lambda pair: ([f"{pair[0]}={pair[1]}"], [pair[0]]))
    if kind == "mesh":
        return bad_mesh()
    return st.integers(1, 200).filter(lambda b: b % BATCH_SHARDS).map(
        lambda batch: ([f"train.global_batch={batch}"], ["train.global_batch"]))


CASES = st.sampled_from(["unknown", "bounded", "wrong_type", "mesh", "batch"]).flatmap(case)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY_GPT, "run_dir": str(path.parent / "run"), "mesh": MESH}))
    return path


def test_the_fields_are_found():
    keys = dict(FIELDS)
    assert {"train.global_batch", "optim.lr", "mesh.fsdp", "run_dir", "model.impl.loss_chunk"} <= set(keys)
    assert ("train.global_batch", "0") in BOUNDED and ("optim.lr", "-1") in BOUNDED
    assert ("optim.clip_norm", ".nan") in WRONG_TYPES and ("train.steps", "true") in WRONG_TYPES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=CASES)
@example(drawn=(["data.mixture=[1, 2]"], ["data.mixture.0"]))  # a list of sections given other items
def test_invalid_input_exits_2_with_one_line_naming_the_key(config_file, capsys, compiles, drawn):
    overrides, keys = drawn
    code = cli.main(["train", str(config_file), *overrides])
    err = capsys.readouterr().err
    assert code == 2, (overrides, err)
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: "), (overrides, err)
    assert any(key in err for key in keys), (overrides, keys, err)
    assert compiles.count == 0
    assert not (config_file.parent / "run").exists()
