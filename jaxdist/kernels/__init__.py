"""GPU kernels (Pallas, C++ XLA FFI handlers) and their builder; each falls back to XLA where it can't run.

The Pallas kernels compile with the step. The C++ handlers (`NATIVE`) are compiled ahead of it, by
`build_kernels` (`jaxdist build-kernels`) or by the first `train` or `bench` on a GPU
(`build_for`); a model being traced only loads them (kernels/build.py).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxdist.kernels import build, gelu_matmul

NATIVE: tuple[build.Handler, ...] = (gelu_matmul.HANDLER,)


@dataclasses.dataclass(frozen=True)
class Status:
    """What `build_kernels` did for one handler: `built`, `up to date` or `unavailable`, and where or why."""

    name: str
    state: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.state} ({self.detail})"


def build_kernels(handlers: tuple[build.Handler, ...] = NATIVE) -> list[Status]:
    """Builds each C++ handler whose checked build is not cached yet; one status per handler."""
    statuses = []
    for handler in handlers:
        try:
            library, compiled = build.build(handler)
        except (build.NativeBuildError, OSError) as error:  # OSError: e.g. a cache folder not writable
            statuses.append(Status(handler.name, "unavailable", str(error)))
        else:
            statuses.append(Status(handler.name, "built" if compiled else "up to date", str(library)))
    gelu_matmul.unavailable_reason.cache_clear()  # models traced from now on load what was built
    return statuses


def build_for(model) -> str | None:
    """On a GPU, builds the C++ handlers that a model (a `model:` section: `wants_native_kernels`) asks
    for, before its step compiles.

    Returns one status line, or None where there is nothing to build (not a GPU, or not asked).
    """
    if jax.default_backend() != "gpu" or not model.wants_native_kernels:
        return None
    return "kernels: " + "; ".join(map(str, build_kernels()))
