"""Building and loading the C++ FFI handlers (kernels/build.py, `jaxdist build-kernels`).

The CPU stand-in for the cuBLASLt handler goes through the builder as the GPU handler does; a fake
CUDA folder stands in for the headers and libraries where only the cache key or the lookup is tested.
"""

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import cli, kernels
from jaxdist.kernels import build, gelu_matmul, switch
from jaxdist.models.gpt import GPTConfig, ImplConfig

from test_gelu_matmul import STAND_IN

pytestmark = pytest.mark.slow

CUDA_FILES = ("include/cublasLt.h", "include/cuda_runtime_api.h", "include/driver_types.h",
              "include/crt/host_defines.h", "lib/libcublasLt.so.13", "lib/libcudart.so.13")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch) -> Path:
    """A CUDA folder with empty headers and libraries, the only one the lookup sees."""
    root = tmp_path / "cuda"
    for name in CUDA_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    monkeypatch.setattr(build, "_cuda_roots", lambda: [root])
    return root


@pytest.fixture
def stand_in(request) -> build.Handler:
    """The stand-in under an FFI target of this test's own: XLA keeps one library per target name."""
    return dataclasses.replace(STAND_IN, target=f"jaxdist_test_gelu_grad_{request.node.name}")


@pytest.fixture
def fresh_choice():
    """`gelu_matmul`'s cached answers, cleared before and after (a test may pretend to be a GPU)."""
    gelu_matmul.unavailable_reason.cache_clear()
    switch.warn_once.cache_clear()
    yield
    gelu_matmul.unavailable_reason.cache_clear()
    switch.warn_once.cache_clear()


def _run_stand_in() -> None:
    """Calls the registered stand-in and checks it against XLA's `(d_out @ down.T) * gelu'(pre)`."""
    keys = jax.random.split(jax.random.key(0), 3)
    d_out, down, pre = (jax.random.normal(k, shape) for k, shape in zip(keys, ((2, 8, 16), (64, 16), (2, 8, 64))))
    np.testing.assert_allclose(jax.jit(gelu_matmul._local)(d_out, down, pre),
                               gelu_matmul.xla_gelu_grad_matmul(d_out, down, pre), rtol=1e-5, atol=1e-5)


def test_built_once_then_up_to_date_and_the_handler_runs(cache, stand_in, monkeypatch):
    first = kernels.build_kernels((stand_in,))
    assert [(s.name, s.state) for s in first] == [("gelu_grad_reference", "built")]
    library = Path(first[0].detail)
    assert library.parent == cache and library.name.startswith("gelu_grad_reference-")
    record = json.loads(library.with_suffix(".json").read_text())
    assert record["sha256"] == build._sha256(library)
    built_at = library.stat().st_mtime_ns
    again = kernels.build_kernels((stand_in,))
    assert [(s.state, s.detail) for s in again] == [("up to date", str(library))]
    assert library.stat().st_mtime_ns == built_at
    assert build.load(stand_in) == library
    monkeypatch.setattr(gelu_matmul, "HANDLER", stand_in)
    _run_stand_in()


def test_the_key_follows_the_headers_libraries_compiler_and_source(tmp_path, cache, fake_cuda, monkeypatch):
    handler = build.Handler("probe", tmp_path / "probe.cc", "Probe", "probe",
                            libraries=lambda: [build.find_cuda_library("cublasLt.h", "cublasLt")])
    handler.source.write_text("// v1\n")
    libraries = {build._plan(handler).library}
    (fake_cuda / "include/cublasLt.h").write_text("#define CUBLAS_VER 13\n")  # header content (size)
    libraries.add(build._plan(handler).library)
    os.utime(fake_cuda / "include/crt/host_defines.h", ns=(1, 1))  # a runtime header's mtime
    libraries.add(build._plan(handler).library)
    (fake_cuda / "include/crt/new_header.h").touch()  # a header more
    libraries.add(build._plan(handler).library)
    (fake_cuda / "lib/libcublasLt.so.13").write_bytes(b"\0" * 8)  # the library linked
    libraries.add(build._plan(handler).library)
    handler.source.write_text("// v2\n")
    libraries.add(build._plan(handler).library)
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "g++ (newer) 99.1")
    libraries.add(build._plan(handler).library)
    assert len(libraries) == 7
    assert build._plan(handler).library == build._plan(handler).library  # and nothing else moves it


