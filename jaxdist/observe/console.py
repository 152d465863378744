"""What a run shows on process 0's console: its versions first, progress, a summary at the end.

On a terminal the progress is a live bar (step, elapsed, ETA, loss, tokens/s or examples/s);
anywhere else (CI, log files, `jaxdist launch` children) it is one plain line per logged step,
`step <n>  loss ...`.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_LINE_KEYS = ("loss", "accuracy", "eval_loss", "eval_accuracy", "learning_rate", "grad_norm", "tokens_per_sec",
              "examples_per_sec", "step_time_s")
# The throughput a run logs: tokens/s for token sequences, examples/s otherwise (metrics.throughput).
_THROUGHPUTS = {"tokens_per_sec": "tokens/s", "examples_per_sec": "examples/s"}


def _throughput(values: dict[str, float]) -> tuple[str, float]:
    """(unit, value) of the logged throughput."""
    key = next(key for key in _THROUGHPUTS if key in values)
    return _THROUGHPUTS[key], values[key]


def terminal() -> Console | None:
    """A rich console on stdout when stdout is a terminal, else None."""
    return Console() if sys.stdout.isatty() else None


def _version() -> str:
    """The installed jaxdist's version; a source tree on the path (PYTHONPATH=.) has none."""
    try:
        return importlib.metadata.version("jaxdist")
    except importlib.metadata.PackageNotFoundError:
        return f"(not installed, from {Path(__file__).parents[2]})"


def version_line(*, processes: int, devices: int, platform: str) -> str:
    """The line that opens a run, before any other it prints: the versions and where it runs."""
    return f"jaxdist {_version()}, jax {jax.__version__}; {processes} process(es), {devices} {platform} devices"


def size_line(*, params: int, global_batch: int, device_batch: int, param_bytes: int) -> str:
    """What a run trains, beside the mesh's line: its parameters and its batch."""
    return (f"{params:,} parameters, {param_bytes / 1e6:,.1f} MB of them per device; global batch {global_batch}, "
            f"{device_batch} per device")


def plain_line(step: int, values: dict[str, float]) -> str:
    shown = "  ".join(f"{k} {_fmt(values[k])}" for k in _LINE_KEYS if k in values)
    return f"step {step:>6}  {shown}"


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3e}"


class StepProgress:
    """Shows the run's progress from `start` to `total` steps when `show` (process 0): a live bar on
    a terminal, else a plain line per logged step. Keeps what the summary needs."""

    def __init__(self, start: int, total: int, show: bool):
        self._show = show
        self._start = start
        self._bar: Progress | None = None
        self.steps = 0  # logged so far
        self.last: dict[str, float] = {}  # the newest value of each metric
        console = terminal() if show else None
        if console is not None:
            self._bar = Progress(
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"), BarColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[shown]}"), console=console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, shown="")
            self._bar.start()

    def step(self, step: int) -> None:
        """Moves the bar to `step` (called after each step)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def logged(self, step: int, values: dict[str, float]) -> None:
        """Shows a logged step's metrics."""
        self.steps = step - self._start
        self.last.update(values)
        if self._bar is not None:
            unit, per_sec = _throughput(values)
            shown = f"loss {_fmt(values['loss'])}  {unit} {_fmt(per_sec)}"
            self._bar.update(self._task, completed=step, shown=shown)
        elif self._show:
            print(plain_line(step, values), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

    def summary(self, steady: dict[str, float], last_saved: int | None, checkpoints: Path,
                undeletable: list[int] = ()) -> str:
        """The closing lines: steps, the steady step time with its throughput (and MFU where known)
        (`steady`, observe/goodput.py), the last losses (and accuracies), the last checkpoint, and the
        old checkpoints rotation could not delete (`undeletable`, their steps)."""
        if steady:
            unit, per_sec = _throughput(steady)
            utilization = f", MFU {steady['mfu']:.1%}" if "mfu" in steady else ""
            rate = f"; steady {steady['step_time_s'] * 1e3:,.1f} ms a step, {per_sec:,.0f} {unit}{utilization}"
        else:
            rate = ""
        losses = "  ".join(f"{k.replace('_', ' ')} {_fmt(self.last[k])}"
                           for k in ("loss", "accuracy", "eval_loss", "eval_accuracy") if k in self.last)
        checkpoint = ("no checkpoint saved" if last_saved is None else
                      f"last checkpoint: step {last_saved} in {checkpoints}")
        if undeletable:
            many = len(undeletable) > 1
            checkpoint += (f"; {len(undeletable)} old checkpoint{'s' if many else ''} could not be removed "
                           f"(step{'s' if many else ''} {', '.join(map(str, undeletable))})")
        return f"trained {self.steps} steps{rate}; last {losses}\n{checkpoint}"
