"""Metrics writers. Only process 0 writes; every other process gets a writer that does nothing.

`metrics.jsonl` is strict JSON: a non-finite value (a NaN loss) is written as null; the console
shows it as nan or inf.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO

_CONSOLE_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_sec", "step_time_s")


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` (non-finite values as null) and
    prints a short line."""

    def __init__(self, run_dir: Path | None, console: TextIO | None = sys.stdout):
        self._file = open(run_dir / "metrics.jsonl", "a") if run_dir is not None else None
        self._console = console

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self._file is not None:
            strict = {k: v if math.isfinite(v) else None for k, v in record.items()}
            self._file.write(json.dumps(strict, allow_nan=False) + "\n")
            self._file.flush()
        if self._console is not None:
            shown = "  ".join(f"{k} {_fmt(record[k])}" for k in _CONSOLE_KEYS if k in record)
            print(f"step {step:>6}  {shown}", file=self._console, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3e}"


def drop_after(run_dir: Path, step: int) -> None:
    """Removes the `metrics.jsonl` lines of steps after `step` (they are run again after a resume),
    and any line cut short by a killed process."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line + "\n")
    path.write_text("".join(kept))
