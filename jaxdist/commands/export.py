"""`jaxdist export RUN_DIR OUT [--step N] [--format file|hf]`: a run's checkpointed params (and
BatchNorm statistics) as one .safetensors or .npz file (`jaxdist.checkpoint.export`), or as a Hugging
Face model folder (`jaxdist.checkpoint.hf_folder`)."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments
from jaxdist.errors import UserError

HELP = ("write a run's checkpointed params (and BatchNorm statistics) as one .safetensors or .npz file, or as a "
        "Hugging Face model folder")
LOCAL_PATHS = (("run_dir", "RUN_DIR"), ("out", "OUT"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory with checkpoints/")
    parser.add_argument("out", help="output file, ending in .safetensors or .npz; with --format hf, a new folder")
    parser.add_argument("--step", type=arguments.INDEX, help="checkpoint step (default: the newest)")
    parser.add_argument("--format", choices=("file", "hf"), default="file",
                        help="file: jaxdist's own names in one file; hf: config.json, safetensors and tokenizer "
                             "files that transformers loads (GPT-2 and Llama-family models)")


def run(args: argparse.Namespace) -> None:
    import jax

    from jaxdist import checkpoint

    if args.format == "hf":
        from jaxdist.checkpoint import hf_folder

        step, files = hf_folder.export(args.run_dir, args.out, args.step)
        if jax.process_index() == 0:
            print(f"wrote a Hugging Face folder (params at step {step}) to {args.out}: {', '.join(files)}")
        return
    if jax.process_count() > 1:
        raise UserError(f"export {args.out}: one file is written by one process; run it alone, or use --format hf, "
                        f"which gathers the parameters across processes")
    step, count = checkpoint.export_params(args.run_dir, args.out, args.step)
    print(f"wrote {count} arrays (params at step {step}) to {args.out}")
