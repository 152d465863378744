"""Every test sees 8 simulated CPU devices (the project's JAXDIST_CPU_DEVICES switch).

Two tiers: `make test` runs everything (what CI runs); `make test-fast` (`pytest -m "not slow"`)
skips the modules marked slow (`pytestmark = pytest.mark.slow` at their top: they train, compile many
programs or start processes) and runs in about two minutes on 2 cores.
"""

import importlib.util
import json
import os
import re
from pathlib import Path

os.environ.setdefault("JAXDIST_CPU_DEVICES", "8")
# The suite is the CPU-simulated spec on every host: on a GPU host JAX would pick the GPU, where the
# meshes of 8 devices do not exist. `make test-gpu` (JAXDIST_GPU_TESTS=1) runs the tests marked `gpu`
# on the accelerator instead, and only those.
GPU_TESTS = os.environ.get("JAXDIST_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs, in this process and in the ones it starts (they
# inherit the environment): without LLVM's optimisations XLA compiles them in about half the time,
# with the same partitioning and collectives. XLA's older CPU fusion emitters (LLVM IR directly,
# not through MLIR) and one LLVM module per program (not split for codegen threads) take about a
# third off again (the same collectives; some elementwise loops are fused otherwise). Tests that
# train for long set their own flags.
# Only where no GPU plugin is installed: a jaxlib that does not know a flag aborts at start (jax 0.11's
# has no --xla_cpu_use_fusion_emitters), and the GPU tests need none of these.
GPU_PLUGIN = any(importlib.util.find_spec(plugin) for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
if not GPU_PLUGIN:
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                                       "--xla_cpu_parallel_codegen_split_count=1")

import atexit  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist import config as config_lib  # noqa: E402

if GPU_TESTS:  # the GPU tests compile as the jaxdist command does (FP8 GEMMs need its flags)
    jaxdist.gpu_defaults()
jaxdist.use_cpu_devices()  # before any computation

# Tracing and lowering allocate container objects by the hundred thousand, and each of Python's
# default cyclic collections (every 700) walks through them: collected every 50,000, and with what
# the imports and the collection built frozen out of the walk (`pytest_collection_finish`), the
# suite spends about a tenth less CPU. Reference counting frees what it did before; the runs' own
# gc.collect() calls still collect everything made after the freeze.
gc.set_threshold(50_000, 20, 20)

# Tests build the same tiny programs many times (and in subprocesses: pass them
# jax.config.jax_compilation_cache_dir): compile each once per session, through JAX's persistent
# cache. The first process to import this file (pytest itself) makes the folder and removes it when
# it exits; xdist's workers, started later, inherit its path and share it.
if "JAXDIST_TEST_JAX_CACHE" not in os.environ:
    os.environ["JAXDIST_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_JAX_CACHE"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_TEST_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# A GPT small enough that a 10-step run compiles and trains in seconds on 2 cores.
TINY_GPT = {
    "model": {"d_model": 64, "layers": 2, "heads": 4, "seq_len": 32, "mlp_ratio": 4},
    "train": {"steps": 10, "global_batch": 16},
    "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
    "log": {"every": 1},
    # Two batches an evaluation: the stdlib corpus's whole eval split is some 440 of them. A test of
    # the whole split asks for it (batches: None).
    "eval": {"batches": 2},
    "sample": {"tokens": 0},
}


def make_config(run_dir, base: dict | None = None, **sections) -> config_lib.Config:
    """The tiny GPT config (or `base`) with some sections (or keys within them) replaced; `impl=`
    stands for the GPT's `model.impl` keys."""
    raw = {key: dict(value) for key, value in (TINY_GPT if base is None else base).items()}
    if "impl" in sections:
        raw.setdefault("model", {})
        raw["model"] = {**raw["model"], "impl": {**raw["model"].get("impl", {}), **sections.pop("impl")}}
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    raw["run_dir"] = str(run_dir)
    return config_lib.from_dict(raw)


def logged_keys(run_dir) -> set[str]:
    """Every key of every line a run wrote to `run_dir/metrics.jsonl`."""
    return {key for line in (run_dir / "metrics.jsonl").read_text().splitlines() for key in json.loads(line)}


def undocumented_metrics(keys) -> set[str]:
    """The `keys` (of metrics.jsonl lines, or of a step's metrics) that docs/running.md's Metrics
    table does not list; an upper-case word there (`startup_PART_s`) stands for any name."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "running.md").read_text(encoding="utf-8")
    rows = text.split("\n| metrics.jsonl key |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    listed = [key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])]
    patterns = [re.compile("".join("[a-z0-9_]+" if part.isupper() else re.escape(part)
                                   for part in re.split(r"([A-Z]+)", key))) for key in listed]
    return {key for key in keys if not any(pattern.fullmatch(key) for pattern in patterns)}


def logged_losses(run_dir) -> list[float]:
    """The losses a run logged in `run_dir/metrics.jsonl`, in order."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_steps(run_dir) -> list[int]:
    """The steps a run logged in `run_dir/metrics.jsonl`, in order."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def disk_full_past(nbytes: int):
    """A disk that fills up, for this process: while active, a write that would grow any file past
    `nbytes` writes what fits and fails (EFBIG, the kernel's limit on a process's file size: no mount
    and no root needed). Call it from the main thread (it ignores SIGXFSZ meanwhile)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# A ResNet-18 at width 8 (8 to 64 channels) with the stem for small images: a classifier with
# BatchNorm that compiles in seconds on 2 cores.
SMALL_RESNET = {"name": "resnet", "depth": 18, "width": 8, "stem": "small"}


def make_classifier_config(run_dir, model: dict, **sections) -> config_lib.Config:
    """A classifier `model` section on the digits, with the tiny GPT config's other sections (some
    replaced as in `make_config`)."""
    base = {key: value for key, value in TINY_GPT.items() if key not in ("model", "sample", "eval")}
    return make_config(run_dir, {**base, "model": model, "data": {"source": "digits"}}, **sections)


@pytest.fixture(scope="session")
def packed_corpus(tmp_path_factory) -> dict:
    """The `data:` section of a prepared split of documents from 2 to 90 bytes, packed: rows of a few
    dozen tokens hold one document or several and real padding, so microbatches and batch shards
    count different numbers of tokens (the GPT's `model.vocab` is `auto` on it)."""
    from data_helpers import prepared, random_documents

    out, _ = prepared(tmp_path_factory.mktemp("packed"), random_documents(300, seed=3, shortest=2, longest=90),
                      eval_fraction=0.1)
    return {"source": "arrayrecord", "path": str(out), "packing": True}


@pytest.fixture
def devices():
    assert jax.device_count() == 8, "tests expect JAXDIST_CPU_DEVICES=8"
    return jax.devices()


class CompileCounter:
    """Counts XLA backend compiles while active (to prove errors come before any compile)."""

    def __init__(self):
        self.count = 0
        self.active = False

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


_COUNTER = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER)


@pytest.fixture
def compiles():
    _COUNTER.count, _COUNTER.active = 0, True
    yield _COUNTER
    _COUNTER.active = False


# The modules of the longest tests, run first: xdist hands out tests in collection order, and a
# worker that draws one of these last keeps the run going for minutes after the other is done.
LONGEST_FIRST = ("test_main_job", "test_layouts_multiprocess", "test_multihost")


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if GPU_TESTS:
        config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("gpu")])
        items[:] = [item for item in items if item.get_closest_marker("gpu")]
    items.sort(key=lambda item: LONGEST_FIRST.index(item.module.__name__)
               if item.module.__name__ in LONGEST_FIRST else len(LONGEST_FIRST))
