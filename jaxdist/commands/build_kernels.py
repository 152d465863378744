"""`jaxdist build-kernels`: builds the C++ GPU kernels into the cache (`jaxdist.kernels.build`), one
line per kernel; exit code 1 on a GPU where one is unavailable."""

from __future__ import annotations

import argparse

HELP = ("build the C++ GPU kernels into the cache (train and bench do it on a GPU): one line per kernel, built, "
        "up to date or unavailable and why")
OFFLINE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """It takes none."""


def run(args: argparse.Namespace) -> int:
    import jax

    from jaxdist import kernels

    statuses = kernels.build_kernels()
    for status in statuses:
        print(status, flush=True)
    # Off a GPU the kernels are not needed, so one that can't be built there is no failure.
    failed = any(status.state == "unavailable" for status in statuses)
    return 1 if failed and jax.default_backend() == "gpu" else 0
