"""Applies `JAXDIST_CPU_DEVICES=N` (N simulated CPU devices) before JAX picks its backend."""

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
