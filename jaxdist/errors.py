"""The one exception type for a user's mistake, and the command line's checked numbers.

Anything raised as `UserError` is printed by the CLI as a single line on stderr and exits with
code 2, before any compile. Messages name the config key, the value and the fix.
"""

import argparse
import math


class UserError(Exception):
    """A mistake in the user's input (config, data, command line); not a bug in jaxdist."""


def cli_number(kind: type[int] | type[float], allow_zero: bool = False):
    """An argparse `type=` that reads a positive `kind` (with `allow_zero`, a non-negative one).

    Anything else raises `argparse.ArgumentTypeError`, which argparse reports as a usage error.
    """
    what = f"a {'non-negative' if allow_zero else 'positive'} {'integer' if kind is int else 'number'}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse
