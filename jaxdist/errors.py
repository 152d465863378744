"""The exceptions the CLI turns into one line on stderr and an exit code, the one-line warning, the
command line's checked numbers, the checks that a path is local and that an output path can be
written, and what to do with an output whose reader is gone.

`UserError` (exit code 2, before any compile): a mistake in the input; messages name the config
key, the value and the fix. `NonFiniteError` (exit code 3): training stopped at a non-finite step,
with nothing of that step saved. `Terminated` (exit code 143): a SIGTERM outside the training steps.
"""

import argparse
import importlib
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType


class UserError(Exception):
    """A mistake in the user's input (config, data, command line); not a bug in jaxdist."""


class NonFiniteError(Exception):
    """A step's loss or gradients were not finite (or its loss spiked) and `train.on_nonfinite` says
    to stop; the message names the step and the last sane checkpoint.

    `first_bad_step`: the first of the bad steps in a row that ended the run; the checkpoints from
    the step before it on hold a diverging run (None: no step was bad, the parameters were).
    """

    def __init__(self, message: str, first_bad_step: int | None = None):
        super().__init__(message)
        self.first_bad_step = first_bad_step


class Terminated(KeyboardInterrupt):
    """A SIGTERM outside the training steps (while a command starts, or the step compiles): it stops
    the command as a Ctrl-C does, with the same one line, and exit code 143 (128 + SIGTERM) where a
    Ctrl-C's is 130."""


def warn(message: str) -> None:
    """Prints `jaxdist: warning: <message>` on stderr, from process 0 only."""
    import jax  # here, not at the top: the command line imports this module before it may import JAX

    if jax.process_index() == 0:
        print(f"jaxdist: warning: {message}", file=sys.stderr, flush=True)


def optional_import(module: str, extra: str, purpose: str) -> ModuleType:
    """Imports `module`, an optional dependency; if it is missing, a `UserError` naming the extra
    that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{purpose} needs {module.partition('.')[0]}; pip install 'jaxdist[{extra}]'") from None


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


# A URL's scheme and its "://" (RFC 3986: a letter, then letters, digits, "+", "-" or "."): gs://, s3://, file://.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def not_local(path: str, what: str) -> str | None:
    """Why `path` cannot be used, where it names object storage or another URL (`gs://bucket/x`,
    `s3://`, any `scheme://`), else None. jaxdist reads and writes local (or mounted) paths only:
    such a path would be read as local folders named `gs:` and so on. `what` names the path as the
    user gave it (e.g. `run_dir=gs://bucket/run`)."""
    scheme = _URL.match(path)
    if scheme is None:
        return None
    return (f"{what} names object storage or another URL ({scheme[0]}), which jaxdist does not read or write yet; "
            f"use a local path, or mount the bucket (gcsfuse, mountpoint-s3) and give the path it is mounted at")


def check_local(path: str, what: str) -> None:
    """Raises a `UserError` if `path` names object storage or another URL (`not_local`)."""
    if problem := not_local(path, what):
        raise UserError(problem)


def check_writable(path: str | Path, what: str, directory: bool = False) -> None:
    """Raises a `UserError` unless `path` can be written: a file, or with `directory` a directory.

    Creates the missing folders (with `directory`, `path` too) and writes a scratch file in the one
    that will hold the output, so a path that cannot be written fails before any expensive work.
    `what` names the path in the message, as the user gave it (e.g. `export: OUT=model.npz`).
    """
    path = Path(path)
    folder = path if directory else path.parent
    if path.is_dir() and not directory:
        raise UserError(f"{what} is a directory; name the file to write")
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir():
        raise UserError(f"{what} cannot be written: {existing} is a file, not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UserError(f"{what} cannot be written ({err.strerror}: {err.filename}); pick a writable path") from None


def discard_output(stream) -> None:
    """Points `stream`, whose reader is gone (a closed pipe: `jaxdist config show | head`), at the
    null device, so what is still buffered, later writes and the interpreter's final flush succeed
    instead of raising `BrokenPipeError` again."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    finally:
        os.close(null)
