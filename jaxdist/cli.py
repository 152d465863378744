"""`jaxdist train | rules | bench | plan | config show | build-kernels | data prepare | launch | doctor | scale | export |
sample | plot`: the command line. It parses the arguments and runs the verb's module in jaxdist/commands/
(`jaxdist.commands` says what each holds).

Exit codes: 0 done, 1 crash, 2 user error, 3 `train` stopped at a non-finite loss or gradients
(nothing of that step saved; the last checkpoint is intact), 130 interrupted (Ctrl-C) outside the
training steps (before them, or in the sample after them), 143 the same for a SIGTERM (one line,
`jaxdist: interrupted`, either way), 141 stdout closed (`jaxdist config show | head`:
the command stops quietly where its next output found the reader gone, as a program that SIGPIPE
stops; `train` first saves the last good state, as on any error); `launch` also 124 when it stopped a stuck run;
`build-kernels` 1 where a kernel is unavailable on a GPU. Before anything else every command
applies jaxdist's process-wide settings (`JAXDIST_CPU_DEVICES`, the XLA GPU flags:
`jaxdist.runtime`); every command that runs JAX then joins the other processes of the run
(`jaxdist.parallel.distributed.initialize`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading
import time
import types

# Only the standard library, jaxdist.errors and the verbs' modules, which import no JAX at their top:
# anything that imports JAX is imported inside main(), where a Ctrl-C that lands during an import is
# the one-line exit 130.
from jaxdist.commands import arguments
from jaxdist.errors import NonFiniteError, Terminated, UserError, check_local, discard_output

# The exit codes of a command a signal stopped (128 + the signal, what a shell reports for a program
# that signal ended): stdout's reader gone (SIGPIPE), Ctrl-C (SIGINT), SIGTERM before the steps.
STDOUT_CLOSED_EXIT = 128 + signal.SIGPIPE
INTERRUPTED_EXIT = 128 + signal.SIGINT
TERMINATED_EXIT = 128 + signal.SIGTERM

# The verbs, in `jaxdist --help`'s order; a verb of two words is a subcommand of its first.
VERBS = ("train", "rules", "bench", "plan", "config show", "build-kernels", "launch", "doctor", "scale",
         "data prepare", "plot", "export", "sample")
# The first words of the verbs of two words, and their lines in `jaxdist --help`.
GROUPS = {"config": "print configs", "data": "prepare datasets"}


class _OneLineErrors(argparse.ArgumentParser):
    """Command-line mistakes are user errors too: one line on stderr, exit code 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A word that starts with '-' and a digit is an option's value (`--device-memory -5GB`,
        # `--timeout -1e3`), which the option's type then refuses by name; Python 3.11's argparse
        # takes only plain negative numbers as values, and else says "expected one argument". No
        # jaxdist option is named like a number.
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str):
        self.exit(2, f"jaxdist: error: {message} (see jaxdist --help)\n")

    def exit(self, status: int = 0, message: str | None = None):
        sys.stdout.flush()  # --help and --version output meets a closed pipe inside main(), not at exit
        super().exit(status, message)


