"""The rule the Pallas kernels' `model.impl.*` switches follow: `auto`, `xla`, or the kernel's own name."""

from __future__ import annotations

import functools
import warnings

import jax


def wanted(impl: str) -> bool:
    """Whether the switch asks for the kernel here at all: by its own name anywhere, `auto` on a GPU."""
    return impl != "xla" and (impl != "auto" or jax.default_backend() == "gpu")


def decide(key: str, impl: str, reason: str | None, fallback: str) -> bool:
    """Whether a `wanted` kernel runs: where it can't (`reason`), `auto` takes `fallback` and says so
    once per reason (not once per layer or chunk), and the kernel's own name raises with the reason."""
    if reason is None:
        return True
    if impl != "auto":
        raise ValueError(f"model.impl.{key}={impl}: {reason}; use auto or xla")
    warn_once(f"{fallback} (slower): {reason}")
    return False


@functools.cache
def warn_once(message: str) -> None:
    """Warns with `message` the first time only (a kernel that can't run is said once, not per call)."""
    warnings.warn(message, stacklevel=4)
