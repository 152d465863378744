"""The docs users copy from name only what exists: every `section.key` and `section.key=value` in
README.md, docs/*.md, benchmarks/README.md, the recipes' comments and the SLURM and Kubernetes
templates is a key of the config (jaxdist/config/) that takes that value; every `jaxdist ...` command
line parses with the current command line (and loads its config, where it names a recipe); every
`jaxdist.NAME` and Python import resolves. benchmarks/reports/, the log of the past, is the one place
removed options may still be named. docs/config.md is generated from the config classes, and is what
the command generates now.

The pages read as pages: every relative link reaches its file and heading, no line outside a table
is over 300 characters, benchmarks/README.md is one page of latest results, and the performance
figures README.md quotes are that page's."""

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from jaxdist import cli, config
from jaxdist.config import Config, model_sections, optimizer_sections
from jaxdist.errors import UserError
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import pipeline as pipeline_lib
from jaxdist.parallel import rules as rules_lib

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
BENCHMARKS = ROOT / "benchmarks" / "README.md"
REPORTS = sorted((ROOT / "benchmarks" / "reports").glob("*.md"))  # the past: links and lines checked, not keys
PAGES = [*MARKDOWN, *REPORTS]
RECIPES = sorted(config.recipes_folder().glob("*.yaml"))
LAUNCH_TEMPLATES = sorted((ROOT / "scripts").glob("*/*"))  # SLURM and Kubernetes: their commands' overrides

# Options that were removed: only the reports of benchmarks/reports/ may name them.
REMOVED = ("model.overlap_grad_reduce", "precision.grad_reduce", "model.scan_unroll")

SECTIONS = [name for name in Config.model_fields if isinstance(getattr(Config(), name), BaseModel)]
MENTION = re.compile(r"(?<![\w/.$-])(?P<key>(?:%s)(?:\.[A-Za-z_]\w*)+)(?P<call>\()?(?:=(?P<value>[^\s`\"'|;)]+))?"
                     % "|".join(SECTIONS))
# A dotted name that starts like a config section but is Python: the modules such names refer to.
MODULES = {"rules": rules_lib, "pipeline": pipeline_lib, "mesh": mesh_lib}
# Values that stand for any value: N, M, k, NAME.
PLACEHOLDER = re.compile(r"^(?:[A-Za-z]|[A-Z][A-Z_]+)$")


def _doc_text(path: Path) -> str:
    """A markdown file or a launch template, or the comments of a recipe (its YAML is the config itself)."""
    text = path.read_text()
    if path.parent == config.recipes_folder():
        return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    return text


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _inline_spans(text: str) -> list[str]:
    """The `inline code` of a markdown text, whitespace made single spaces."""
    return [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)]


def _field_types(key: str) -> list[Any]:
    """The types a config key's values may have, with their constraints (one per registered model or
    optimizer section that has a `model.` or `optim.` key); KeyError if no such key."""
    sections: list[Any] = [Config]
    *parents, leaf = key.split(".")
    for part in parents:
        found: list[Any] = []
        for section in sections:
            if section is Config and part in ("model", "optim"):
                found += (model_sections() if part == "model" else optimizer_sections()).values()
                continue
            field = section.model_fields.get(part)
            annotation = field.annotation if field else None
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                found.append(annotation)
            elif get_origin(annotation) is dict:  # rules.params.NAME, rules.activations.NAME
                if part == "activations" and not PLACEHOLDER.match(leaf) and not any(
                        leaf in preset.activations for preset in rules_lib.PRESETS.values()):
                    raise KeyError(key)
                return [get_args(annotation)[1]]
        if not found:
            raise KeyError(key)
        sections = found
    fields = [section.model_fields[leaf] for section in sections if leaf in section.model_fields]
    if not fields:
        raise KeyError(key)
    return [Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation for field in fields]


