"""What a save costs the training loop under each way of copying the state off the devices.

    PYTHONPATH=. python benchmarks/bench_checkpoint.py gpt_406m [key=value ...] --dir /tmp/ckpt
        [--host-copies numpy,pinned,device] [--saves 4]

Builds the config's trainer once (random batch, as `jaxdist bench`), then measures each host copy
in turn with `jaxdist.observe.checkpoint_cost.measure` (the measurement behind `jaxdist bench
--checkpoint`): the loop's cost of a save (the first apart), the host's blocking time, the write's
duration, the step beside a write, the restore and the bytes. Prints one JSON line per host copy
and a table last. `numpy` needs one process.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax

import jaxdist
from jaxdist import config as config_lib
from jaxdist.checkpoint.store import HOST_COPIES
from jaxdist.observe import checkpoint_cost, timing
from jaxdist.train.trainer import Trainer

COLUMNS = ("host_copy", "first_save_loop_cost_s", "save_loop_cost_s", "save_blocked_s", "write_s", "step_s",
           "synced_step_s", "synced_step_during_write_s", "restore_s", "checkpoint_bytes")


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--dir", required=True, help="where to write the checkpoints (emptied first)")
    parser.add_argument("--host-copies", default=",".join(HOST_COPIES))
    parser.add_argument("--saves", type=int, default=4)
    args = parser.parse_args()

    cfg = config_lib.load(args.config, args.overrides)
    trainer = Trainer.from_config(cfg)
    batch = trainer.global_batch(timing.random_batch(cfg, trainer.process_rows(cfg.train.global_batch).rows))
    timing.time_steps(trainer, batch, steps=10, warmup=5)
    rows = []
    for how in args.host_copies.split(","):
        directory = Path(args.dir) / how
        shutil.rmtree(directory, ignore_errors=True)
        result = checkpoint_cost.measure(trainer, batch, cfg, directory, saves=args.saves, host_copy=how)
        shutil.rmtree(directory, ignore_errors=True)
        result.update(device=jax.devices()[0].device_kind, config=args.config, overrides=args.overrides)
        print(json.dumps(result), flush=True)
        rows.append(result)
    print("  ".join(f"{column:>14}" for column in COLUMNS))
    for row in rows:
        print("  ".join(f"{str(row[column]):>14}" for column in COLUMNS))


if __name__ == "__main__":
    main()
