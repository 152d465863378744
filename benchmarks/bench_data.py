"""Throughput of the input pipeline alone: packed GPT batches per second, no model, no device.

    PYTHONPATH=. python benchmarks/bench_data.py [--seq-len 1024] [--batch 32] [--workers 0] ...

Prepares the Python standard library's sources into ArrayRecord shards (byte or sentencepiece
tokens) in a temporary directory, then reads batches through the same config-driven iterator
the training loop uses (`loader.train_iterator`: shuffled, per-epoch reseeded, packed windows,
targets shifted by one, int32) and prints tokens per second. `--source stdlib` reads the
in-memory stdlib corpus instead. The target is 2 million tokens/s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from jaxdist import config
from jaxdist.data import corpus, loader, prepare


def utf8_stdlib_files() -> list[str]:
    """The stdlib's non-empty .py files that are UTF-8 (a few test files are deliberately not)."""
    files = []
    for path in corpus.stdlib_files():
        try:
            if path.read_text(encoding="utf-8"):
                files.append(str(path))
        except UnicodeDecodeError:
            continue
    return files


def measure(batches, seconds: float) -> tuple[float, int]:
    """(tokens per second, batches read) over `seconds`, after one warm-up batch."""
    next(batches)
    count = tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(batches)
        tokens += batch["inputs"].size
        count += 1
    return tokens / (time.perf_counter() - start), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["arrayrecord", "stdlib"], default="arrayrecord")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        data = {"source": "stdlib"}
        vocab = 256
        if args.source == "arrayrecord":
            start = time.perf_counter()
            manifest = prepare.prepare(
                utf8_stdlib_files(), f"{scratch}/shards", tokenizer=args.tokenizer,
                vocab_size=args.vocab_size, eval_fraction=0.01,
            )
            train = manifest["splits"]["train"]
            print(f"prepared {train['documents']} documents, {train['tokens'] / 1e6:.1f} M {manifest['dtype']} "
                  f"tokens ({args.tokenizer}) in {time.perf_counter() - start:.1f} s")
            data = {"source": "arrayrecord", "path": f"{scratch}/shards"}
            vocab = manifest["tokenizer"]["vocab_size"]
        cfg = config.from_dict({
            "data": {**data, "read_threads": args.threads, "workers": args.workers},
            "model": {"seq_len": args.seq_len, "vocab": vocab},
            "train": {"global_batch": args.batch},
        })
        rate, count = measure(loader.train_iterator(cfg), args.seconds)
    print(f"{args.source}: {rate / 1e6:.2f} M tokens/s of packed ({args.batch} x {args.seq_len}) batches "
          f"({count} batches in {args.seconds:.0f} s, {args.threads} read threads, {args.workers} workers)")


if __name__ == "__main__":
    main()
