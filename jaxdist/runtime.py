"""Process-wide settings jaxdist offers but never applies on import: simulated CPU devices
(`JAXDIST_CPU_DEVICES`), GPUs to compile for that are not there (`mock_gpus`), jaxdist's default
XLA GPU flags, JAX's persistent compilation cache and a Ctrl-C that cannot be lost; and the host's
memory, which bounds the inputs that size what a command allocates (`check_memory`).

The first three take effect only before JAX starts its backend (the first computation or device
query), the cache before the first compile, so a program calls them first thing; the `jaxdist`
command does.
"""

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import jax

from jaxdist.errors import Terminated, UserError


# What one simulated CPU device costs the host at the least (measured: 0.1 MiB each to create 8192),
# with room for the buffers of a program that runs on it.
CPU_DEVICE_BYTES = 2**20


def use_cpu_devices(n: int | None = None, what: str | None = None) -> None:
    """Gives JAX `n` simulated CPU devices; with `n` None, the count in `JAXDIST_CPU_DEVICES`.

    Unset or empty, the variable changes nothing. A count that is not a positive integer, or that
    the host's memory cannot hold (`CPU_DEVICE_BYTES` each), raises `UserError` naming `what` (how
    the count was given; default the variable, or this call). Call it before the first JAX
    computation. Where an accelerator exists it stays the default backend, so the setting is
    harmless there.
    """
    if n is None:
        n = _count_from_environment()
        if n is None:
            return
        what = f"JAXDIST_CPU_DEVICES={n}"
    what = what or f"use_cpu_devices({n})"
    if n < 1:
        raise UserError(f"{what}: the device count must be a positive integer")
    check_memory(n * CPU_DEVICE_BYTES, f"{what}: simulating {n:,} devices ({CPU_DEVICE_BYTES // 2**20} MiB each)",
                 f"use at most {host_memory_bytes() // CPU_DEVICE_BYTES:,}")
    # JAX refuses any update once its backend started, even to the current value: skipping it
    # lets a second call with the same count pass (a test session and the code it runs).
    if jax.config.jax_num_cpu_devices != n:
        jax.config.update("jax_num_cpu_devices", n)


def mock_gpus(n: int) -> None:
    """Makes JAX compile for `n` GPUs on a host that has at least one: the first GPU stands for all
    of them (JAX's `mock_num_gpu_processes`). Nothing can run on them; compiling is all they do, so
    XLA's autotuning, which runs kernels, is off unless `XLA_FLAGS` sets it. Call it before JAX's
    backend starts (the `jaxdist plan --mock-gpus` command does)."""
    if n < 1:
        raise UserError(f"--mock-gpus {n}: the GPU count must be a positive integer")
    # One real GPU stands for each mock process's devices: with more visible, each would count n times.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    _add_xla_flags({AUTOTUNE: "0"})
    jax.config.update("mock_num_gpu_processes", n)


def _count_from_environment() -> int | None:
    text = os.environ.get("JAXDIST_CPU_DEVICES", "")
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"JAXDIST_CPU_DEVICES={text!r} must be a positive integer")
    return int(text)


# XLA GPU flags jaxdist sets unless XLA_FLAGS already names them (each measured in benchmarks/reports/):
# - dot merger off: XLA merges the q, k and v projections (dots sharing their input) into one and
#   then copies each out with a slice, forward and backward.
# - Triton GEMMs off: XLA wraps dots in Triton fusions before its cuBLAS rewriter looks for epilogues,
#   so with them on the MLP's GELU stays a separate pass; off, cuBLASLt computes it in the
#   up-projection's epilogue (GELU_AUX: it writes the pre-activation for the backward too). FP8
#   GEMMs need them off too (models/fp8.py).
TRITON_GEMM = "--xla_gpu_enable_triton_gemm"
AUTOTUNE = "--xla_gpu_autotune_level"
GPU_FLAGS = {"--xla_gpu_dot_merger_threshold_mb": "0", TRITON_GEMM: "false"}


def xla_flags() -> dict[str, str]:
    """The flags `XLA_FLAGS` sets, by name, each with its last value ("" for a flag given without one)."""
    return dict((flag.split("=", 1) + [""])[:2] for flag in os.environ.get("XLA_FLAGS", "").split())


