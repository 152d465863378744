"""`jaxdist plot RUN_DIR...`: train and eval loss, throughput (tokens/s or examples/s) and, for
classifiers, accuracy, for a mixture of experts its load and balancing loss, against step, one image (PNG, or any format matplotlib writes) for one or
several runs, read from each run's `metrics.jsonl`.

Keys a line lacks, or holds as null, leave a gap in that line's curve; nothing else is required
of a run beyond some logged steps with values. Needs matplotlib (the `plot` extra); drawing uses
its Agg canvas through `Figure`, so no pyplot state or backend setting is touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

from jaxdist.errors import UserError, check_writable

HELP = "draw runs' train and eval loss and tokens/s against step into an image (PNG by default)"
OFFLINE = True
LOCAL_PATHS = (("run_dirs", "RUN_DIR"), ("out", "--out"))

METRICS = "metrics.jsonl"
# (panel title, [(metrics key, line style)]) top to bottom; a panel no run has values for is left out.
PANELS = (
    ("loss", [("loss", "-"), ("eval_loss", "--")]),
    ("throughput", [("tokens_per_sec", "-"), ("examples_per_sec", "-")]),
    ("accuracy", [("accuracy", "-"), ("eval_accuracy", "--")]),
    # A mixture of experts: the most and least loaded expert against the mean, the balancing loss.
    ("experts", [("moe_load_max", "-"), ("moe_load_min", "--"), ("moe_aux_loss", ":")]),
)
# Its axis starts at 0, so that noise looks like noise.
FROM_ZERO = "throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories with metrics.jsonl")
    parser.add_argument("--out", help="image file, .png, .pdf, .svg or another format matplotlib writes "
                                      "(default: RUN_DIR/plot.png for one run, ./plot.png for several)")


def run(args: argparse.Namespace) -> None:
    print(f"wrote {plot(args.run_dirs, args.out)}")


def read_metrics(run_dir: Path) -> list[dict]:
    """The JSON objects of `run_dir`'s metrics.jsonl, in order."""
    path = run_dir / METRICS
    if not path.is_file():
        raise UserError(f"plot: {run_dir} has no {METRICS}; pass a run_dir written by `jaxdist train`")
    text = path.read_text(encoding="utf-8", errors="replace")  # bytes that are not UTF-8 fail as JSON
    lines = text.splitlines()
    records, first_bad = [], None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        # A run stopped while writing leaves a partial last line, without its newline: not a bad file.
        elif line.strip() and first_bad is None and (number < len(lines) or text.endswith("\n")):
            first_bad = number
    if not records and first_bad is not None:
        raise UserError(f"plot: {path} is not valid metrics JSON (line {first_bad} is not a JSON object); "
                        f"pass a run_dir written by `jaxdist train`")
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
    if not shown:
        keys = ", ".join(key for _, lines in PANELS for key, _ in lines)
        raise UserError(f"plot: {', '.join(runs)} logged no value of {keys} (each is null or missing); "
                        f"plot once a run has logged some")
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
    """Draws the runs' `figure` into an image at `out` (default: `default_out`), in the format its
    suffix names (any matplotlib writes); returns its path."""
    runs = {run_dir: read_metrics(Path(run_dir)) for run_dir in run_dirs}  # every run checked before drawing
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("plot needs matplotlib; pip install 'jaxdist[plot]'")
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(out) if out else default_out(run_dirs)
    # Without a known suffix matplotlib would fail, or write PNG to another name than `out`.
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lower().lstrip(".") not in formats and not path.is_dir():
        raise UserError(f"plot: --out={path} must end in a format matplotlib writes: "
                        f"{', '.join('.' + name for name in sorted(formats))}")
    check_writable(path, f"plot: --out={path}")
    figure(runs).savefig(path, dpi=100)
    return path
