"""What checkpointing costs a training loop (`jaxdist bench --checkpoint`).

On a compiled trainer: steps are timed in windows of `window` steps with no sync inside, first
without saves, then with one save at the start of each window, as the loop saves (after the step's
flag is read). A save's cost to the loop is its window's time over a window without one: the
host's blocking part, the device's copy off its buffers ahead of the next step, and whatever the
write in the background takes from the steps beside it. Reported apart: the first save (whatever
a save compiles is compiled before it, as the loop does), the host's blocking time, the time
until the write is complete, the step time while a write runs, the restore of the last save
(read, checked against its digests, placed), and the checkpoint's bytes on disk.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import jax

from jaxdist.checkpoint.resume import DataPosition
from jaxdist.checkpoint.policy import run_meta
from jaxdist.checkpoint.restore import abstract_state
from jaxdist.checkpoint.store import Checkpoints, HostCopy, default_host_copy


def measure(trainer, batch: dict, cfg, directory: str | Path, saves: int = 4, window: int = 10,
            host_copy: HostCopy | None = None) -> dict[str, Any]:
    """Times `saves` saves of `trainer.state` into `directory` (see the module docstring); the
    trainer must be compiled and warmed up. Returns the figures in seconds and bytes."""
    how = host_copy or default_host_copy(trainer.state)
    store = Checkpoints(directory, keep=1, host_copy=how)
    started = time.perf_counter()
    store.start_warm_up(trainer.state)
    store.warm_up(trainer.state)
    warm_up_s = time.perf_counter() - started
    plain = [_window(trainer, batch, window) for _ in range(3)]
    alone = statistics.median(_synced_step(trainer, batch) for _ in range(window))
    step = int(jax.device_get(trainer.state.step))
    costs, blocked, writes, during = [], [], [], []
    for _ in range(saves):
        jax.block_until_ready(trainer.state)
        began = time.perf_counter()
        step = int(jax.device_get(trainer.state.step))
        meta = run_meta(cfg, trainer.mesh, DataPosition(step, step * cfg.train.global_batch))
        store.save(step, trainer.state, meta)
        blocked.append(time.perf_counter() - began)
        stepped = []
        for _ in range(window):
            if store.writing is not None and store.poll() is None:  # this step runs beside the write
                stepped.append(_synced_step(trainer, batch))
            else:
                trainer.step(batch)
        jax.block_until_ready(trainer.state)
        costs.append(time.perf_counter() - began - statistics.median(plain))
        store.wait()
        writes.append(store.last_write_s)
        during += stepped[1:]  # the first step after a save also waits for the copy off the devices
    target = abstract_state(trainer.state)
    began = time.perf_counter()
    restored = store.restore(step, target)
    jax.block_until_ready(restored.state)
    restore_s = time.perf_counter() - began
    size = sum(path.stat().st_size for path in store.path(step).rglob("*") if path.is_file())
    store.close()
    step_s = statistics.median(plain) / window
    return {
        "host_copy": how,
        "checkpoint_bytes": size,
        "checkpoint_programs_s": round(warm_up_s, 3),
        "first_save_loop_cost_s": round(costs[0], 3),
        "save_loop_cost_s": round(statistics.median(costs[1:] or costs), 3),
        "first_save_blocked_s": round(blocked[0], 3),
        "save_blocked_s": round(statistics.median(blocked[1:] or blocked), 3),
        "write_s": round(statistics.median(writes), 2),
        "step_s": round(step_s, 4),
        # Each step synced, beside a write and without one.
        "synced_step_s": round(alone, 4),
        "synced_step_during_write_s": round(statistics.median(during), 4) if during else None,
        "restore_s": round(restore_s, 2),
    }


def _synced_step(trainer, batch: dict) -> float:
    began = time.perf_counter()
    jax.block_until_ready(trainer.step(batch))
    return time.perf_counter() - began


def _window(trainer, batch: dict, steps: int) -> float:
    began = time.perf_counter()
    metrics = None
    for _ in range(steps):
        metrics = trainer.step(batch)
    jax.block_until_ready(metrics)
    return time.perf_counter() - began
