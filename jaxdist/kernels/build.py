"""Builds the C++ XLA FFI handlers that ship as source, and loads them once built.

A handler here calls a CUDA library (cuBLASLt) from XLA for what XLA's own rewrites do not ask it
for. It needs no CUDA compiler: the host's C++ compiler builds it against the headers of the CUDA
libraries that jax's CUDA plugin installs (the `nvidia-*` packages) or of a CUDA toolkit
(`CUDA_HOME`, `/usr/local/cuda`), and against jax's own FFI headers. Where something is missing,
`build` raises `NativeBuildError` with what.

Only `build` compiles: `jaxdist build-kernels` calls it, and so do `train` and `bench` on a GPU
before they compile the step. A model being traced calls `load`, which takes an already built
library or raises `NotBuilt`.

The library lands in `$JAXDIST_CACHE_DIR` (default `~/.cache/jaxdist`), named by a key over all
that the build reads: the source, the compile command, the compiler's version, and the size and
modification time of each file in the include directories and of the libraries it links, so that
new CUDA wheels, a new jax or a new compiler build it anew. After a build, a JSON record beside it
holds its SHA-256; a library is used only where it matches its record (no record: not built).
Processes on one host build in turn (a file lock); each file is written aside and renamed into place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

from jaxdist import atomic, runtime


RUNTIME_HEADERS = ("driver_types.h", "crt/host_defines.h")  # what CUDA libraries' headers include


class NativeBuildError(RuntimeError):
    """A native handler could not be built or loaded here (no compiler, no CUDA headers, ...)."""


class NotBuilt(NativeBuildError):
    """No checked build of a handler is cached for this host: `jaxdist build-kernels` makes one."""


@dataclasses.dataclass(frozen=True)
class CudaLibrary:
    """Where a CUDA library's header and shared object are: `include` dirs and the `.so` to link."""

    include_dirs: tuple[str, ...]
    shared_object: str


@dataclasses.dataclass(frozen=True)
class Handler:
    """A C++ XLA FFI handler shipped as source: what to compile and link, and what to register."""

    name: str
    source: Path
    symbol: str  # the handler's symbol in the library
    target: str  # the FFI target name the model calls
    platform: str = "CUDA"
    libraries: Callable[[], list[CudaLibrary]] = list  # what it links, looked up when building or loading


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
    return runtime.cache_dir()


def build(handler: Handler) -> tuple[Path, bool]:
    """Compiles `handler` unless a checked build of it is cached: (its library, whether it compiled now)."""
    plan = _plan(handler)
    plan.library.parent.mkdir(parents=True, exist_ok=True)
    with open(plan.library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on close
        if _problem(plan) is None:
            return plan.library, False
        _compile(plan)
    return plan.library, True


def load(handler: Handler) -> Path:
    """Registers the cached, checked library of `handler` as its FFI target; never compiles.

    Raises `NotBuilt` where no build of it for this source, compiler and CUDA libraries is cached,
    or where the library differs from its build record.
    """
    plan = _plan(handler)
    problem = _problem(plan)
    if problem is not None:
        raise NotBuilt(f"{handler.name} is not built here: {problem}")
    register_handler(plan.library, handler.symbol, handler.target, handler.platform)
    return plan.library


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One handler's build on this host: the compile command (less its output) and where it goes."""

    command: tuple[str, ...]
    library: Path
    record: Path  # the JSON build record beside the library


def _plan(handler: Handler) -> _Plan:
    """The command and the cached files for `handler` here, named by a key over all the build reads."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler (set CXX, or install g++)")
    libraries = handler.libraries()
    includes = [jax.ffi.include_dir(), *(d for lib in libraries for d in lib.include_dirs)]
    links = [arg for lib in libraries for arg in (lib.shared_object, f"-Wl,-rpath,{Path(lib.shared_object).parent}")]
    command = (compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-w", *(f"-I{d}" for d in includes),
               str(handler.source), *links)
    read = [handler.source.read_bytes(), "\0".join(command).encode(), compiler_version(compiler).encode(),
            _file_stamps([*includes, *(lib.shared_object for lib in libraries)]).encode()]
    key = hashlib.sha256(b"\0".join(hashlib.sha256(part).digest() for part in read)).hexdigest()[:16]
    library = cache_dir() / f"{handler.source.stem}-{key}.so"
    return _Plan(command, library, library.with_suffix(".json"))


@functools.cache
def compiler_version(compiler: str) -> str:
    """What `compiler --version` prints (a build's key holds it)."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    except OSError as error:
        raise NativeBuildError(f"{compiler} --version failed: {error}") from None
    if done.returncode:
        raise NativeBuildError(f"{compiler} --version failed: {done.stderr.strip()}")
    return done.stdout


def _file_stamps(paths: list[str]) -> str:
    """Path, size and modification time of each file under `paths` (folders walked; links followed)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)
        else:
            files.append(path)
    stamps = []
    for file in files:
        try:
            info = os.stat(file)
        except FileNotFoundError:  # a dangling link
            continue
        stamps.append(f"{file} {info.st_size} {info.st_mtime_ns}")
    return "\n".join(stamps)


def _problem(plan: _Plan) -> str | None:
    """Why the cached library can't be used, or None where it matches its build record."""
    try:
        recorded = json.loads(plan.record.read_text())["sha256"]
        actual = _sha256(plan.library)
    except FileNotFoundError:
        return f"no build record {plan.record.name} with its library in {plan.library.parent}"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable build record {plan.record}: {error}"
    if actual != recorded:
        return f"{plan.library} is not the library built (its SHA-256 differs from {plan.record.name}'s)"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(plan: _Plan) -> None:
    """Compiles into a file of this process's own, renames it into place, then writes the record."""
    handle, partial = tempfile.mkstemp(dir=plan.library.parent, suffix=".so")
    os.close(handle)
    command = [*plan.command, "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        error = done.stderr[-3000:] if done.returncode else None
    except OSError as failure:
        error = str(failure)
    if error is not None:
        os.unlink(partial)
        raise NativeBuildError(f"{' '.join(command)} failed:\n{error}")
    record = {"sha256": _sha256(Path(partial)), "command": [*plan.command, "-o", str(plan.library)]}
    plan.record.unlink(missing_ok=True)  # never a new library beside an old record
    os.replace(partial, plan.library)
    atomic.write_text(plan.record, json.dumps(record, indent=1))


def register_handler(library: Path, symbol: str, target_name: str, platform: str = "CUDA") -> None:
    """Registers `symbol` of the shared library as the FFI target `target_name` on `platform`."""
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)
    jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(handler), platform=platform)
