"""What several verbs' arguments share: the number types, CONFIG with its overrides, and the config
and devices they name."""

from __future__ import annotations

import argparse

from jaxdist.errors import UserError, cli_number

# Command-line numbers: counts and sizes are positive; an index or a number of extra steps may be 0.
COUNT = cli_number(int)
INDEX = cli_number(int, allow_zero=True)
AMOUNT = cli_number(float)


def add_config(parser: argparse.ArgumentParser) -> None:
    """The CONFIG argument (a file or a recipe's name) and its dotted overrides."""
    parser.add_argument("config", help="YAML config file, or a recipe's name (e.g. tiny, gpt_406m)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")


def config_with_data_sizes(args: argparse.Namespace):
    """The verb's config with the model's `auto` sizes taken from its data, as `train` takes them."""
    from jaxdist import config
    from jaxdist.checkpoint import hf_folder
    from jaxdist.data import loader

    return loader.resolve_model(hf_folder.resolve(config.load(args.config, args.overrides)))


def first_devices(args: argparse.Namespace) -> list | None:
    """The first `--devices` devices (None: all); a `UserError` where there are fewer."""
    import jax

    if not args.devices:
        return None
    if jax.device_count() < args.devices:
        raise UserError(f"{args.command} --devices {args.devices}: only {jax.device_count()} devices here; pass at "
                        f"most {jax.device_count()} (on a CPU-only machine JAXDIST_CPU_DEVICES sets how many)")
    return jax.devices()[: args.devices]
