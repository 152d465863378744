"""`jaxdist train | rules | bench | plan | config show | build-kernels | data prepare | launch | doctor | scale | export |
sample | plot`: the command line.

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
import logging
import os
import re
import signal
import sys
import threading
import time

# Only the standard library and jaxdist.errors (which imports nothing more): anything that imports
# JAX is imported inside main(), where a Ctrl-C that lands during an import is the one-line exit 130.
from jaxdist.errors import NonFiniteError, Terminated, UserError, check_local, check_writable, cli_number, discard_output

# The exit codes of a command a signal stopped (128 + the signal, what a shell reports for a program
# that signal ended): stdout's reader gone (SIGPIPE), Ctrl-C (SIGINT), SIGTERM before the steps.
STDOUT_CLOSED_EXIT = 128 + signal.SIGPIPE
INTERRUPTED_EXIT = 128 + signal.SIGINT
TERMINATED_EXIT = 128 + signal.SIGTERM


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
        from jaxdist.checkpoint.run import library_versions

        print(", ".join(f"{name} {version}" for name, version in library_versions().items()))
        parser.exit(0)


# Command-line numbers: counts and sizes are positive; an index or a number of extra steps may be 0.
_COUNT = cli_number(int)
_INDEX = cli_number(int, allow_zero=True)
_AMOUNT = cli_number(float)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="jaxdist", description="Train models on many accelerators with one program.")
    parser.add_argument("--version", action=_Version)
    processes = parser.add_argument_group("multi-process (default: JAX_* / torchrun / SLURM / MPI env, else one)")
    processes.add_argument("--coordinator", help="host:port of process 0's coordinator")
    processes.add_argument("--num-processes", type=_COUNT, help="number of processes in the run")
    processes.add_argument("--process-id", type=_INDEX, help="this process's id, 0..num-processes-1")
    processes.add_argument("--init-timeout", type=_COUNT, help="seconds for all processes to join (default 300)")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train (or resume) a run from a YAML config"),
        ("rules", "print each parameter's logical names, mesh spec and bytes per device"),
        ("bench", "time the train step on random tokens: step time, tokens/s, MFU, memory"),
        ("plan", "compile the train step without running it: memory per device, FLOPs, what fits"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", help="YAML config file, or a recipe's name (e.g. tiny, gpt_406m)")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
        if name == "train":
            command.add_argument("--restart", action="store_true",
                                 help="start over in a run_dir that holds an earlier run: its metrics, TensorBoard "
                                      "events and checkpoints are moved to run_dir/replaced-<time>/ first")
        if name == "bench":
            command.add_argument("--steps", type=_COUNT, default=30,
                                 help="timed steps, in windows of 10 (the median window is reported)")
            command.add_argument("--warmup", type=_INDEX, default=5, help="untimed steps after compiling")
            command.add_argument("--out", help="append the JSON result to this file")
            command.add_argument("--devices", type=_COUNT, help="use only the first N devices")
            command.add_argument("--profile", help="trace three extra steps with the JAX profiler into this folder")
            command.add_argument("--checkpoint", metavar="DIR",
                                 help="also measure what saving checkpoints into DIR costs the loop: each save's "
                                      "blocking time (the first apart), the steps beside a write, the restore")
            command.add_argument("--bubble", action="store_true",
                                 help="with a pipeline: also time one device on its share of the batch, unpipelined, "
                                      "and report the measured bubble (1 - that step time / the pipeline's), split "
                                      "into what the pipeline's microbatch size costs one device and the rest")
        if name == "plan":
            count = command.add_mutually_exclusive_group()
            count.add_argument("--devices", type=_COUNT,
                               help="plan for N devices (on a CPU-only machine: N simulated devices)")
            count.add_argument("--mock-gpus", type=_COUNT, metavar="N",
                               help="on a GPU host: compile for N GPUs of its kind, on one of them (the rest are "
                                    "not needed): each GPU's memory, and the collectives XLA's schedule waits for")
            command.add_argument("--device-memory", help="memory per device, e.g. 80GB: say whether it fits, "
                                 "and suggest a change that does")
    # The metavar names the choices where argparse would name the dest ("required: config_command").
    show = commands.add_parser("config", help="print configs").add_subparsers(dest="config_command", required=True,
                                                                               metavar="{show}")
    show = show.add_parser("show", help="print every config key with its value, type and meaning")
    show.add_argument("config", nargs="?", help="YAML config file or recipe name (default: the defaults)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    show.add_argument("--format", choices=("table", "markdown"), default="table",
                      help="table: aligned columns; markdown: a heading and a table per section, and every "
                           "model's keys (docs/config.md is this, for the defaults)")
    commands.add_parser("build-kernels", help="build the C++ GPU kernels into the cache (train and bench do it on "
                        "a GPU): one line per kernel, built, up to date or unavailable and why")
    launch = commands.add_parser("launch", help="run a command as N processes on this host")
    launch.add_argument("-n", "--num", type=_COUNT, required=True, help="number of processes")
    launch.add_argument("--devices-per-process", type=_COUNT, default=1,
                        help="GPUs (or simulated CPU devices) per process (default 1)")
    launch.add_argument("--timeout", type=_AMOUNT, metavar="SECONDS",
                        help="stop every process (exit 124) when none printed a line, on stdout or stderr, for "
                             "this long (default: off); any line counts as progress and only process 0 logs "
                             "steps, so allow for start-up, compiling and log.every steps")
    launch.add_argument("--max-restarts", type=_INDEX, default=0,
                        help="start the whole group again after a process failed (not a user error), up to this "
                             "many times; train resumes from the newest complete checkpoint (default 0)")
    launch.add_argument("--min-processes", type=_COUNT, metavar="M",
                        help="elastic: each restart leaves the failed process out, down to M processes; the run "
                             "resumes on the smaller mesh with the same train.global_batch (default: restart all)")
    launch.add_argument("--log", metavar="FILE",
                        help="where libraries' notes (gloo connections, preemption notices) go instead of the "
                             "terminal (default: jaxdist-launch-<pid>.log in the temporary folder)")
    launch.add_argument("--verbose", action="store_true", help="relay libraries' notes too, like any line")
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- train CONFIG [overrides]")
    doctor = commands.add_parser("doctor", help="check devices and collectives on every mesh axis")
    doctor.add_argument("--config", help="YAML config whose mesh to check (default: data = process count)")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.tensor=2")
    doctor.add_argument("--megabytes", type=_AMOUNT, default=64.0, help="buffer per device for bandwidth")
    scale = commands.add_parser("scale", help="print communication, checkpoint and layout numbers for N hosts")
    scale.add_argument("config", help="YAML config file or recipe name (the model)")
    scale.add_argument("overrides", nargs="*", help="dotted overrides")
    scale.add_argument("--hosts", type=_COUNT, required=True, help="number of hosts")
    scale.add_argument("--gpus-per-host", type=_COUNT, default=8)
    scale.add_argument("--batch-per-gpu", type=_COUNT, help="sequences per GPU (default: the recipe's train.global_batch)")
    scale.add_argument("--network-gbs", type=_AMOUNT, default=50.0, help="GB/s per GPU between hosts")
    scale.add_argument("--nvlink-gbs", type=_AMOUNT, default=450.0, help="GB/s per GPU inside a host")
    scale.add_argument("--storage-gbs", type=_AMOUNT, default=2.0, help="checkpoint write GB/s per host")
    data = commands.add_parser("data", help="prepare datasets").add_subparsers(dest="data_command", required=True,
                                                                                metavar="{prepare}")
    _data_prepare_arguments(data.add_parser("prepare", help="tokenize text, JSONL or Parquet files, or resize an "
                                            "image folder (a subfolder per class), into ArrayRecord shards"))
    plot = commands.add_parser("plot", help="draw runs' train and eval loss and tokens/s against step into an image "
                               "(PNG by default)")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories with metrics.jsonl")
    plot.add_argument("--out", help="image file, .png, .pdf, .svg or another format matplotlib writes "
                                    "(default: RUN_DIR/plot.png for one run, ./plot.png for several)")
    export = commands.add_parser("export", help="write a run's checkpointed params (and BatchNorm statistics) as one "
                                 ".safetensors or .npz file, or as a Hugging Face model folder")
    export.add_argument("run_dir", help="run directory with checkpoints/")
    export.add_argument("out", help="output file, ending in .safetensors or .npz; with --format hf, a new folder")
    export.add_argument("--step", type=_INDEX, help="checkpoint step (default: the newest)")
    sample = commands.add_parser("sample", help="continue a prompt with a run's checkpointed language model (KV cache)")
    sample.add_argument("run_dir", help="run directory with checkpoints/")
    sample.add_argument("overrides", nargs="*", help="dotted overrides of the run's config, e.g. mesh.fsdp=8")
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--tokens", type=_COUNT, default=100, help="tokens to generate (at most up to model.seq_len)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    sample.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the likeliest tokens up to "
                                                                 "this probability (1: all)")
    sample.add_argument("--rows", type=_COUNT, default=1, help="continuations to sample")
    sample.add_argument("--seed", type=_INDEX, default=0)
    sample.add_argument("--step", type=_INDEX, help="checkpoint step (default: the newest)")
    export.add_argument("--format", choices=("file", "hf"), default="file",
                        help="file: jaxdist's own names in one file; hf: config.json, safetensors and tokenizer files "
                             "that transformers loads (GPT-2 and Llama-family models)")
    return parser


def _data_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxdist.data import tokenizer as tokenizer_lib

    parser.add_argument("inputs", nargs="+",
                        help="text, JSON lines (.jsonl, .ndjson, .json) or .parquet files, or directories of "
                             "them; or one folder with a subfolder of PNG/JPEG images per class")
    parser.add_argument("--out", required=True, help="new directory for the shards and manifest.json")
    parser.add_argument("--eval-fraction", type=float,
                        help="share of documents (default 0.01) or of each class's images (default 0.1) held out for eval")
    parser.add_argument("--records-per-shard", type=_COUNT, help="records per shard file (default 4096)")
    text = parser.add_argument_group("text")
    text.add_argument("--tokenizer",
                      help=f"one of {', '.join(tokenizer_lib.TOKENIZERS)} (default byte), or the path of a Hugging "
                           f"Face tokenizer.json")
    text.add_argument("--vocab-size", type=_COUNT, help="sentencepiece vocabulary size (default 4096)")
    text.add_argument("--chunk-tokens", type=_COUNT, help="tokens per ArrayRecord record (default 4096)")
    text.add_argument("--text-key", help="JSON lines field / Parquet column holding the text (default text)")
    image = parser.add_argument_group("image folder")
    image.add_argument("--image-size", type=_COUNT,
                       help="side of the square every image is resized and center-cropped to (default 32)")
    image.add_argument("--grayscale", action="store_true", default=None,
                       help="keep one gray channel instead of converting to RGB")


# `data prepare` options of one input form only (None: not given): giving one for the other form is a mistake.
_TEXT_OPTIONS = {"--tokenizer": "tokenizer", "--vocab-size": "vocab_size", "--chunk-tokens": "chunk_tokens",
                 "--text-key": "text_key"}
_IMAGE_OPTIONS = {"--image-size": "image_size", "--grayscale": "grayscale"}
_SHARED_OPTIONS = ("eval_fraction", "records_per_shard")


def _data_prepare(args) -> None:
    from jaxdist.data import images, prepare

    folder = images.image_folder(args.inputs)
    if folder is not None:
        own, other, form = _IMAGE_OPTIONS, _TEXT_OPTIONS, "an image folder"
    else:
        own, other, form = _TEXT_OPTIONS, _IMAGE_OPTIONS, "text inputs"
    if given := [flag for flag, dest in other.items() if getattr(args, dest) is not None]:
        raise UserError(f"data prepare: {given[0]} does not apply to {form}; drop it")
    options = {dest: getattr(args, dest) for dest in (*own.values(), *_SHARED_OPTIONS) if getattr(args, dest) is not None}
    if folder is not None:
        print(images.summary(args.out, images.prepare(folder, args.out, **options)))
    else:
        print(prepare.summary(args.out, prepare.prepare(args.inputs, args.out, **options)))


def _train(args) -> None:
    from jaxdist import config, loop

    loop.train(config.load(args.config, args.overrides), restart=args.restart, started=args.started)


def _config_with_data_sizes(args):
    """The command's config with the model's `auto` sizes taken from its data, as `train` takes them."""
    from jaxdist import config
    from jaxdist.checkpoint import hf
    from jaxdist.data import loader

    return loader.resolve_model(hf.resolve(config.load(args.config, args.overrides)))


def _rules(args) -> None:
    from jaxdist import loop
    from jaxdist.parallel import rules
    from jaxdist.train.trainer import param_layouts

    cfg = _config_with_data_sizes(args)
    table = rules.sharding_table(param_layouts(cfg))
    loop.log(table)  # process 0 only


def _first_devices(args) -> list | None:
    """The first `--devices` devices (None: all); a `UserError` where there are fewer."""
    import jax

    if not args.devices:
        return None
    if jax.device_count() < args.devices:
        raise UserError(f"{args.command} --devices {args.devices}: only {jax.device_count()} devices here; pass at "
                        f"most {jax.device_count()} (on a CPU-only machine JAXDIST_CPU_DEVICES sets how many)")
    return jax.devices()[: args.devices]


def _plan(args) -> None:
    from jaxdist.observe import memory as plan

    import jax

    from jaxdist import kernels

    limit = plan.parse_bytes(args.device_memory) if args.device_memory else None
    if args.mock_gpus and jax.devices()[0].platform != "gpu":
        raise UserError(f"plan --mock-gpus {args.mock_gpus}: compiling for GPUs that are not there needs one that "
                        f"is (a GPU host with JAX's CUDA plugin); JAX runs on {jax.devices()[0].platform} here")
    devices = _first_devices(args)
    cfg = _config_with_data_sizes(args)
    built = kernels.build_for(cfg.model)  # the kernels the step will load, as train builds them
    text = plan.report(cfg, devices, limit)
    if built and jax.process_index() == 0:
        print(built)
    if jax.process_index() == 0:
        print(text)


def _bench(args) -> None:
    from jaxdist.observe import timing as bench

    devices = _first_devices(args)
    # Before compiling and timing, which these paths would otherwise fail only after.
    if args.out:
        check_writable(args.out, f"bench: --out={args.out}")
    if args.profile:
        check_writable(args.profile, f"bench: --profile={args.profile}", directory=True)
    if args.checkpoint:
        check_writable(args.checkpoint, f"bench: --checkpoint={args.checkpoint}", directory=True)
    cfg = _config_with_data_sizes(args)
    result = bench.run(cfg, args.steps, args.warmup, devices, args.profile, args.bubble, args.checkpoint)
    bench.write(result, args.out)


def _config_show(args) -> None:
    from pathlib import Path

    from jaxdist import config

    path, overrides = args.config, args.overrides
    if path is not None and "=" in path and not Path(path).exists():  # only overrides were given
        path, overrides = None, [path, *overrides]
    cfg = config.load(path, overrides)
    if args.format == "markdown":
        print(_config_markdown(cfg, [*([path] if path is not None else []), *overrides]), end="")
        return
    rows = [("key", "value", "type", "meaning"), *config.describe(cfg)]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])


# The section of the keys that belong to no section (`seed`, `run_dir`).
_TOP_LEVEL = "top level"


def _config_markdown(cfg, given: list[str]) -> str:
    """`cfg`'s keys as markdown: a heading and a table per section; after the configured model's and
    optimizer's sections, each other registered one's (`model.name` and `optim.name` pick one, and
    each has its own keys) with the defaults of its keys. Built from `config.describe` and
    `config.load` alone."""
    from jaxdist import config

    rows = config.describe(cfg)
    sections: dict[str, list] = {}
    for row in rows:
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else _TOP_LEVEL, []).append(row)
    command = " ".join(["jaxdist config show", *given, "--format markdown"])
    lines = ["# Configuration reference", ""]
    if given:
        lines += [f"Generated by `{command}`.", ""]
    else:
        lines += ["Generated from the config classes: do not edit it by hand; regenerate it with",
                  f"`{command} > docs/config.md`.", ""]
    lines += ["Every key with its value (the defaults, where no config is given), its type and what it means, one",
              "table per section. `jaxdist config show [CONFIG.yaml] [dotted.key=value ...]` prints the same for",
              "a config; `model.name` picks the model and `optim.name` the optimizer, and each has its own keys.", ""]
    for section, section_rows in sections.items():
        if section not in ("model", "optim"):
            lines += _markdown_section(section, section_rows)
            continue
        name_row = next(row for row in rows if row[0] == f"{section}.name")
        lines += _markdown_section(f"{section} ({section}.name={name_row[1]})", section_rows)
        for other in name_row[2].split("|"):
            if other != name_row[1]:
                other_rows = [row for row in config.describe(config.load(None, [f"{section}.name={other}"]))
                              if row[0].startswith(f"{section}.")]
                lines += _markdown_section(f"{section} ({section}.name={other}, its defaults)", other_rows)
    return "\n".join(lines)


def _markdown_section(title: str, rows) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    return [f"## {title}", "", "| key | value | type | meaning |", "|---|---|---|---|",
            *(f"| `{key}` | `{cell(value)}` | {cell(kind)} | {cell(meaning)} |" for key, value, kind, meaning in rows),
            ""]


def _build_kernels(args) -> int:
    import jax

    from jaxdist import kernels

    statuses = kernels.build_kernels()
    for status in statuses:
        print(status, flush=True)
    # Off a GPU the kernels are not needed, so one that can't be built there is no failure.
    failed = any(status.state == "unavailable" for status in statuses)
    return 1 if failed and jax.default_backend() == "gpu" else 0


def _launch(args) -> int:
    from jaxdist.commands import launch

    return launch.launch(args.num, args.devices_per_process, args.program, args.timeout,
                         max_restarts=args.max_restarts, notes=args.log, verbose=args.verbose,
                         min_processes=args.min_processes)


def _doctor(args) -> int:
    from jaxdist.observe import mesh_health as doctor

    return doctor.run(doctor.load_config(args.config, args.overrides), args.megabytes)


def _scale(args) -> None:
    from jaxdist.observe import scaling as scale

    hardware = scale.Hardware(network_bw=args.network_gbs * 1e9, nvlink_bw=args.nvlink_gbs * 1e9,
                                storage_bw=args.storage_gbs * 1e9)
    cfg = _config_with_data_sizes(args)
    print(scale.report(cfg, args.hosts, args.gpus_per_host, args.batch_per_gpu, hardware))


def _export(args) -> None:
    from jaxdist import checkpoint

    import jax

    if args.format == "hf":
        from jaxdist.checkpoint import hf

        step, files = hf.export(args.run_dir, args.out, args.step)
        if jax.process_index() == 0:
            print(f"wrote a Hugging Face folder (params at step {step}) to {args.out}: {', '.join(files)}")
        return
    if jax.process_count() > 1:
        raise UserError(f"export {args.out}: one file is written by one process; run it alone, or use --format hf, "
                        f"which gathers the parameters across processes")
    step, count = checkpoint.export_params(args.run_dir, args.out, args.step)
    print(f"wrote {count} arrays (params at step {step}) to {args.out}")


def _sample(args) -> None:
    import jax

    from jaxdist.commands import sample
    from jaxdist.train.generate import Sampling

    sampling = Sampling(args.tokens, args.temperature, args.top_p, args.rows, args.seed)
    text = sample.run(args.run_dir, args.prompt, sampling, args.step, args.overrides)
    if jax.process_index() == 0:
        print(text)


def _plot(args) -> None:
    from jaxdist.commands import plot

    print(f"wrote {plot.plot(args.run_dirs, args.out)}")


# The arguments that name a folder or file to read or write, by command: (the command as the user
# writes it, its (dest, argument name) pairs).
_PATHS = {
    "export": ("export", (("run_dir", "RUN_DIR"), ("out", "OUT"))),
    "sample": ("sample", (("run_dir", "RUN_DIR"),)),
    "data": ("data prepare", (("inputs", "INPUTS"), ("out", "--out"))),
    "plot": ("plot", (("run_dirs", "RUN_DIR"), ("out", "--out"))),
    "bench": ("bench", (("out", "--out"), ("profile", "--profile"), ("checkpoint", "--checkpoint"))),
}


def _check_local_paths(args) -> None:
    """A path argument that names object storage (gs://, s3://, any URL) is one line, before the
    command starts: read as a local path, it would make folders named `gs:` in the working directory."""
    command, arguments = _PATHS.get(args.command, ("", ()))
    for dest, name in arguments:
        value = getattr(args, dest)
        for path in value if isinstance(value, list) else [value]:
            if path is not None:
                check_local(path, f"{command}: {name}={path}")


# Commands that never run JAX on this process's devices, so they do not join a process group.
_OFFLINE = {"launch", "scale", "data", "build-kernels", "plot", "config"}


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
    _check_local_paths(args)
    from jaxdist import runtime  # imports JAX, so only after parsing: --help and usage errors need none

    if args.command == "plan" and args.devices and not os.environ.get("JAXDIST_CPU_DEVICES"):
        # Simulated where there is no accelerator.
        runtime.use_cpu_devices(args.devices, f"plan --devices {args.devices}")
    if args.command == "plan" and args.mock_gpus:
        runtime.mock_gpus(args.mock_gpus)
    runtime.remember_interrupts()
    runtime.use_cpu_devices()
    runtime.gpu_defaults()
    runtime.compilation_cache()
    if args.command not in _OFFLINE:
        from jaxdist.parallel import distributed

        distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.init_timeout)
    commands = {
        "train": _train, "rules": _rules, "bench": _bench, "plan": _plan, "build-kernels": _build_kernels,
        "launch": _launch, "doctor": _doctor, "scale": _scale, "data": _data_prepare, "export": _export,
        "plot": _plot, "config": _config_show, "sample": _sample,
    }
    code = commands[args.command](args) or 0
    if runtime.interrupted():
        raise runtime.interruption()  # one that a garbage-collector callback dropped
    return code


if __name__ == "__main__":
    sys.exit(main())
