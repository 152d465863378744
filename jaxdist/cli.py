"""`jaxdist train | rules | bench | data prepare`: the command line. Exit codes: 0 done, 1 crash, 2 user error."""

from __future__ import annotations

import argparse
import sys

from jaxdist.data import prepare
from jaxdist.errors import UserError


class _OneLineErrors(argparse.ArgumentParser):
    """Command-line mistakes are user errors too: one line on stderr, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"jaxdist: error: {message} (see jaxdist --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="jaxdist", description="Train models on many accelerators with one program.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train (or resume) a run from a YAML config"),
        ("rules", "print each parameter's logical names, mesh spec and bytes per device"),
        ("bench", "time the train step on random tokens: step time, tokens/s, MFU, memory"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="YAML config file")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
        if name == "bench":
            command.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
            command.add_argument("--warmup", type=int, default=5, help="untimed steps after compiling")
            command.add_argument("--out", help="append the JSON result to this file")
            command.add_argument("--devices", type=int, help="use only the first N devices")
            command.add_argument("--profile", help="trace three extra steps with the JAX profiler into this folder")
    data = commands.add_parser("data", help="prepare datasets").add_subparsers(dest="data_command", required=True)
    prepare.add_arguments(data.add_parser("prepare", help="tokenize text, JSONL or Parquet files into ArrayRecord shards"))
    return parser


def _train(args) -> None:
    from jaxdist import config
    from jaxdist.train import loop

    loop.train(config.load(args.config, args.overrides))


def _rules(args) -> None:
    from jaxdist import config
    from jaxdist.parallel import rules
    from jaxdist.train import loop

    print(rules.sharding_table(loop.param_layouts(config.load(args.config, args.overrides))))


def _bench(args) -> None:
    from jaxdist import config
    from jaxdist.observe import bench

    import jax

    devices = jax.devices()[: args.devices] if args.devices else None
    result = bench.run(config.load(args.config, args.overrides), args.steps, args.warmup, devices, args.profile)
    bench.write(result, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options (`bench CONFIG --steps 5 train.steps=1`).
    unknown = [arg for arg in extra if "=" not in arg or arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        {"train": _train, "rules": _rules, "bench": _bench, "data": prepare.run}[args.command](args)
    except UserError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
