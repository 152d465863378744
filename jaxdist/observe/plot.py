"""`jaxdist plot RUN_DIR...`: train and eval loss, throughput (tokens/s or examples/s) and, for
classifiers, accuracy against step, one PNG for one or several runs, read from each run's
`metrics.jsonl`.

Keys a line lacks, or holds as null, leave a gap in that line's curve; nothing else is required
of a run beyond some logged steps. Needs matplotlib (the `plot` extra); drawing uses its Agg
canvas through `Figure`, so no pyplot state or backend setting is touched.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from jaxdist.errors import UserError

METRICS = "metrics.jsonl"
# (panel title, [(metrics key, line style)]) top to bottom; a panel no run has values for is left out.
PANELS = (
    ("loss", [("loss", "-"), ("eval_loss", "--")]),
    ("throughput", [("tokens_per_sec", "-"), ("examples_per_sec", "-")]),
    ("accuracy", [("accuracy", "-"), ("eval_accuracy", "--")]),
)
# Its axis starts at 0, so that noise looks like noise.
FROM_ZERO = "throughput"


def read_metrics(run_dir: Path) -> list[dict]:
    """The JSON objects of `run_dir`'s metrics.jsonl, in order."""
    path = run_dir / METRICS
    if not path.is_file():
        raise UserError(f"plot: {run_dir} has no {METRICS}; pass a run_dir written by `jaxdist train`")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run stopped while writing leaves a partial last line
        if isinstance(record, dict):
            records.append(record)
    if not any(_number(record.get("step")) is not None for record in records):
        raise UserError(f"plot: {path} has no logged steps yet; plot it once the run has logged some")
    return records


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of every record with a finite `step` and `key`."""
    points = [(_number(r.get("step")), _number(r.get(key))) for r in records]
    points = [(step, value) for step, value in points if step is not None and value is not None]
    return [step for step, _ in points], [value for _, value in points]


def panels(runs: dict[str, list[dict]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The `PANELS` that some run has a value for."""
    return [(title, lines) for title, lines in PANELS
            if any(series(records, key)[0] for records in runs.values() for key, _ in lines)]


def default_out(run_dirs: list[str]) -> Path:
    """RUN_DIR/plot.png for one run; plot.png in the current directory for several."""
    return Path(run_dirs[0]) / "plot.png" if len(run_dirs) == 1 else Path("plot.png")


def labels(run_dirs: list[str]) -> dict[str, str]:
    """How the legend names each run: nothing for one run (the key says it all), the folder's name
    for several with distinct names, the path as given otherwise."""
    if len(run_dirs) == 1:
        return {run_dirs[0]: ""}
    names = {run_dir: Path(run_dir).name or run_dir for run_dir in run_dirs}
    distinct = len(set(names.values())) == len(names)
    return {run_dir: f"{names[run_dir] if distinct else run_dir} " for run_dir in run_dirs}


def figure(runs: dict[str, list[dict]]):
    """The matplotlib `Figure` of `runs` (run_dir -> its metrics records): loss and, for
    classifiers, accuracy (train solid, eval dashed), and tokens/s or examples/s from 0, against step."""
    from matplotlib.figure import Figure

    shown = panels(runs)
    drawn = Figure(figsize=(8, 3 * len(shown)), layout="constrained")
    axes = drawn.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    names = labels(list(runs))
    for ax, (title, lines) in zip(axes, shown):
        for index, (run_dir, records) in enumerate(runs.items()):
            for key, style in lines:
                steps, values = series(records, key)
                if steps:
                    ax.plot(steps, values, style, color=f"C{index}", marker="." if len(steps) < 30 else None,
                            label=f"{names[run_dir]}{key}")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
        if title == FROM_ZERO:
            ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("step")
    return drawn


def plot(run_dirs: list[str], out: str | None = None) -> Path:
    """Draws the runs' `figure` into a PNG at `out` (default: `default_out`); returns its path."""
    runs = {run_dir: read_metrics(Path(run_dir)) for run_dir in run_dirs}  # every run checked before drawing
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("plot needs matplotlib; pip install 'jaxdist[plot]'")
    path = Path(out) if out else default_out(run_dirs)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(runs).savefig(path, dpi=100)
    return path
