"""Does profile-guided latency estimation (PGLE) give XLA's scheduler a better step? A probe.

    python3 scripts/probe_pgle.py CONFIG [overrides]     # e.g. data parallel on 2 GPUs

Builds the step as `jaxdist bench` does, times it, profiles three steps, then recompiles the same
lowered step in place with compiler options (the latency-hiding scheduler; with a collective
inflation factor; with the profile as `fdo_profile`, once and twice) and times each, in one
process. BENCHMARKS.md, sixth round: no option changed data parallel's step on 2 H200s.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import tempfile

import jax
from jax.experimental import profiler as exp_profiler

import jaxdist
from jaxdist import config
from jaxdist.observe import bench
from jaxdist.train.trainer import Trainer

LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}


def timed(trainer, batch) -> float:
    """Median step time (ms), timed as `jaxdist bench` does."""
    windows, _, _ = bench.time_steps(trainer, batch, steps=30, warmup=5)
    return round(statistics.median(windows) * 1e3, 2)


def profile(trainer, batch, steps: int = 3) -> bytes:
    """The per-instruction profile (XLA's ProfiledInstructionsProto) of `steps` steps."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            metrics = trainer.step(batch)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        run = [p for p in glob.glob(os.path.join(folder, "plugins/profile/*/")) if os.path.isdir(p)][-1]
        return exp_profiler.get_profiled_instructions_proto(run)


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    cfg = config.load(sys.argv[1], sys.argv[2:])
    trainer = Trainer.from_config(cfg)
    batch = trainer.global_batch(bench.random_tokens(cfg))
    trainer.compile(batch)
    # The probe swaps the trainer's compiled step for recompiled ones (private attributes).
    lowered = trainer._step.lower(trainer.state, trainer._current_copies(), batch)
    results = {"default": timed(trainer, batch)}
    fdo = profile(trainer, batch)
    variants = {
        "lhs": LHS,
        "lhs inflation=3": {**LHS, "xla_gpu_collective_inflation_factor": 3},
        "pgle": {**LHS, "fdo_profile": fdo},
        "pgle overlap_limit=2": {**LHS, "fdo_profile": fdo, "xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    }
    for name, options in variants.items():
        trainer._compiled = lowered.compile(compiler_options=options)
        results[name] = timed(trainer, batch)
        if name == "pgle":  # profile the PGLE step itself and schedule once more with that
            trainer._compiled = lowered.compile(compiler_options={**LHS, "fdo_profile": profile(trainer, batch)})
            results["pgle x2"] = timed(trainer, batch)
        print(name, results[name], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
