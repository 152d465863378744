"""`jaxdist data prepare INPUTS... --out DIR`: text, JSON lines or Parquet files tokenized
(`jaxdist.data.prepare`), or an image folder resized (`jaxdist.data.images`), into ArrayRecord shards."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments
from jaxdist.errors import UserError

HELP = ("tokenize text, JSONL or Parquet files, or resize an image folder (a subfolder per class), into "
        "ArrayRecord shards")
OFFLINE = True
LOCAL_PATHS = (("inputs", "INPUTS"), ("out", "--out"))

# Options of one input form only (None: not given): giving one for the other form is a mistake.
_TEXT_OPTIONS = {"--tokenizer": "tokenizer", "--vocab-size": "vocab_size", "--chunk-tokens": "chunk_tokens",
                 "--text-key": "text_key"}
_IMAGE_OPTIONS = {"--image-size": "image_size", "--grayscale": "grayscale"}
_SHARED_OPTIONS = ("eval_fraction", "records_per_shard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxdist.data import tokenizer as tokenizer_lib

    parser.add_argument("inputs", nargs="+",
                        help="text, JSON lines (.jsonl, .ndjson, .json) or .parquet files, or directories of "
                             "them; or one folder with a subfolder of PNG/JPEG images per class")
    parser.add_argument("--out", required=True, help="new directory for the shards and manifest.json")
    parser.add_argument("--eval-fraction", type=float,
                        help="share of documents (default 0.01) or of each class's images (default 0.1) held out for eval")
    parser.add_argument("--records-per-shard", type=arguments.COUNT, help="records per shard file (default 4096)")
    text = parser.add_argument_group("text")
    text.add_argument("--tokenizer",
                      help=f"one of {', '.join(tokenizer_lib.TOKENIZERS)} (default byte), or the path of a Hugging "
                           f"Face tokenizer.json")
    text.add_argument("--vocab-size", type=arguments.COUNT, help="sentencepiece vocabulary size (default 4096)")
    text.add_argument("--chunk-tokens", type=arguments.COUNT, help="tokens per ArrayRecord record (default 4096)")
    text.add_argument("--text-key", help="JSON lines field / Parquet column holding the text (default text)")
    image = parser.add_argument_group("image folder")
    image.add_argument("--image-size", type=arguments.COUNT,
                       help="side of the square every image is resized and center-cropped to (default 32)")
    image.add_argument("--grayscale", action="store_true", default=None,
                       help="keep one gray channel instead of converting to RGB")


def run(args: argparse.Namespace) -> None:
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
