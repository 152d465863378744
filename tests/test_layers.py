"""The package's layers: imports go one way, config <- parallel <- data, kernels <- models <- train
<- checkpoint, observe <- commands <- the command line; and no module imports itself back through others."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxdist"

# Lowest first; a module may import from its own layer and the layers below it.
LAYERS = (
    {"errors", "atomic", "config", "runtime"},
    {"parallel"},
    {"data", "kernels"},
    {"models"},
    {"train"},
    {"checkpoint", "observe"},
    {"commands"},
    {"loop", "cli", "launch", ""},  # "": the package's own __init__, the public surface
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