def test_a_changed_library_is_not_loaded_but_rebuilt(cache, stand_in):
    library = Path(kernels.build_kernels((stand_in,))[0].detail)
    library.write_bytes(library.read_bytes() + b"\0")  # changed after the build
    with pytest.raises(build.NotBuilt, match="SHA-256 differs"):
        build.load(stand_in)
    assert [s.state for s in kernels.build_kernels((stand_in,))] == ["built"]
    assert build.load(stand_in) == library


def test_a_library_without_its_build_record_counts_as_not_built(cache, stand_in):
    library = Path(kernels.build_kernels((stand_in,))[0].detail)
    library.with_suffix(".json").unlink()
    with pytest.raises(build.NotBuilt, match="no build record"):
        build.load(stand_in)
    assert [s.state for s in kernels.build_kernels((stand_in,))] == ["built"]
    assert build.load(stand_in) == library


def test_tracing_with_nothing_built_never_compiles_and_falls_back(cache, fake_cuda, fresh_choice, monkeypatch):
    def no_compiling(plan):
        raise AssertionError(f"compiled while tracing: {plan.command}")

    monkeypatch.setattr(build, "_compile", no_compiling)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    pre, down = jnp.ones((2, 8, 64), jnp.bfloat16), jnp.ones((64, 16), jnp.bfloat16)

    def loss(impl):
        def fn(pre, down):
            kernel = gelu_matmul.use_kernel(impl, pre, down)
            return gelu_matmul.gelu_project(pre, down, kernel=kernel).astype(jnp.float32).sum()
        return jax.grad(fn, (0, 1))

    with pytest.warns(UserWarning, match=r"separate XLA pass.*gelu_matmul is not built here.*jaxdist build-kernels"):
        jaxpr = str(jax.make_jaxpr(loss("auto"))(pre, down))
    assert "ffi_call" not in jaxpr
    with pytest.raises(RuntimeError, match=r"cublaslt.*not built here.*jaxdist build-kernels"):
        jax.make_jaxpr(loss("cublaslt"))(pre, down)
    assert not cache.exists() or not list(cache.glob("*.so"))


def test_train_and_bench_build_only_on_a_gpu_when_the_model_asks(monkeypatch):
    monkeypatch.setattr(kernels, "build_kernels", lambda: [kernels.Status("gelu_matmul", "built", "/x.so")])
    unrolled = GPTConfig(impl=ImplConfig(scan_layers=False))
    assert kernels.build_for(unrolled) is None  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kernels.build_for(unrolled) == "kernels: gelu_matmul: built (/x.so)"
    assert kernels.build_for(GPTConfig(impl=ImplConfig(scan_layers=True))) == "kernels: gelu_matmul: built (/x.so)"
    for model in (GPTConfig(impl=ImplConfig(scan_layers=False, gelu_grad_impl="xla")),
                  GPTConfig(activation="swiglu", impl=ImplConfig(scan_layers=False))):
        assert kernels.build_for(model) is None


def test_build_kernels_command_prints_a_line_per_kernel_and_exits_0_off_a_gpu(cache, capsys):
    assert cli.main(["build-kernels"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(kernels.NATIVE) == 1
    assert lines[0].startswith(("gelu_matmul: built (", "gelu_matmul: up to date (", "gelu_matmul: unavailable (")), lines


def test_the_lookup_and_the_build_say_what_is_missing(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(build, "_cuda_roots", lambda: [tmp_path])
    with pytest.raises(build.NativeBuildError, match=r"not found: cublasLt.h, driver_types.h and crt/host_defines.h, libcublasLt.so"):
        build.find_cuda_library("cublasLt.h", "cublasLt")
    for name in ("include/crt", "lib"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("include/cublasLt.h", "include/driver_types.h", "include/crt/host_defines.h", "lib/libcublasLt.so.13"):
        (tmp_path / name).touch()
    found = build.find_cuda_library("cublasLt.h", "cublasLt")
    assert found == build.CudaLibrary((str(tmp_path / "include"),), str(tmp_path / "lib" / "libcublasLt.so.13"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.NativeBuildError, match="failed"):
        build.build(STAND_IN)