def _value_error(key: str, text: str) -> str | None:
    """Why `key=text` is not a value of the key, or None."""
    for value in re.split(r",|->", text) if not text.startswith("[") else [text]:  # a sweep, or a change shown
        if PLACEHOLDER.match(value):
            continue
        parsed = yaml.safe_load(value)
        if key == "rules.preset" and parsed not in rules_lib.PRESETS:
            return f"{parsed!r} is not a preset ({', '.join(rules_lib.PRESETS)})"
        kinds, errors = _field_types(key), []
        for kind in kinds:
            try:
                TypeAdapter(kind).validate_python(parsed)
            except ValidationError as err:
                errors.append(err.errors()[0]["msg"])
        if len(errors) == len(kinds):
            return errors[0]
    return None


def _mentions(path: Path) -> list[tuple[str, str | None]]:
    """(key, value) of every config key mentioned: `key=value`, `key: value` as a whole inline span, or
    `key` alone."""
    text = _doc_text(path)
    found = []
    for match in MENTION.finditer(text):
        key, value = match["key"], match["value"]
        if match["call"] or key.endswith(".md"):
            continue  # a Python call, checked with the names below; a page (data.md)
        if value and value.count("]") > value.count("["):
            value = value[:value.rindex("]")]  # the end of an optional part of a synopsis
        value = value.rstrip(",:") if value else value  # the punctuation of the sentence around it
        found.append((key, value))
    for span in _inline_spans(text):
        if match := re.fullmatch(r"((?:%s)\.[\w.]+): (.+)" % "|".join(SECTIONS), span):
            found.append((match[1], match[2]))
    return found


@pytest.mark.parametrize("path", MARKDOWN + RECIPES + LAUNCH_TEMPLATES, ids=_name)
def test_every_config_key_in_the_docs_exists_and_takes_the_value_shown(path):
    wrong = []
    for key, value in _mentions(path):
        section, attribute = key.split(".", 1)
        try:
            _field_types(key)
        except KeyError:
            if not (section in MODULES and _resolves(f"{MODULES[section].__name__}.{attribute}")):
                wrong.append(f"{key}: no such config key")
            continue
        if value is not None and (why := _value_error(key, value)):
            wrong.append(f"{key}={value}: {why}")
    assert wrong == []


def test_the_docs_check_finds_what_they_name():
    """The check above reads the docs: the mentions it must see are seen, and wrong ones would fail."""
    assert ("mesh.fsdp", "8") in _mentions(ROOT / "scripts" / "k8s" / "jaxdist-job.yaml")
    assert ("train.fsdp_gather", "per_step") in set(_mentions(ROOT / "README.md"))
    assert {("log.wandb", "true"), ("model.impl.loss_chunk", None)} <= set(_mentions(ROOT / "docs" / "running.md"))
    assert ("rules.activations.seq", "tensor") in set(_mentions(ROOT / "docs" / "performance.md"))  # a whole span
    assert _value_error("train.fsdp_gather", "per_block") and _value_error("rules.preset", "zero3")
    assert _value_error("model.impl.remat", "all") and _value_error("mesh.data", "two")
    assert _value_error("model.classes", "auto") is None and _value_error("rules.activations.seq", "tensor") is None
    for key in (*REMOVED, "model.loss_impl", "rules.activations.sequence"):
        with pytest.raises(KeyError):
            _field_types(key)
    assert _value_error("model.name", "resnet") is None and _value_error("model.name", "vit")
    assert ("train.loss_spike", "5") in set(_mentions(ROOT / "docs" / "checkpoints.md"))  # before a colon
    assert ("model.name", "mlp") in set(_mentions(ROOT / "docs" / "config.md"))  # before a comma


def test_removed_options_are_named_only_in_the_history():
    named = {(_name(path), key) for path in [*MARKDOWN, *RECIPES, *(ROOT / "scripts").rglob("*.*")]
             for key in REMOVED if key in path.read_text()}
    assert named == set()


# -- command lines --------------------------------------------------------------------------------

# Synopsis words that stand for arguments the user writes.
SYNOPSIS_ONLY = {"dotted.key=value", "overrides"}


def _command_lines(path: Path) -> list[tuple[str, bool]]:
    """(`jaxdist ...` command, whether it is a whole command line) in a markdown file: the lines of
    its code blocks (continuation lines joined) whole, its inline spans as fragments."""
    text = _doc_text(path)
    lines, commands = text.splitlines(), []
    start = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*jaxdist (?=[a-z-]+(?:\s|$)|--)")
    for number, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if indent >= 4 and start.match(line.strip()):
            command = line.strip()
            for following in lines[number + 1:]:
                if len(following) - len(following.lstrip()) <= indent or not following.strip().startswith(("[", "-")):
                    break
                command += " " + following.strip()
            commands.append((command, True))
    commands += [(span, False) for span in _inline_spans(text) if start.match(span)]
    return [(start.sub("jaxdist ", re.sub(r"\s+#.*", "", command)), whole) for command, whole in commands]


