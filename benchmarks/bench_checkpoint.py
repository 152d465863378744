"""Async checkpoint overhead: step time with a checkpoint after every step vs. without.

    JAXDIST_CPU_DEVICES=8 python benchmarks/bench_checkpoint.py [jaxdist/recipes/tiny.yaml] [key=value ...]
        [--segments 4] [--steps-per-segment 10]

One trainer trains in alternating segments, without saving and with an async Orbax save after
every step (as `checkpoint.every=1` does in the loop), so both see the same machine load. Each
step is timed through the loss being read back (as the loop's `log.every=1` does). Prints the
median step time of each mode, their ratio, and how long each save blocked the loop. The save
returns once the arrays are off the devices and the write overlaps the next step (a save first
waits for the previous write); where the step keeps every core busy, as on a CPU-only machine,
the save's CPU shows up as step time wherever it runs.

With `--restores N`, it measures restoring instead: the initial state is saved once, then restored
N times with checksum verification and N times without, alternating, and the verification's
share of a restore is printed (see benchmarks/README.md for the 406M numbers).

Measured on the 2-core CPU machine (tiny config, 8 simulated devices, 9.1 MB per checkpoint,
~0.5 s steps), twelve runs: ratio 1.051-1.104, median 1.067 (11 below 1.10), the loop blocked
32-38 ms per save; before one process wrote whole host arrays (docs/checkpoints.md, "Cost"):
1.147-1.173 and 51-56 ms in the same session.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

import jaxdist
from jaxdist import checkpoint
from jaxdist import config as config_lib
from jaxdist.data import loader
from jaxdist.train.trainer import Trainer


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="jaxdist/recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--segments", type=int, default=4, help="segments of each mode, alternating")
    parser.add_argument("--steps-per-segment", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="first steps of a segment left out")
    parser.add_argument("--restores", type=int, default=0, help="time N restores of each kind instead")
    args = parser.parse_args()

    cfg = config_lib.load(args.config, args.overrides)
    trainer = Trainer.from_config(cfg)
    if args.restores:
        bench_restore(cfg, trainer, args)
        return
    batches = loader.train_iterator(cfg)
    batch = trainer.global_batch(next(batches))
    trainer.compile(batch)

    times: dict[str, list[float]] = {"none": [], "every_step": []}
    blocked: list[float] = []
    step = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = checkpoint.Checkpoints(Path(tmp) / "checkpoints", keep=2)
        for segment in range(args.segments * 2 + 1):  # a first, untimed segment warms both paths up
            mode = "every_step" if segment % 2 else "none"
            for index in range(args.steps_per_segment):
                start = time.perf_counter()
                metrics = trainer.step(batch)
                batch = trainer.global_batch(next(batches))
                float(metrics["loss"])
                step += 1
                if mode == "every_step" or segment == 0:
                    save_start = time.perf_counter()
                    position = checkpoint.DataPosition(step, step * cfg.train.global_batch)
                    store.save(step, trainer.state, checkpoint.run_meta(cfg, trainer.mesh, position))
                    blocked.append(time.perf_counter() - save_start)
                if segment and index >= args.skip:
                    times[mode].append(time.perf_counter() - start)
        store.close()
        size = sum(f.stat().st_size for f in store.path(store.last_saved).rglob("*") if f.is_file())

    plain, saving = statistics.median(times["none"]), statistics.median(times["every_step"])
    blocked_s = statistics.median(blocked[args.steps_per_segment:])
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "config": args.config,
        "overrides": args.overrides, "timed_steps_per_mode": len(times["none"]),
        "checkpoint_mb": round(size / 2**20, 2), "median_step_s_no_save": round(plain, 5),
        "median_step_s_save_every_step": round(saving, 5), "median_blocked_in_save_s": round(blocked_s, 5),
    }), file=sys.stderr)
    print(f"step time with a checkpoint every step / without: {saving / plain:.3f} "
          f"({saving * 1e3:.1f} ms vs {plain * 1e3:.1f} ms; {size / 2**20:.1f} MB per checkpoint, "
          f"the loop blocked {blocked_s * 1e3:.1f} ms per save)")


def bench_restore(cfg, trainer: Trainer, args) -> None:
    """Median restore time with and without checksum verification, and of the digests alone."""
    target = checkpoint.abstract_state(trainer.state)
    times: dict[str, list[float]] = {"verified": [], "unverified": [], "digests_alone": []}
    with tempfile.TemporaryDirectory() as tmp:
        with checkpoint.Checkpoints(Path(tmp) / "checkpoints") as store:
            start = time.perf_counter()
            store.save(0, trainer.state, {"step": 0})
            store.wait()
            save_s = time.perf_counter() - start
            for leaf in jax.tree.leaves(trainer.state):  # never hold the state twice
                leaf.delete()
            size = sum(f.stat().st_size for f in store.path(0).rglob("*") if f.is_file())
            for _ in range(args.restores + 1):  # the first pair compiles the digest and warms the cache
                for mode in ("verified", "unverified"):
                    start = time.perf_counter()
                    state = jax.block_until_ready(store.restore(0, target, verify=mode == "verified").state)
                    times[mode].append(time.perf_counter() - start)
                start = time.perf_counter()
                checkpoint.array_digests(checkpoint.named_arrays(state))
                times["digests_alone"].append(time.perf_counter() - start)
                del state
    median = {mode: statistics.median(values[1:]) for mode, values in times.items()}
    params = sum(x.size for x in jax.tree.leaves(target.params))
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "config": args.config,
        "overrides": args.overrides, "params": params, "checkpoint_mb": round(size / 2**20, 1),
        "save_s": round(save_s, 2), "restores_each": args.restores,
        **{f"median_{mode}_s": round(value, 3) for mode, value in median.items()},
        "all_s": {mode: [round(v, 3) for v in values] for mode, values in times.items()},
    }), file=sys.stderr)
    print(f"restore with verification / without: {median['verified'] / median['unverified']:.3f} "
          f"({median['verified']:.2f} s vs {median['unverified']:.2f} s; the digests alone "
          f"{median['digests_alone']:.2f} s, {median['digests_alone'] / median['unverified']:.1%} of a restore; "
          f"{size / 2**20:.0f} MB checkpoint)")


if __name__ == "__main__":
    main()
