"""`jaxdist plan CONFIG [overrides]`: compiles the train step without running it and prints its
memory per device and FLOPs, and what fits (what it reports, and how: `jaxdist.observe.memory`)."""

from __future__ import annotations

import argparse
import os
import re

from jaxdist.commands import arguments
from jaxdist.errors import UserError

HELP = "compile the train step without running it: memory per device, FLOPs, what fits"

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_config(parser)
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--devices", type=arguments.COUNT,
                       help="plan for N devices (on a CPU-only machine: N simulated devices)")
    count.add_argument("--mock-gpus", type=arguments.COUNT, metavar="N",
                       help="on a GPU host: compile for N GPUs of its kind, on one of them (the rest are "
                            "not needed): each GPU's memory, and the collectives XLA's schedule waits for")
    parser.add_argument("--device-memory", help="memory per device, e.g. 80GB: say whether it fits, "
                        "and suggest a change that does")


def settings(args: argparse.Namespace) -> None:
    """The devices to plan for, set before JAX starts: `--devices` simulated where there is no
    accelerator, `--mock-gpus` GPUs of this host's kind."""
    from jaxdist import runtime

    if args.devices and not os.environ.get("JAXDIST_CPU_DEVICES"):
        runtime.use_cpu_devices(args.devices, f"plan --devices {args.devices}")
    if args.mock_gpus:
        runtime.mock_gpus(args.mock_gpus)


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '16GiB' -> 16 x 2^30, '1e9' -> 1e9; a `UserError` naming the option otherwise."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--device-memory {text!r}: give a positive size such as 80GB or 16GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def run(args: argparse.Namespace) -> None:
    import jax

    from jaxdist import kernels
    from jaxdist.observe import memory

    limit = parse_bytes(args.device_memory) if args.device_memory else None
    if args.mock_gpus and jax.devices()[0].platform != "gpu":
        raise UserError(f"plan --mock-gpus {args.mock_gpus}: compiling for GPUs that are not there needs one that "
                        f"is (a GPU host with JAX's CUDA plugin); JAX runs on {jax.devices()[0].platform} here")
    devices = arguments.first_devices(args)
    cfg = arguments.config_with_data_sizes(args)
    built = kernels.build_for(cfg.model)  # the kernels the step will load, as train builds them
    text = memory.report(cfg, devices, limit)
    if built and jax.process_index() == 0:
        print(built)
    if jax.process_index() == 0:
        print(text)
