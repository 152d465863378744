"""Small C++ XLA FFI handlers that ship as source, built on first use and cached.

A handler here calls a CUDA library (cuBLASLt) from XLA for what XLA's own rewrites do not ask it
for. It needs no CUDA compiler: the host's C++ compiler builds it against the headers of the CUDA
libraries that jax's CUDA plugin installs (the `nvidia-*` packages) or of a CUDA toolkit
(`CUDA_HOME`, `/usr/local/cuda`), and against jax's own FFI headers. The library lands in
`$JAXDIST_CACHE_DIR` (default `~/.cache/jaxdist`), named by a hash of the source and the build
command, so each host builds it once; processes that build at once each write their own file and
rename it into place. Where something is missing, `build` raises `NativeBuildError` with what.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax


RUNTIME_HEADERS = ("driver_types.h", "crt/host_defines.h")  # what CUDA libraries' headers include


class NativeBuildError(RuntimeError):
    """A native handler could not be built or loaded here (no compiler, no CUDA headers, ...)."""


@dataclasses.dataclass(frozen=True)
class CudaLibrary:
    """Where a CUDA library's header and shared object are: `include` dirs and the `.so` to link."""

    include_dirs: tuple[str, ...]
    shared_object: str


def _cuda_roots() -> list[Path]:
    """Directories that may hold CUDA headers and libraries, most specific first.

    jax's CUDA plugin loads the libraries of the `nvidia-*` packages when they are installed, so
    those come first: linking the same file means the process loads it once.
    """
    roots: list[Path] = []
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels

        for base in map(Path, nvidia.__path__):
            roots += sorted(p for p in base.iterdir() if p.is_dir())
    except ImportError:
        pass
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            roots.append(Path(os.environ[variable]))
    roots.append(Path("/usr/local/cuda"))
    return roots


def find_cuda_library(header: str, library: str) -> CudaLibrary:
    """Locates `header` (e.g. `cublasLt.h`), the CUDA runtime's headers it includes, and `lib<library>.so*`."""
    roots = _cuda_roots()
    header_dir = _first(root / "include" for root in roots if (root / "include" / header).is_file())
    # The runtime's headers whole: a wheel may carry driver_types.h without the crt/ it includes.
    runtime_dir = _first(root / "include" for root in roots
                         if all((root / "include" / name).is_file() for name in RUNTIME_HEADERS))
    shared = _first(
        Path(match)
        for root in roots
        for lib_dir in ("lib", "lib64")
        for match in sorted(glob.glob(str(root / lib_dir / f"lib{library}.so*")))
    )
    missing = [what for what, found in ((header, header_dir), (" and ".join(RUNTIME_HEADERS), runtime_dir),
                                        (f"lib{library}.so", shared)) if found is None]
    if missing:
        raise NativeBuildError(f"not found: {', '.join(missing)} (looked in {', '.join(map(str, roots))})")
    include_dirs = tuple(dict.fromkeys(str(d) for d in (runtime_dir, header_dir)))  # one runtime's headers
    return CudaLibrary(include_dirs, str(shared))


def _first(candidates):
    return next(iter(candidates), None)


def cache_dir() -> Path:
    return Path(os.environ.get("JAXDIST_CACHE_DIR", Path.home() / ".cache" / "jaxdist"))


def build(source: Path, libraries: list[CudaLibrary]) -> Path:
    """Compiles `source` into a shared library (cached) and returns its path."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler (set CXX, or install g++)")
    includes = [jax.ffi.include_dir(), *(d for lib in libraries for d in lib.include_dirs)]
    links = [arg for lib in libraries for arg in (lib.shared_object, f"-Wl,-rpath,{Path(lib.shared_object).parent}")]
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-w", *(f"-I{d}" for d in includes)]
    digest = hashlib.sha256(source.read_bytes() + " ".join([compiler, *flags, *links]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so")  # this process's own file
    os.close(handle)
    command = [compiler, *flags, str(source), "-o", partial, *links]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        error = done.stderr[-3000:] if done.returncode else None
    except OSError as failure:
        error = str(failure)
    if error is not None:
        os.unlink(partial)
        raise NativeBuildError(f"{' '.join(command)} failed:\n{error}")
    os.replace(partial, target)
    return target


def register_handler(library: Path, symbol: str, target_name: str, platform: str = "CUDA") -> None:
    """Registers `symbol` of the shared library as the FFI target `target_name` on `platform`."""
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)
    jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(handler), platform=platform)
