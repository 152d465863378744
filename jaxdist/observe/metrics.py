"""Metrics writers and what they measure beside the step. Only process 0 writes; every other
process gets a writer that does nothing.

`metrics.jsonl` is strict JSON: a non-finite value (a NaN loss) is written as null. TensorBoard
gets the same values under `run_dir/tb`, `eval_` keys as `eval/...` and the others as `train/...`;
so does W&B with `log.wandb=true` (observe/wandb_log.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from jax.sharding import Mesh

from jaxdist.errors import UserError

if TYPE_CHECKING:
    from jaxdist.observe.wandb_log import WandbRun

# Dense bf16 peak FLOP/s per device from the datasheets, matched on substrings of `device_kind`.
PEAK_FLOPS_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` (non-finite values as null), adds
    each value to TensorBoard's event files in `run_dir/tb` and, given one, to a W&B run; does
    nothing without `run_dir`."""

    def __init__(self, run_dir: Path | None, wandb: WandbRun | None = None):
        self._path = None if run_dir is None else run_dir / "metrics.jsonl"
        self._file = open(self._path, "a") if run_dir is not None else None
        self._tensorboard = _tensorboard_writer(run_dir / "tb") if run_dir is not None else None
        self._wandb = wandb

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self._file is not None:
            strict = {k: v if math.isfinite(v) else None for k, v in record.items()}
            try:
                self._file.write(json.dumps(strict, allow_nan=False) + "\n")
                self._file.flush()
            except OSError as err:  # a full disk, say: one line, not a traceback
                raise UserError(f"could not write {self._path} at step {step} ({err.strerror}); free space in "
                                f"run_dir or pick another, then run the same command to resume") from None
        if self._tensorboard is not None:
            for key, value in record.items():
                # A gap, as in metrics.jsonl; tensorboardX would also log a warning per value.
                if key != "step" and math.isfinite(value):
                    self._tensorboard.add_scalar(tensorboard_tag(key), value, step)
        if self._wandb is not None:
            self._wandb.log(step, {k: float(v) for k, v in metrics.items()})

    def close(self) -> None:
        """Closes the files and finishes the W&B run. A failure to finish the files (a full disk) is
        not raised here: the run stops on the write that failed first, and its error is the one to report."""
        for close in (self._file, self._tensorboard):
            if close is not None:
                try:
                    close.close()  # flushes
                except OSError:
                    pass
        if self._wandb is not None:
            self._wandb.close()


def _tensorboard_writer(directory: Path):
    # Imported here, not with jaxdist: importing tensorboardX sets CRC32C_SW_MODE in the environment.
    from tensorboardX import SummaryWriter
    return SummaryWriter(str(directory))


def tensorboard_tag(key: str) -> str:
    """`eval_loss` -> `eval/loss`, `loss` -> `train/loss`."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak FLOP/s of a device kind ("NVIDIA H100 80GB HBM3"), None where unknown (CPU)."""
    return next((peak for name, peak in PEAK_FLOPS_BF16.items() if name in device_kind), None)


def mfu(flops_per_item: float, items_per_sec_per_device: float, device_kind: str) -> float | None:
    """Model FLOPs utilization: the model's FLOP/s per device (FLOPs per token or example times
    tokens or examples per second) over the device's peak; None where unknown."""
    peak = peak_flops(device_kind)
    return None if peak is None else flops_per_item * items_per_sec_per_device / peak


def throughput(examples_per_sec: float, tokens_per_example: int | None) -> dict[str, float]:
    """`tokens_per_sec` for a model of token sequences, else `examples_per_sec`."""
    if tokens_per_example is None:
        return {"examples_per_sec": examples_per_sec}
    return {"tokens_per_sec": examples_per_sec * tokens_per_example}


def device_metrics(flops_per_example: float, examples_per_sec: float, mesh: Mesh) -> dict[str, float]:
    """`mfu` over the mesh's devices where their peak is known, and the memory in use on this
    process's first device where the platform reports it."""
    device = mesh.local_devices[0]
    values = memory_gb(device)
    utilization = mfu(flops_per_example, examples_per_sec / mesh.devices.size, device.device_kind)
    return values if utilization is None else {"mfu": utilization, **values}


def memory_gb(device) -> dict[str, float]:
    """`memory_gb` and `peak_memory_gb` (bytes in use now and at most so far, in GB) of a device;
    empty where the platform keeps no statistics (CPU)."""
    stats = device.memory_stats()
    if stats is None:
        return {}
    return {"memory_gb": stats["bytes_in_use"] / 1e9, "peak_memory_gb": stats["peak_bytes_in_use"] / 1e9}


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