def gpu_defaults() -> None:
    """Adds jaxdist's XLA GPU flags (`GPU_FLAGS`) to the `XLA_FLAGS` environment variable.

    A flag already named in `XLA_FLAGS` keeps the user's value. XLA reads the variable when JAX's
    backend starts, so call this before the first JAX computation; processes started afterwards
    inherit the flags. The `jaxdist` command calls it; a library user opts in.
    """
    _add_xla_flags(GPU_FLAGS)


def _add_xla_flags(flags: dict[str, str]) -> None:
    """Appends `flags` (name: value) to `XLA_FLAGS`, each unless the variable already names it."""
    named = xla_flags()
    extra = [f"{flag}={value}" for flag, value in flags.items() if flag not in named]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


def cache_dir() -> Path:
    """Where jaxdist keeps what it builds and compiles: `$JAXDIST_CACHE_DIR`, else ~/.cache/jaxdist."""
    return Path(os.environ.get("JAXDIST_CACHE_DIR", Path.home() / ".cache" / "jaxdist"))


def compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache in `cache_dir()/jax`, unless a cache folder is
    already set (`JAX_COMPILATION_CACHE_DIR` or `jax.config`): a second start of the same program
    loads its compiled step instead of compiling it. The `jaxdist` command calls it."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))


def host_memory_bytes() -> int:
    """The memory this process may use: the host's physical memory, or a container's limit (its
    control group's) where that is less."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(physical, _control_group_limit() or physical)


def _control_group_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def memory_of(devices) -> tuple[int, str]:
    """The memory `devices` hold together, and how an error names it: the sum of their `bytes_limit`
    where the platform reports one (GPUs), else this host's memory, which CPU devices share."""
    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in devices]
    if all(limits):
        return sum(limits), f"the {len(limits)} device(s) have"
    return host_memory_bytes(), "this host has"


def check_memory(needed: int, what: str, fix: str, available: int | None = None, where: str = "this host has") -> None:
    """Raises `UserError` ("`what` needs at least N GB of memory, more than `where` (M GB); `fix`")
    where `needed` bytes exceed `available` (default: `host_memory_bytes()`): said before anything is
    allocated, not found by the kernel's out-of-memory killer."""
    available = host_memory_bytes() if available is None else available
    if needed > available:
        raise UserError(f"{what} needs at least {needed / 1e9:,.1f} GB of memory, more than {where} "
                        f"({available / 1e9:,.1f} GB); {fix}")


_INTERRUPTED = threading.Event()
# What the signal `_INTERRUPTED` remembers raises: KeyboardInterrupt (SIGINT) or Terminated (SIGTERM).
_interruption: type[KeyboardInterrupt] = KeyboardInterrupt
# The hook that reports what `_drop_interrupts` lets through: the one in place when it was installed.
_report_unraisable = sys.unraisablehook


def remember_interrupts() -> dict[int, Any]:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt as Python's own handler does, and SIGTERM raises
    `Terminated` (a KeyboardInterrupt too: the command stops the same way); either is remembered from
    now on (an earlier command's interrupt is forgotten). Returns the handlers it replaced, for
    `restore_handlers` once the command is done.

    A KeyboardInterrupt raised while Python runs a garbage-collector callback (JAX registers one) is
    printed and dropped, and the program would go on as if no key was pressed; `interrupted()` still
    tells, `interruption()` gives it again, and such a dropped interrupt prints nothing. The `jaxdist`
    command calls it from the main thread; the training loop's own handlers (train/preemption.py)
    take over while it steps, and with several processes JAX's preemption notifier takes SIGTERM.
    """
    global _report_unraisable
    _INTERRUPTED.clear()
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    if sys.unraisablehook is not _drop_interrupts:  # installed once, however many commands run
        _report_unraisable, sys.unraisablehook = sys.unraisablehook, _drop_interrupts
    return previous


def restore_handlers(previous: dict[int, Any]) -> None:
    """The signal handlers `remember_interrupts` replaced, back in place (a program that called the
    `jaxdist` command keeps its own)."""
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _drop_interrupts(unraisable) -> None:
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        _report_unraisable(unraisable)


def _interrupt(signum, frame) -> None:
    global _interruption
    _interruption = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    _INTERRUPTED.set()
    raise _interruption


def interrupted() -> bool:
    """Whether a Ctrl-C (or a SIGTERM) arrived since `remember_interrupts()`."""
    return _INTERRUPTED.is_set()


def interruption() -> KeyboardInterrupt:
    """The exception of the signal `interrupted()` remembers, to raise where Python dropped it."""
    return _interruption()
