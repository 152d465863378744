"""`jaxdist train` times the step's tracing (`startup_trace_s`, paid at every start) apart from XLA's
compile (`startup_compile_s`), which JAX's persistent compilation cache replaces by a load on a second
start."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=64", "model.layers=2", "model.seq_len=32", "train.steps=1", "train.global_batch=16",
        "log.every=1", "checkpoint.every=0", "sample.tokens=0"]


def _start(run_dir: Path, cache: Path) -> tuple[dict, str]:
    """A fresh `jaxdist train` process with the CLI's cache under `cache`: its first metrics record and stdout."""
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT), "JAXDIST_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache even programs that compile fast
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("XLA_FLAGS", None)  # compiled as a user's start compiles, not with the suite's quick flags
    run = subprocess.run([sys.executable, "-m", "jaxdist.cli", "train", "tiny", *TINY, f"run_dir={run_dir}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]), run.stdout


def _entries(cache: Path) -> set[str]:
    return {path.name for path in (cache / "jax").iterdir()}


def test_second_start_loads_the_compiled_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first, out = _start(tmp_path / "first", cache)
    line = re.search(r"ready to train after [\d.]+ s: .*trace ([\d.]+) s, compile ([\d.]+) s", out)
    assert line and float(line[1]) == round(first["startup_trace_s"], 1)
    assert float(line[2]) == round(first["startup_compile_s"], 1)
    cached = _entries(cache)
    assert cached  # the step (and the other programs) written to the cache

    second, _ = _start(tmp_path / "second", cache)
    print(f"first start: trace {first['startup_trace_s']:.3f} s, compile {first['startup_compile_s']:.3f} s; "
          f"second: trace {second['startup_trace_s']:.3f} s, compile {second['startup_compile_s']:.3f} s")
    # A load, not a compile (measured: 35 times less); tracing is not cached.
    assert second["startup_compile_s"] < 0.25 * first["startup_compile_s"]
    assert second["startup_trace_s"] > 0.2 * first["startup_trace_s"]
    assert _entries(cache) == cached  # every program the second start ran came from the cache
    assert second["loss"] == first["loss"]
