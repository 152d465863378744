"""The wheel holds what an install needs outside the clone: the recipes (`configs/`, shipped as
`jaxdist.configs`), the kernels' C++ sources and the license; `jaxdist train tiny` runs from it in
another folder."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_an_installed_wheel_trains_a_recipe_by_name_outside_the_clone(tmp_path):
    # Built from a copy: setuptools leaves build/ and *.egg-info/ beside the sources it builds.
    source = tmp_path / "source"
    for name in ("jaxdist", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("jaxdist-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    recipes = {path.name for path in (ROOT / "configs").glob("*.yaml")}
    assert {f"jaxdist/configs/{name}" for name in recipes} <= names and "jaxdist/kernels/gelu_matmul.cc" in names
    assert not any(name.startswith(("configs/", "tests/", "benchmarks/")) for name in names)
    info = wheel.name.rsplit("-", 3)[0] + ".dist-info"  # jaxdist-VERSION.dist-info
    assert archive.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert "License-Expression: Apache-2.0" in archive.read(f"{info}/METADATA").decode().splitlines()
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "jaxdist").rglob("*.py")}
    assert modules <= names, modules - names  # every package listed in pyproject.toml

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "JAXDIST_CPU_DEVICES": "8", "PYTHONSAFEPATH": "1"}
    run = subprocess.run([sys.executable, "-m", "jaxdist.cli", "train", "tiny", "train.steps=2", "log.every=1",
                          "sample.tokens=0", "data.eval_fraction=0.01", f"run_dir={elsewhere / 'run'}"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "trained 2 steps" in run.stdout
    where = subprocess.run([sys.executable, "-c", "from jaxdist import config; print(config.recipes_folder())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == site / "jaxdist" / "configs"  # the wheel's own recipes, not the clone's