class _Version(argparse.Action):
    """`--version`: jaxdist's version and those of the libraries it runs on (looked up only when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the versions of jaxdist, Python and its libraries")

    def __call__(self, parser, namespace, values, option_string=None):
        from jaxdist.checkpoint.policy import library_versions

        print(", ".join(f"{name} {version}" for name, version in library_versions().items()))
        parser.exit(0)


def command_module(verb: str) -> types.ModuleType:
    """The module that runs `verb`: jaxdist/commands/<verb, with '-' and ' ' as '_'>.py."""
    return importlib.import_module(f"jaxdist.commands.{verb.replace('-', '_').replace(' ', '_')}")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="jaxdist", description="Train models on many accelerators with one program.")
    parser.add_argument("--version", action=_Version)
    processes = parser.add_argument_group("multi-process (default: JAX_* / torchrun / SLURM / MPI env, else one)")
    processes.add_argument("--coordinator", help="host:port of process 0's coordinator")
    processes.add_argument("--num-processes", type=arguments.COUNT, help="number of processes in the run")
    processes.add_argument("--process-id", type=arguments.INDEX, help="this process's id, 0..num-processes-1")
    processes.add_argument("--init-timeout", type=arguments.COUNT, help="seconds for all processes to join (default 300)")
    verbs = parser.add_subparsers(dest="command", required=True)
    groups = {}
    for verb in VERBS:
        group, _, word = verb.rpartition(" ")
        if group and group not in groups:
            words = [other.partition(" ")[2] for other in VERBS if other.startswith(group + " ")]
            # The metavar names the choices where argparse would name the dest ("required: config_command").
            groups[group] = verbs.add_parser(group, help=GROUPS[group]).add_subparsers(
                dest=f"{group}_command", required=True, metavar="{" + ",".join(words) + "}")
        module = command_module(verb)
        command = (groups[group] if group else verbs).add_parser(word, help=module.HELP)
        module.add_arguments(command)
        command.set_defaults(verb=verb)
    return parser


def _check_local_paths(args: argparse.Namespace, paths: tuple[tuple[str, str], ...]) -> None:
    """A path argument that names object storage (gs://, s3://, any URL) is one line, before the
    command starts: read as a local path, it would make folders named `gs:` in the working directory."""
    for dest, name in paths:
        value = getattr(args, dest)
        for path in value if isinstance(value, list) else [value]:
            if path is not None:
                check_local(path, f"{args.verb}: {name}={path}")


def main(argv: list[str] | None = None) -> int:
    """Runs the command `argv` (default: sys.argv[1:]) names; returns its exit code."""
    code = _main(argv)
    if any(thread.name.startswith(STUCK_WRITERS) and thread.is_alive() for thread in threading.enumerate()):
        # A write stuck in the file system (a lost mount): what the run had to say is said, and
        # interpreter shutdown could wait on it forever.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# Threads that write a run's files; one still alive as the command ends is stuck in the file system.
STUCK_WRITERS = ("jaxdist-checkpoint-writer", "jaxdist-metrics-writer")


def _main(argv: list[str] | None) -> int:
    started = time.perf_counter()
    try:
        code = _run(argv, started)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not as the interpreter exits
        return code
    except BrokenPipeError:  # stdout's reader is gone (`jaxdist config show | head`)
        discard_output(sys.stdout)
        return STDOUT_CLOSED_EXIT
    except UserError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM before training started; once it runs, either saves
        # What the interrupt cut short (Orbax's async checkpointer, say) may fail as the process
        # exits, in a finalizer or in a background thread that logs or raises it: the promise is this
        # one line.
        sys.unraisablehook = lambda unraisable: None
        threading.excepthook = lambda failure: None
        logging.disable(logging.CRITICAL)
        print("jaxdist: interrupted", file=sys.stderr)
        return TERMINATED_EXIT if isinstance(err, Terminated) else INTERRUPTED_EXIT


def _run(argv: list[str] | None, started: float) -> int:
    from jaxdist.commands.launch import die_with_launcher

    die_with_launcher()  # a no-op unless `jaxdist launch` started this process
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options (`bench CONFIG --steps 5 train.steps=1`).
    unknown = [arg for arg in extra if "=" not in arg or arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.started = started
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)} ({args.command} takes no key=value overrides)")
    module = command_module(args.verb)
    _check_local_paths(args, getattr(module, "LOCAL_PATHS", ()))
    from jaxdist import runtime  # imports JAX, so only after parsing: --help and usage errors need none

    if settings := getattr(module, "settings", None):
        settings(args)
    previous_handlers = runtime.remember_interrupts()
    try:
        runtime.use_cpu_devices()
        runtime.gpu_defaults()
        runtime.compilation_cache()
        if not getattr(module, "OFFLINE", False):
            from jaxdist.parallel import distributed

            distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.init_timeout)
        code = module.run(args) or 0
        if runtime.interrupted():
            raise runtime.interruption()  # one that a garbage-collector callback dropped
        return code
    finally:
        runtime.restore_handlers(previous_handlers)


if __name__ == "__main__":
    sys.exit(main())
