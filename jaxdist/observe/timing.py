"""Timing the real train step (the `train` code path) on a fixed random batch: what `jaxdist bench`
measures; and `time_calls`, the kernel benchmarks' timer.

Any registered model: random tokens for the GPT, random pixels and labels for a classifier
(`ModelEntry.random_batch`). Warm-up steps are excluded; the step time is the median over windows
of timed steps. MFU is the model's training FLOPs per example (`ModelEntry.flops_per_example`)
times examples per second and device over the device's peak (989e12 on H100 and H200). For the
GPT that is the model FLOPs of the PaLM paper (Chowdhery et al. 2022, "PaLM: Scaling Language
Modeling with Pathways", appendix B, "model FLOPs utilization"): 6N + 12 L d s per token (its
12 L H Q T, with H heads of Q dimensions making d and T = s tokens), N the parameters of the
matmuls (the layers' weights and the output projection; no norms, biases or position embeddings):

    matmul_params   = 12 * layers * d * d + vocab * d
    flops_per_token = 6 * matmul_params + 12 * layers * d * seq
    MFU             = flops_per_token * tokens_per_sec_per_device / peak
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxdist import kernels, models
from jaxdist.config import Config, with_overrides
from jaxdist.errors import UserError
from jaxdist.models import dtypes
from jaxdist.observe import checkpoint_cost, clocks, hlo
from jaxdist.observe.metrics import mfu, throughput
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import pipeline
from jaxdist.train.trainer import Trainer


def random_batch(cfg: Config, rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The `rows` (default: all) of a global batch of random examples of the model drawn from
    `cfg.seed`: the same rows hold the same values on every process."""
    batch = models.get(cfg.model.name).random_batch(cfg, np.random.default_rng(cfg.seed), cfg.train.global_batch)
    return batch if rows is None else {key: value[np.asarray(rows)] for key, value in batch.items()}


def pipeline_schedule(cfg: Config, stages: int) -> dict:
    """The pipeline's microbatches, repeats, whether its transfers overlap compute and its
    theoretical bubble (`pipeline.Schedule.bubble`); bubble 0 without stages."""
    if stages == 1:
        return {"pipeline_bubble": 0.0}
    schedule = pipeline.Schedule.of(stages, cfg.pipeline)
    return {"pipeline_microbatches": schedule.microbatches, "pipeline_repeats": schedule.repeats,
            "pipeline_overlap_transfers": cfg.pipeline.overlap_transfers, "pipeline_bubble": round(schedule.bubble, 4)}


def peak_memory_bytes(devices) -> int | None:
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    return max(peaks) if all(p is not None for p in peaks) else None


