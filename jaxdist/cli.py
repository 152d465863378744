"""`jaxdist train | rules | data prepare`: the command line. Exit codes: 0 done, 1 crash, 2 user error."""

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
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="YAML config file")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"train": _train, "rules": _rules, "data": prepare.run}[args.command](args)
    except UserError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
