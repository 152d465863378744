"""`jaxdist bench CONFIG [overrides]`: times the real train step on random examples and prints the
result as one JSON line (what it measures, and how: `jaxdist.observe.timing`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxdist.commands import arguments
from jaxdist.errors import check_writable

HELP = "time the train step on random tokens: step time, tokens/s, MFU, memory"
LOCAL_PATHS = (("out", "--out"), ("profile", "--profile"), ("checkpoint", "--checkpoint"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_config(parser)
    parser.add_argument("--steps", type=arguments.COUNT, default=30,
                        help="timed steps, in windows of 10 (the median window is reported)")
    parser.add_argument("--warmup", type=arguments.INDEX, default=5, help="untimed steps after compiling")
    parser.add_argument("--out", help="append the JSON result to this file")
    parser.add_argument("--devices", type=arguments.COUNT, help="use only the first N devices")
    parser.add_argument("--profile", help="trace three extra steps with the JAX profiler into this folder")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="also measure what saving checkpoints into DIR costs the loop: each save's "
                             "blocking time (the first apart), the steps beside a write, the restore")
    parser.add_argument("--bubble", action="store_true",
                        help="with a pipeline: also time one device on its share of the batch, unpipelined, "
                             "and report the measured bubble (1 - that step time / the pipeline's), split "
                             "into what the pipeline's microbatch size costs one device and the rest")


def run(args: argparse.Namespace) -> None:
    import jax

    from jaxdist.observe import timing

    devices = arguments.first_devices(args)
    # Before compiling and timing, which these paths would otherwise fail only after.
    if args.out:
        check_writable(args.out, f"bench: --out={args.out}")
    if args.profile:
        check_writable(args.profile, f"bench: --profile={args.profile}", directory=True)
    if args.checkpoint:
        check_writable(args.checkpoint, f"bench: --checkpoint={args.checkpoint}", directory=True)
    cfg = arguments.config_with_data_sizes(args)
    result = timing.measure(cfg, args.steps, args.warmup, devices, args.profile, args.bubble, args.checkpoint)
    line = json.dumps(result)
    if jax.process_index() == 0:
        print(line, flush=True)
        if args.out:
            with Path(args.out).open("a") as out:
                out.write(line + "\n")