def time_calls(fn, *args, repeats: int = 30) -> float:
    """Milliseconds per call of `fn(*args)` (after one untimed call), `repeats` calls queued
    without a sync between them: the kernel benchmarks' timer."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e3


def _windows(steps: int, size: int = 10) -> list[int]:
    """`steps` split into windows of about `size` steps (at least one window)."""
    return [size] * (steps // size) + ([steps % size] if steps % size else [])


def time_steps(trainer, batch: dict, steps: int, warmup: int,
               while_timed: contextlib.AbstractContextManager | None = None) -> tuple[list[float], list[float], dict]:
    """After `warmup` steps, `steps` steps of `trainer` timed: seconds per step of each window, the
    host's seconds in each step call, and the last step's metrics. `while_timed` is entered
    around the timed steps only (a `clocks.ClockSampler`)."""
    for _ in range(warmup):
        jax.block_until_ready(trainer.step(batch))
    # Steps are timed in windows with no sync inside, so host dispatch overlaps device work as
    # in training (a sync per step would add the dispatch latency to every step). Each window
    # still pays one dispatch and one sync: windows of 10 keep that under a tenth per step.
    times, dispatch = [], []
    with while_timed or contextlib.nullcontext():
        for window in _windows(steps):
            t0 = time.perf_counter()
            for _ in range(window):
                called = time.perf_counter()
                metrics = trainer.step(batch)
                dispatch.append(time.perf_counter() - called)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - t0) / window)
    return times, dispatch, metrics


def measure(cfg: Config, steps: int = 30, warmup: int = 5, devices: list | None = None, profile_dir: str | None = None,
        bubble: bool = False, checkpoint_dir: str | None = None) -> dict:
    """Builds the trainer as `train` does, then times `steps` steps after `warmup` steps.

    With `profile_dir`, three more steps are traced by the JAX profiler into that folder. With
    `bubble` (a pipelined config), the pipeline's measured bubble too (`measured_bubble`). With
    `checkpoint_dir`, what saving there costs the loop (`checkpoint_cost.measure`) under `checkpoint`.
    The model's `auto` sizes must be resolved (`jaxdist.data.loader.resolve_model`, as the
    `bench` command does).
    """
    if bubble:
        _check_bubble(cfg, devices)
    result = _time_trainer(cfg, steps, warmup, devices, profile_dir, checkpoint_dir)
    if bubble:
        result.update(measured_bubble(cfg, result, steps, warmup, devices))
    return result


def measured_bubble(cfg: Config, pipelined: dict, steps: int, warmup: int, devices: list | None = None) -> dict:
    """The pipeline's measured bubble beside `pipelined`, its `measure` result: one minus the step time of
    one device running the model unpipelined on one device's share of the global batch over the
    pipelined step time. It is the fraction of each device's time the pipeline spends beyond that
    device's share of the work: its idle iterations, transfers and whatever else it costs.

    The one-device run is the same config with `model.impl.scan_layers=false` (per-layer parameters, the
    fastest form without a pipeline) on the first device, so the model must fit on one device. It
    accumulates over the greatest common divisor of `train.microbatches` and its share of the batch:
    the pipeline accumulates over each batch shard, which the stage and tensor devices hold whole,
    so its count need not divide the smaller per-device share.

    A GPU computes small microbatches less efficiently than a whole share, and the pipeline's are
    small. So where the share is a whole number of the pipeline's microbatches, one device also runs
    it accumulated over microbatches of that size, and the measured bubble is split in two:
    `microbatch_cost`, what microbatches of the pipeline's size cost one device without any
    pipeline, and `pipeline_overhead_measured`, the rest (the idle iterations, the transfers, the
    pipeline's own work), which is what the schedule's theory (`pipeline_bubble`) describes.
    """
    share = cfg.train.global_batch // pipelined["devices"]
    microbatches = math.gcd(share, cfg.train.microbatches)
    baseline = _one_device(cfg, share, microbatches, steps, warmup, devices)
    result = {
        "one_device_global_batch": share,
        "one_device_microbatches": microbatches,
        "one_device_step_ms": baseline["step_ms"],
        "pipeline_bubble_measured": round(1 - baseline["step_ms"] / pipelined["step_ms"], 4),
    }
    # Rows of one pipeline microbatch.
    rows = max(1, layout_lib.from_config(cfg, devices).pipeline_rows(cfg.train.global_batch, cfg.train.microbatches)
               // cfg.pipeline.microbatches)
    if share % rows == 0 and share // rows != microbatches:
        same_size = _one_device(cfg, share, share // rows, steps, warmup, devices)
        result.update({
            "pipeline_microbatch_rows": rows,
            "one_device_at_pipeline_microbatches": share // rows,
            "one_device_at_pipeline_microbatches_step_ms": same_size["step_ms"],
            "microbatch_cost": round(1 - baseline["step_ms"] / same_size["step_ms"], 4),
            "pipeline_overhead_measured": round(1 - same_size["step_ms"] / pipelined["step_ms"], 4),
        })
    return result


def _one_device(cfg: Config, global_batch: int, microbatches: int, steps: int, warmup: int,
                devices: list | None) -> dict:
    """`cfg` unpipelined on the first device: `global_batch` rows accumulated over `microbatches`."""
    one_device = with_overrides(cfg, ["mesh.data=1", "mesh.stage=1", "mesh.fsdp=1", "mesh.tensor=1",
                                       f"train.global_batch={global_batch}", f"train.microbatches={microbatches}",
                                       "model.impl.scan_layers=false"])
    return _time_trainer(one_device, steps, warmup, (devices or jax.devices())[:1])


def _check_bubble(cfg: Config, devices: list | None) -> None:
    """Raises before anything is timed if `measured_bubble` cannot run for this config."""
    layout = layout_lib.from_config(cfg, devices)
    count = layout.mesh.devices.size
    if layout.mesh.shape["stage"] == 1:
        raise UserError("bench --bubble measures a pipeline's bubble: set mesh.stage > 1")
    if jax.process_count() > 1:
        raise UserError("bench --bubble times one device on its own: run it as one process")
    if cfg.train.global_batch % count:
        raise UserError(f"bench --bubble times one device on its share of the batch: train.global_batch="
                        f"{cfg.train.global_batch} must be a multiple of the {count} devices")


def _time_trainer(cfg: Config, steps: int, warmup: int, devices: list | None, profile_dir: str | None = None,
             checkpoint_dir: str | None = None) -> dict:
    """`measure` without the bubble: the trainer built, compiled and timed."""
    if auto := [f"model.{key}" for key in ("vocab", "classes", "image_shape") if getattr(cfg.model, key, None) == "auto"]:
        verb = "takes its value" if len(auto) == 1 else "take their values"
        raise UserError(f"{' and '.join(auto)} = auto {verb} from the data, and bench runs on random examples: "
                        f"set {'it' if len(auto) == 1 else 'them'}, or resolve the config with "
                        f"jaxdist.data.loader.resolve_model first")
    start = time.perf_counter()
    if (built := kernels.build_for(cfg.model)) and jax.process_index() == 0:
        print(built, flush=True)  # before compiling: the model only loads the kernels while traced
    trainer = Trainer.from_config(cfg, devices)
    batch = trainer.global_batch(random_batch(cfg, trainer.process_rows(cfg.train.global_batch).rows))
    trainer.compile(batch)
    setup_s = time.perf_counter() - start
    first_loss = float(trainer.step(batch)["loss"])  # the untrained model's: the same under any layout
    local = [d for d in trainer.mesh.devices.flatten() if d.process_index == jax.process_index()]
    sampler = clocks.ClockSampler(clocks.cuda_targets([d for d in local if d.platform == "gpu"]), notify=_on_process_0)
    times, dispatch, metrics = time_steps(trainer, batch, steps, warmup, while_timed=sampler)
    if profile_dir:
        # Back to back, as timed: a sync per step would hide waits that only happen while the
        # previous step is still running.
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(3):
                metrics = trainer.step(batch)
            jax.block_until_ready(metrics)
    step_s = statistics.median(times)
    saving = {} if checkpoint_dir is None else {
        "checkpoint": checkpoint_cost.measure(trainer, batch, cfg, Path(checkpoint_dir) / "checkpoints")}
    devices = trainer.mesh.devices.flatten().tolist()
    examples_per_sec = cfg.train.global_batch / step_s
    rates = throughput(examples_per_sec, cfg.model.tokens_per_example)  # tokens/s or examples/s
    rates.update({f"{key}_per_device": value / len(devices) for key, value in rates.items()})
    peak = peak_memory_bytes(local)
    utilization = mfu(models.get(cfg.model.name).flops_per_example(cfg), examples_per_sec / len(devices),
                      devices[0].device_kind)
    return {
        "name": "jaxdist",
        "layout": mesh_lib.describe(trainer.mesh),
        "rules": cfg.rules.preset,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "model": cfg.model.name,
        **cfg.model.summary(),
        "global_batch": cfg.train.global_batch,
        "microbatches": cfg.train.microbatches,
        "scan_layers": cfg.model.stacked_layers,
        "remat": getattr(getattr(cfg.model, "impl", None), "remat", "none"),
        "fp8": dtypes.policy(cfg.precision, devices[0].platform).fp8,
        **pipeline_schedule(cfg, trainer.mesh.shape["stage"]),
        "step_ms": round(step_s * 1e3, 2),
        "step_ms_min_window": round(min(times) * 1e3, 2),
        # Host time per step call. Near step_ms, the host waited for the device (on GPU, in
        # cuGraphLaunch while the previous step ran: harmless) or the device for the host; the
        # GPU idle time in `--profile` tells which.
        "dispatch_ms": round(statistics.median(dispatch) * 1e3, 2),
        **{key: round(value) for key, value in rates.items()},
        "mfu": round(utilization, 4) if utilization is not None else None,  # None where the peak is unknown (CPU)
        "peak_mem_gib": round(peak / 2**30, 2) if peak is not None else None,
        # The step's trace and lowering, and XLA's compile (a load where the compilation cache has it).
        "trace_s": round(trainer.trace_time_s, 3),
        "compile_s": round(trainer.compile_time_s, 3),
        "collective_mb": {
            opcode: {dtype: round(size / 2**20, 1) for dtype, size in by_dtype.items()}
            for opcode, by_dtype in hlo.bytes_per_call(trainer.compiled_text()).items()
        },
        "setup_s": round(setup_s, 1),
        "first_loss": first_loss,
        "loss": float(metrics["loss"]),
        # This process's GPUs during the timed steps (NVML; absent without it): the SM clock and
        # power the step time was measured at, and how often the power limit held the clock.
        **sampler.summary(),
        **saving,
    }


def _on_process_0(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)

