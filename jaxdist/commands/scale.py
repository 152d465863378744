"""`jaxdist scale CONFIG --hosts N`: what the recipe moves over which link on N hosts, its checkpoint
writes and the layout to pick, on paper (`jaxdist.observe.scaling`); nothing runs on a device."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments

HELP = "print communication, checkpoint and layout numbers for N hosts"
OFFLINE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file or recipe name (the model)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument("--hosts", type=arguments.COUNT, required=True, help="number of hosts")
    parser.add_argument("--gpus-per-host", type=arguments.COUNT, default=8)
    parser.add_argument("--batch-per-gpu", type=arguments.COUNT,
                        help="sequences per GPU (default: the recipe's train.global_batch)")
    parser.add_argument("--network-gbs", type=arguments.AMOUNT, default=50.0, help="GB/s per GPU between hosts")
    parser.add_argument("--nvlink-gbs", type=arguments.AMOUNT, default=450.0, help="GB/s per GPU inside a host")
    parser.add_argument("--storage-gbs", type=arguments.AMOUNT, default=2.0, help="checkpoint write GB/s per host")


def run(args: argparse.Namespace) -> None:
    from jaxdist.observe import scaling

    hardware = scaling.Hardware(network_bw=args.network_gbs * 1e9, nvlink_bw=args.nvlink_gbs * 1e9,
                                storage_bw=args.storage_gbs * 1e9)
    cfg = arguments.config_with_data_sizes(args)
    print(scaling.report(cfg, args.hosts, args.gpus_per_host, args.batch_per_gpu, hardware))
