"""`jaxdist train CONFIG [overrides]`: trains a run, or resumes it; the loop itself is `jaxdist.loop`."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments

HELP = "train (or resume) a run from a YAML config"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_config(parser)
    parser.add_argument("--restart", action="store_true",
                        help="start over in a run_dir that holds an earlier run: its metrics, TensorBoard "
                             "events and checkpoints are moved to run_dir/replaced-<time>/ first")


def run(args: argparse.Namespace) -> None:
    from jaxdist import config, loop

    loop.train(config.load(args.config, args.overrides), restart=args.restart, started=args.started)
