"""Settings that must be in place before JAX starts its backend: `JAXDIST_CPU_DEVICES=N` (N
simulated CPU devices) and jaxdist's default XLA GPU flags."""

import os

import jax


def apply_cpu_device_count() -> None:
    """Sets JAX's CPU device count from the environment; a no-op when the variable is unset.

    Must run before the first JAX computation; importing jaxdist does it. Where an accelerator
    exists it stays the default backend, so the variable is harmless there.
    """
    count = os.environ.get("JAXDIST_CPU_DEVICES")
    if not count:
        return
    if not count.isdigit() or int(count) < 1:
        raise SystemExit(f"jaxdist: error: JAXDIST_CPU_DEVICES={count!r} must be a positive integer")
    if jax.config.jax_num_cpu_devices != int(count):
        jax.config.update("jax_num_cpu_devices", int(count))


# XLA GPU flags jaxdist sets unless XLA_FLAGS already names them (each measured in BENCHMARKS.md):
# - dot merger off: XLA merges the q, k and v projections (dots sharing their input) into one and
#   then copies each out with a slice, forward and backward (406M, H100: 1 ms/step slower).
# - Triton GEMMs off: XLA wraps dots in Triton fusions before its cuBLAS rewriter looks for epilogues,
#   so with them on the MLP's GELU stays a separate pass; off, cuBLASLt computes it in the
#   up-projection's epilogue (GELU_AUX: it writes the pre-activation for the backward too).
#   406M, H100: 87.63 -> 85.78 ms.
GPU_FLAGS = {"--xla_gpu_dot_merger_threshold_mb": "0", "--xla_gpu_enable_triton_gemm": "false"}


def apply_xla_flags() -> None:
    """Adds `GPU_FLAGS` to XLA_FLAGS, leaving any flag the user set alone. Before the backend starts."""
    current = os.environ.get("XLA_FLAGS", "")
    named = {flag.split("=", 1)[0] for flag in current.split()}
    extra = [f"{flag}={value}" for flag, value in GPU_FLAGS.items() if flag not in named]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
