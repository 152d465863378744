"""Traces a window of train steps with the JAX profiler (`profile.start_step`, `profile.steps`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from jaxdist.config import ProfileConfig
from jaxdist.errors import warn


class StepProfiler:
    """Starts a JAX profiler trace before step `start_step` and stops it after `steps` steps.

    Each process writes its own trace into `run_dir/profile/process_<i>`: a TensorBoard profile
    (`plugins/profile/`) and a `perfetto_trace.json.gz` that ui.perfetto.dev opens. A window the
    run resumes into is traced from the first step it runs; leaving the block ends a trace early.
    A window the run ended before (its last step below `start_step`) is a warning as the block
    is left, since no trace will be there to look for.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: Path):
        self._first, self._last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.directory = run_dir / "profile" / f"process_{jax.process_index()}"
        self._tracing = False
        self._latest: int | None = None  # the last step run

    def before(self, step: int) -> None:
        """Starts the trace when `step` is the window's first step to run."""
        self._latest = step
        if not self._tracing and self._first <= step <= self._last:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self._tracing = True

    def after(self, step: int, outputs: Any) -> None:
        """Stops the trace after the window's last step, once `outputs` (the step's) are computed."""
        if self._tracing and step >= self._last:
            jax.block_until_ready(outputs)  # the trace must hold the step's device work
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if self._tracing:
            self._stop()
        elif (exc_type is None and self._first <= self._last and self._latest is not None
              and self._latest < self._first):
            warn(f"nothing was profiled: profile.start_step={self._first} is past step {self._latest}, the last "
                 f"this run took")
