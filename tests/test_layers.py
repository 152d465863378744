"""The package's layers: imports go one way, config <- parallel <- data, kernels <- models <- train
<- checkpoint, observe <- loop, commands <- the command line; no module imports itself back through
others; and every verb of the command line is run by the module of commands/ named after it."""

import argparse
import ast
import re
import sys
from pathlib import Path

from jaxdist import cli

PACKAGE = Path(__file__).resolve().parents[1] / "jaxdist"

# Lowest first; a module may import from its own layer and the layers below it.
LAYERS = (
    {"errors", "atomic", "config", "runtime"},
    {"parallel"},
    {"data", "kernels"},
    {"models"},
    {"train"},
    {"checkpoint", "observe"},
    {"loop", "commands"},  # the training loop and the verbs of the command line
    {"cli", ""},  # "": the package's own __init__, the public surface
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if part in names)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The jaxdist modules `path` imports (every `from jaxdist.x import y` counts as jaxdist.x.y
    when that is a module, else jaxdist.x)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("jaxdist")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jaxdist"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*candidate.split("."))).is_dir()
                found.add(candidate if is_module else node.module)
    return found


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_imports_follow_the_layers():
    against = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, path in modules().items()
        for target in imports(path)
        if target != "jaxdist" and layer(target) > layer(module)
    ]
    assert not against, "\n".join(against)


def test_no_module_imports_itself_back():
    graph = {module: imports(path, top_level_only=True) & modules().keys() for module, path in modules().items()}
    done, cycles = set(), []

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            cycles.append(" -> ".join(stack[stack.index(module):] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            if target != module and not module.startswith(target + "."):  # a package's own submodules
                visit(target, stack + [module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_a_violation(tmp_path):
    """A lower layer importing a higher one is caught (the parser reads both import forms)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import jaxdist.train.step\nfrom jaxdist.checkpoint import store\n")
    assert imports(bad) == {"jaxdist.train.step", "jaxdist.checkpoint.store"}
    assert layer("jaxdist.config") < layer("jaxdist.train.step") < layer("jaxdist.checkpoint.store")


def verbs(parser: argparse.ArgumentParser) -> list[str]:
    """Every verb `parser` knows, the subcommands of a group (`config show`) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                found += [f"{name} {verb}" for verb in verbs(subparser)] or [name]
    return found


def test_every_verb_is_run_by_the_module_named_after_it():
    """`jaxdist VERB` is jaxdist/commands/<VERB, '-' and ' ' written '_'>.py (`data prepare`:
    data_prepare.py), a module with HELP, add_arguments and run; commands/ holds nothing else but
    what several verbs' arguments share (arguments.py)."""
    known = verbs(cli._parser())
    assert len(known) == len(cli.VERBS) and "data prepare" in known and "build-kernels" in known
    expected = {verb.replace("-", "_").replace(" ", "_") for verb in known}
    commands = PACKAGE / "commands"
    assert {path.stem for path in commands.glob("*.py")} - {"__init__", "arguments"} == expected
    for verb in known:
        module = cli.command_module(verb)
        assert Path(module.__file__) == commands / f"{verb.replace('-', '_').replace(' ', '_')}.py"
        assert isinstance(module.HELP, str) and callable(module.add_arguments) and callable(module.run), verb


def family_files(entry) -> list[Path]:
    """A registered model's own files: the folder of its package (models/gpt/), or its one module."""
    path = Path(sys.modules[entry.section.__module__].__file__)
    return sorted(path.parent.rglob("*.py")) if path.parent != PACKAGE / "models" else [path]


def test_a_model_family_is_named_only_in_its_own_files():
    """A family's architecture strings and config class appear in its own files alone (and in those
    of the families that build on its section; the GPT's in the decoder's shared layers, models/layers/,
    too): adding a family touches no other module."""
    from jaxdist import models

    against = []
    for entry in models.MODELS.values():
        names = {entry.section.__name__, *(entry.hf.architectures if entry.hf else ())}
        allowed = {path for other in models.MODELS.values() if issubclass(other.section, entry.section)
                   for path in family_files(other)}
        if entry.name == "gpt":  # the decoder's shared parts, which its section configures
            allowed |= set((PACKAGE / "models" / "layers").rglob("*.py"))
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
        for path in sorted(PACKAGE.rglob("*.py")):
            if path not in allowed and (found := pattern.search(path.read_text())):
                against.append(f"{path.relative_to(PACKAGE)} names {found.group(0)} of model.name={entry.name}")
    assert not against, against
    assert {"GPT2LMHeadModel", "Qwen3MoeForCausalLM"} <= {a for e in models.MODELS.values() if e.hf
                                                           for a in e.hf.architectures}
