"""`jaxdist rules CONFIG [overrides]`: where each parameter lives under the config's rules."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments

HELP = "print each parameter's logical names, mesh spec and bytes per device"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_config(parser)


def run(args: argparse.Namespace) -> None:
    from jaxdist import loop
    from jaxdist.parallel import rules
    from jaxdist.train.trainer import param_layouts

    table = rules.sharding_table(param_layouts(arguments.config_with_data_sizes(args)))
    loop.log(table)  # process 0 only