def _argv(command: str) -> list[str]:
    """A synopsis made a command line: optional parts included, the first of alternatives, 2 for N."""
    argv = []
    for word in shlex.split(command)[1:]:
        word = word.removeprefix("[")
        if word.count("]") > word.count("["):
            word = word[:word.rindex("]")]
        word = word.split("|")[0].removesuffix("...")  # FILES... is one file; a lone ... is nothing
        if word in SYNOPSIS_ONLY or not word:
            continue
        argv.append("2" if re.fullmatch(r"[A-Z]", word) else word)
    return argv


def _parse_error(argv: list[str], whole: bool) -> str | None:
    """What the command line says about `argv`, or None if it parses (fragments may leave out
    arguments); a launched command and a recipe's config with its overrides are checked too."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = cli._parser().parse_known_args(argv)
    except SystemExit:
        message = stderr.getvalue().strip()
        fragment_ok = ("arguments are required" in message or "expected one argument" in message) and not whole
        return None if fragment_ok else message
    if unknown := [arg for arg in extra if "=" not in arg or arg.startswith("-")]:
        return f"unrecognized arguments: {' '.join(unknown)}"
    program = args.program[1:] if args.command == "launch" and args.program[:1] == ["--"] else []
    if program:
        return _parse_error(program, whole)
    named = getattr(args, "config", None) if args.command != "config" else None
    if named and ((ROOT / named).is_file() or named in config.recipes()):
        try:
            config.load(ROOT / named if (ROOT / named).is_file() else named, [*args.overrides, *extra])
        except UserError as err:
            return str(err)
    return None


@pytest.mark.parametrize("path", MARKDOWN, ids=_name)
def test_every_command_line_in_the_docs_parses(path):
    commands = _command_lines(path)
    wrong = [f"{command}: {why}" for command, whole in commands if (why := _parse_error(_argv(command), whole))]
    assert wrong == []


def test_the_command_check_reads_synopses_and_fails_wrong_commands():
    running = [command for command, whole in _command_lines(ROOT / "docs" / "running.md") if whole]
    assert "jaxdist data prepare FILES... --out DIR [--tokenizer byte|sentencepiece|TOKENIZER.json]" in running
    assert _argv(running[running.index("jaxdist data prepare FILES... --out DIR [--tokenizer "
                                     "byte|sentencepiece|TOKENIZER.json]")]) == [
        "data", "prepare", "FILES", "--out", "DIR", "--tokenizer", "byte"]
    assert _parse_error(["bench", "tiny", "--gpus", "2"], whole=True)  # no such flag
    assert _parse_error(["launch", "-n", "2", "--", "train", "tiny", "--steps", "3"], whole=True)
    assert _parse_error(["train", "tiny", "model.loss_impl=xla"], whole=True)  # a key of another section
    assert _parse_error(["bench", "--profile"], whole=False) is None  # a fragment: the config left out
    assert _parse_error(["benchmark", "tiny"], whole=False)


# -- Python names ---------------------------------------------------------------------------------

def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                target = getattr(target, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", MARKDOWN, ids=_name)
def test_every_python_name_and_import_in_the_docs_resolves(path):
    text = path.read_text()
    # `jaxdist.NAME`, but not a file named so (`run_dir/jaxdist.lock`).
    names = {name for span in _inline_spans(text) for name in re.findall(r"(?<![\w/.])jaxdist(?:\.\w+)+", span)}
    for match in MENTION.finditer(text):  # calls such as `rules.place(...)`
        module, attribute = match["key"].split(".", 1)
        if match["call"] and module in MODULES:
            names.add(f"{MODULES[module].__name__}.{attribute}")
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for statement in re.findall(r"^(?:from \S+ import .+|import .+)$", block, re.M):
            exec(statement, {})  # the docs' own import lines: ImportError if a name is gone
    assert [name for name in sorted(names) if not _resolves(name)] == []


# -- the generated config reference ---------------------------------------------------------------

def test_the_config_reference_is_what_config_show_generates(capsys):
    assert cli.main(["config", "show", "--format", "markdown"]) == 0
    generated = capsys.readouterr().out
    assert generated == (ROOT / "docs" / "config.md").read_text(), (
        "docs/config.md is not what the config classes give: regenerate it with "
        "`jaxdist config show --format markdown > docs/config.md`")


# -- the pages ------------------------------------------------------------------------------------

LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target), `[x]` inside the text


def _anchors(path: Path) -> set[str]:
    """The #anchors of a markdown file's headings, as GitHub makes them (repeats get -1, -2, ...)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", path.read_text(), re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_every_link_in_the_docs_reaches_its_file_and_heading(path):
    assert _broken_links(path) == []


