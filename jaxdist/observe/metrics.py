"""Metrics writers and what they measure beside the step. Only process 0 writes; every other
process gets a writer that does nothing.

`metrics.jsonl` is strict JSON: a non-finite value (a NaN loss) is written as null. TensorBoard
gets the same values under `run_dir/tb`, `eval_` keys as `eval/...` and the others as `train/...`;
so does W&B with `log.wandb=true` (observe/wandb_log.py). The files are written and flushed on a
background thread, one logged step at a time: the loop never waits on the disk, a crash loses at
most the step being written, and a disk that fails (full) or stops answering (a lost mount) is
reported by the loop's next `write`, as one line, never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from jaxdist import atomic
from jaxdist.errors import UserError, warn

if TYPE_CHECKING:  # an annotation only: the metrics files are written and read without importing JAX
    from jax.sharding import Mesh

# Dense bf16 peak FLOP/s per device from the datasheets, matched on substrings of `device_kind`.
PEAK_FLOPS_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}
# A logged step not written after this long means the file system has stopped answering.
STUCK_AFTER_S = 120.0
# How long `close` waits for the steps not yet written.
CLOSE_WAIT_S = 10.0
# Where a resume moves the metrics.jsonl lines that are no logged step: this, then the UTC time.
METRICS_SET_ASIDE = "metrics.jsonl.set-aside-"
_EVENT_FILES = itertools.count()


class StepLog(Protocol):
    """Another place a run's logged steps go (a W&B run: observe/wandb_log.py)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` (non-finite values as null), adds
    each value to TensorBoard's event files in `run_dir/tb` and, given one, to a W&B run; does
    nothing without `run_dir`.

    `resumed_at`: the step a resumed run restarts after; TensorBoard is told to drop the events of
    later steps that earlier runs wrote (its purge), as `metrics.jsonl` drops their lines."""

    def __init__(self, run_dir: Path | None, wandb: StepLog | None = None, resumed_at: int | None = None):
        self._path = None if run_dir is None else run_dir / "metrics.jsonl"
        self._wandb = wandb
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: str | None = None
        self._writing: tuple[int, float] | None = None  # (step, since) of the step being written
        self._thread = None
        if run_dir is not None:
            self._thread = threading.Thread(target=self._write_all, args=(run_dir, resumed_at),
                                            name="jaxdist-metrics-writer", daemon=True)
            self._thread.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Queues a logged step's values; raises `UserError` if an earlier step could not be written."""
        self.check()
        values = {k: float(v) for k, v in metrics.items()}
        if self._thread is not None:
            self._pending.put((step, values, time.monotonic()))
        if self._wandb is not None:
            self._wandb.log(step, values)

    def check(self) -> None:
        """Raises `UserError` if the writer failed, or has been stuck on one step for too long."""
        if self._failure is not None:
            raise UserError(self._failure)
        writing = self._writing
        if writing is not None and time.monotonic() - writing[1] > STUCK_AFTER_S:
            raise UserError(f"could not write {self._path}: step {writing[0]}'s line has not been written for "
                            f"{STUCK_AFTER_S:.0f} s (is the file system stuck?); fix it, then run the same "
                            f"command to resume")

    def _write_all(self, run_dir: Path, resumed_at: int | None) -> None:
        files = None
        try:
            files = _Files(run_dir, resumed_at)
            while (item := self._pending.get()) is not None:
                step, values, queued = item
                self._writing = (step, queued)
                files.write(step, values)
                self._writing = None
        except OSError as err:  # a full disk, say: one line, not a traceback
            what = err.filename or self._path
            self._failure = (f"could not write {what} ({err.strerror}); free space in run_dir or pick another, "
                             f"then run the same command to resume")
        finally:
            if files is not None:
                files.close()

    def close(self) -> None:
        """Writes what is queued (waiting at most `CLOSE_WAIT_S`) and finishes the W&B run; a
        failure here is not raised: the run stops on the write that failed first."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(CLOSE_WAIT_S)
        if self._wandb is not None:
            self._wandb.close()

    @property
    def stuck(self) -> bool:
        """Whether the writer thread is still running after `close` (a file system that stopped answering)."""
        return self._thread is not None and self._thread.is_alive()


class _Files:
    """metrics.jsonl and the TensorBoard event file, written and flushed one step at a time."""

    def __init__(self, run_dir: Path, resumed_at: int | None):
        self._jsonl: TextIO = open(run_dir / "metrics.jsonl", "a")
        self._events = _tensorboard_events(run_dir / "tb", resumed_at)

    def write(self, step: int, values: dict[str, float]) -> None:
        """Appends one step to both files and flushes them; an `OSError` names the file that failed."""
        record = {"step": step, **values}
        strict = {k: v if math.isfinite(v) else None for k, v in record.items()}
        with _naming(self._jsonl.name):
            self._jsonl.write(json.dumps(strict, allow_nan=False) + "\n")
            self._jsonl.flush()
        # A non-finite value is a gap, as in metrics.jsonl.
        with _naming(self._events._file_name):
            self._events.write_event(_scalars_event(step, {k: v for k, v in values.items() if math.isfinite(v)}))
            self._events.flush()

    def close(self) -> None:
        for file in (self._jsonl, self._events):
            try:
                file.close()
            except OSError:
                pass


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """An `OSError` inside names `path` (a write's error carries no file name)."""
    try:
        yield
    except OSError as err:
        raise OSError(err.errno, err.strerror, err.filename or path) from err


def _tensorboard_events(directory: Path, resumed_at: int | None) -> Any:
    # Imported here, not with jaxdist: importing tensorboardX sets CRC32C_SW_MODE in the environment.
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    directory.mkdir(parents=True, exist_ok=True)
    # The file's name holds the second it was made in: the pid and a count keep two of one second apart.
    with _naming(str(directory)):
        events = EventsWriter(str(directory / "events"), filename_suffix=f".{os.getpid()}.{next(_EVENT_FILES)}")
        if resumed_at is not None:
            # TensorBoard drops the events of earlier files at or after a session start's step.
            events.write_event(Event(step=resumed_at + 1, wall_time=time.time(),
                                     session_log=SessionLog(status=SessionLog.START)))
        events.flush()
    return events


def _scalars_event(step: int, values: dict[str, float]) -> Any:
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tensorboard_tag(key), simple_value=value) for key, value in values.items()])
    return Event(step=step, wall_time=time.time(), summary=summary)


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
    """Removes the `metrics.jsonl` lines of steps after `step` (they are run again after a resume).

    A line that is no logged step (one cut short by a killed process, or edited: not UTF-8, not JSON,
    not an object with an integer `step`) is moved to `metrics.jsonl.set-aside-<UTC time>`, named in
    one warning, never dropped. The file is replaced whole (`jaxdist.atomic`), and only where a line
    goes: a kill or a full disk meanwhile leaves it as it was."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    old = path.read_bytes()
    kept, malformed = split_history(old, step)
    if malformed:
        aside = atomic.set_aside_path(run_dir, METRICS_SET_ASIDE)
        atomic.write_bytes(aside, b"".join(line + b"\n" for _, line in malformed))
        warn(f"{path}: moved {len(malformed)} line(s) that are no logged step's JSON object (the first: line "
             f"{malformed[0][0]}) to {aside}; the other lines are kept")
    new = b"".join(line + b"\n" for line in kept)
    if new != old:
        atomic.write_bytes(path, new)


def split_history(data: bytes, step: int) -> tuple[list[bytes], list[tuple[int, bytes]]]:
    """The lines of `metrics.jsonl` (its bytes) of the steps up to `step`, and the lines that are no
    logged step, each with its line number; blank lines are neither."""
    kept, malformed = [], []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        logged = _logged_step(line)
        if logged is None:
            malformed.append((number, line))
        elif logged <= step:
            kept.append(line)
    return kept, malformed


def _logged_step(line: bytes) -> int | None:
    """The step a `metrics.jsonl` line logs; None where it is no logged step's JSON object."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
