"""Importing jaxdist changes nothing outside it and imports no JAX; the CLI applies jaxdist's process-wide
settings itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxdist import cli, runtime
from jaxdist.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
USER_FLAGS = "--xla_gpu_autotune_level=2 --xla_gpu_enable_triton_gemm=true"

# Run in a fresh interpreter: what the process looks like before jaxdist, after importing every
# jaxdist module, after using the sharding API (and a data pipeline without workers), and the
# device count JAX then gives. With the argument "use", jaxdist.use_cpu_devices() runs after the imports.
PROBE = """
import importlib, json, os, pkgutil, sys
import jax
import numpy as np
from absl import flags

def state():
    return {"environ": dict(os.environ), "cpu_devices": jax.config.jax_num_cpu_devices,
            "absl_parsed": flags.FLAGS.is_parsed(), "compilation_cache": jax.config.jax_compilation_cache_dir}

report = {"fresh": state()}
import jaxdist
from jaxdist.parallel import rules
for module in pkgutil.walk_packages(jaxdist.__path__, "jaxdist."):
    importlib.import_module(module.name)
report["imported"] = state()
if sys.argv[1:] == ["use"]:
    jaxdist.use_cpu_devices()
from jaxdist.data import stream
mesh = jaxdist.make_mesh(fsdp=-1)
rules.check_mesh_axes(rules.preset("fsdp"), mesh)
sharding = jax.sharding.NamedSharding(mesh, rules.preset("fsdp").param_spec(("embed", "mlp")))
assert float(jax.device_put(np.ones((6, 4), np.float32), sharding).sum()) == 24
windows = stream.TokenWindows(np.arange(64, dtype=np.int32), seq_len=4)
from flax import nnx
from jaxdist.parallel.feed import BatchRows
rules.place(lambda rngs: nnx.Linear(4, 6, rngs=rngs), rules.preset("dp"), mesh).create()
next(stream.train_batches(windows, BatchRows(4, (0, 1)), seed=0))
assert jaxdist.Trainer is not None
report["used"] = state()
report["device_count"] = jax.device_count()
report["mesh_size"] = mesh.size
print(json.dumps(report))
"""


def probe(*args: str) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX", "XLA_"))}
    env.update(XLA_FLAGS=USER_FLAGS, JAXDIST_CPU_DEVICES="3", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def changed_variables(before: dict, after: dict) -> dict:
    names = before["environ"].keys() | after["environ"].keys()
    return {name: after["environ"].get(name) for name in names if before["environ"].get(name) != after["environ"].get(name)}


def test_importing_and_using_jaxdist_leaves_the_process_alone():
    report = probe()
    assert report["fresh"]["environ"]["XLA_FLAGS"] == USER_FLAGS
    assert changed_variables(report["fresh"], report["imported"]) == {}
    assert changed_variables(report["fresh"], report["used"]) == {}
    assert report["imported"] == report["fresh"]
    assert report["used"] == report["fresh"]
    assert report["device_count"] == report["mesh_size"] == 1  # JAXDIST_CPU_DEVICES=3 is not applied


# Run in a fresh interpreter where any import of JAX fails: `import jaxdist` and the command line up to
# its parsed arguments must not need it.
NO_JAX = """
import sys

class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "jax":
            raise ImportError(f"{name} was imported")

sys.meta_path.insert(0, NoJax())
import jaxdist
assert set(jaxdist.__all__) <= set(dir(jaxdist))
from jaxdist.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["trian", "tiny"], 2), (["bench", "tiny", "--steps", "0"], 2)],
                         ids=["help", "unknown_command", "bad_number"])
def test_importing_jaxdist_and_parsing_the_command_line_import_no_jax(args, code):
    run = subprocess.run([sys.executable, "-c", NO_JAX, *args], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == code, run.stderr[-3000:]
    if code == 0:
        assert run.stdout.startswith("usage: jaxdist") and run.stderr == ""
    else:
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("jaxdist: error: "), run.stderr


def test_use_cpu_devices_applies_the_variable():
    report = probe("use")
    assert report["device_count"] == report["mesh_size"] == 3
    assert report["used"]["cpu_devices"] == 3
    assert report["used"]["environ"]["XLA_FLAGS"] == USER_FLAGS


CACHE_PROBE = """
import jax, sys
from jaxdist import runtime
if sys.argv[1:] == ["set"]:
    jax.config.update("jax_compilation_cache_dir", "/somewhere/else")
runtime.compilation_cache()
print(jax.config.jax_compilation_cache_dir)
"""


@pytest.mark.parametrize("preset, expected", [("", "{cache}/jax"), ("set", "/somewhere/else")], ids=["unset", "set"])
def test_compilation_cache_goes_under_the_cache_dir_unless_one_is_set(tmp_path, preset, expected):
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX")}
    env.update(JAXDIST_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", CACHE_PROBE, *([preset] if preset else [])], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == expected.format(cache=tmp_path)


def test_gpu_defaults_add_jaxdist_flags_and_keep_the_users(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    runtime.gpu_defaults()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_gpu_dot_merger_threshold_mb=0", "--xla_gpu_enable_triton_gemm=false"]
    monkeypatch.setenv("XLA_FLAGS", USER_FLAGS)
    runtime.gpu_defaults()
    assert os.environ["XLA_FLAGS"].split() == [*USER_FLAGS.split(), "--xla_gpu_dot_merger_threshold_mb=0"]


def test_the_cli_applies_gpu_defaults(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", USER_FLAGS)
    assert cli.main(["scale", str(ROOT / "configs/gpt_406m.yaml"), "--hosts", "2"]) == 0
    assert os.environ["XLA_FLAGS"].split() == [*USER_FLAGS.split(), "--xla_gpu_dot_merger_threshold_mb=0"]


@pytest.mark.parametrize("value", ["eight", "0", "-1"])
def test_a_bad_device_count_is_a_user_error(monkeypatch, value):
    monkeypatch.setenv("JAXDIST_CPU_DEVICES", value)
    with pytest.raises(UserError, match="JAXDIST_CPU_DEVICES"):
        runtime.use_cpu_devices()
    with pytest.raises(UserError, match="positive integer"):
        runtime.use_cpu_devices(0)


def test_a_device_count_the_host_cannot_hold_is_refused_before_jax_sees_it(monkeypatch):
    monkeypatch.setenv("JAXDIST_CPU_DEVICES", "99999999")
    with pytest.raises(UserError) as refused:
        runtime.use_cpu_devices()
    most = runtime.host_memory_bytes() // runtime.CPU_DEVICE_BYTES
    assert str(refused.value) == (
        f"JAXDIST_CPU_DEVICES=99999999: simulating 99,999,999 devices (1 MiB each) needs at least 104,857.6 GB of "
        f"memory, more than this host has ({runtime.host_memory_bytes() / 1e9:,.1f} GB); use at most {most:,}")
    assert jax.config.jax_num_cpu_devices == 8  # untouched


def test_the_cli_exits_2_with_one_line_on_a_bad_device_count():
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "eight", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "jaxdist.cli", "rules", "configs/tiny.yaml"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["jaxdist: error: JAXDIST_CPU_DEVICES='eight' must be a positive integer"]