def test_the_link_check_sees_links_and_headings(tmp_path):
    assert {"latest-results", "how-to-reproduce"} <= _anchors(BENCHMARKS)
    assert "fp8-matmuls-precisionfp8" in _anchors(ROOT / "docs" / "performance.md")  # `code` and punctuation
    assert LINK.findall("see [`plan` against the\npeak](a.md#b) and [x](https://y)") == ["a.md#b", "https://y"]
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Twice\n\n## Twice\n\n[up](#a-page) [2](#twice-1) [gone](#thrice) [file](other.md)\n")
    assert _broken_links(page) == ["#thrice: no such heading", "other.md: no such file"]


def test_no_line_of_the_docs_is_over_300_characters_outside_tables():
    long = [f"{_name(path)}:{number} ({len(line)} characters)" for path in PAGES
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > 300 and not line.startswith("|")]
    assert long == []


def test_the_benchmark_page_is_one_page_of_latest_results():
    assert len(BENCHMARKS.read_text().splitlines()) < 200
    assert REPORTS and BENCHMARKS.parent / "reports" / "README.md" in REPORTS
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", (BENCHMARKS.parent / "reports" / "README.md").read_text()))
    assert listed == {path.name for path in REPORTS if path.name != "README.md"}  # the index lists every report


def _tables(path: Path) -> list[dict[str, str]]:
    """Every row of a markdown file's tables, as {header: cell}, links made their text."""
    rows, header = [], None
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).strip() for cell in line.strip("|").split(" | ")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-"):
            rows.append(dict(zip(header, cells)))
    return rows


def _latest(first: str, card: str, column: str) -> str:
    """A cell of benchmarks/README.md's tables: the row of that config (or layout) and card."""
    [row] = [row for row in _tables(BENCHMARKS)
             if list(row.values())[0] == first and row.get("card", row.get("cards")) == card]
    return row[column]


# The figures README.md's "GPU performance" quotes, in its order: the benchmark page's cells.
README_FIGURES = [
    ("gpt_406m, batch 16", "H100", "ratio"),
    ("gpt_1b4, batch 8", "H100", "ratio"),
    ("gpt_406m, batch 16", "H200", "ratio"),
    ("gpt_1b4, batch 8", "H200", "ratio"),
    ("resnet50_imagenet, 224x224, batch 256", "H200", "ratio"),
    ("moe_5b (8 experts, top-2, 4.9B, 1.48B active), batch 8", "H200", "ratio"),
    ("FSDP, gpt_406m", "2 x H200", "per GPU"),
    ("FSDP, gpt_406m", "2 x H200", "ratio"),
]


def test_the_readme_performance_figures_are_the_benchmark_pages():
    section = (ROOT / "README.md").read_text().split("## GPU performance", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r"(?<![\w.])\d+(?:\.\d+)?[x%]", section)
    assert quoted == [_latest(*cell) for cell in README_FIGURES]


def test_the_benchmark_page_names_suites_that_exist():
    spec = importlib.util.spec_from_file_location("compare_peers", BENCHMARKS.parent / "compare_peers.py")
    compare_peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_peers)
    named = set(re.findall(r"compare_peers\.py (\w+)", BENCHMARKS.read_text()))
    assert named and named <= set(compare_peers.suites("peers"))
