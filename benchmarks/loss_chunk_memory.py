"""Per-device memory of the compiled train step against `impl.loss_chunk` (compile only, no run).

    JAXDIST_CPU_DEVICES=1 python benchmarks/loss_chunk_memory.py configs/tiny.yaml model.vocab=16384
    python benchmarks/loss_chunk_memory.py configs/gpt_406m.yaml --chunks 0,128,256   # on a GPU

For each chunk size (0: the unchunked loss, which forms the whole logits), prints XLA's memory
analysis of the step: temporaries (activations, logits, gradients) and arguments (the state and
the batch). The chunked loss holds one chunk's logits at a time.
"""

from __future__ import annotations

import argparse

from accumulation_memory import compiled_step  # scripts/ is on sys.path

import jaxdist
from jaxdist import config as config_lib


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--chunks", default="0,8,32,128")
    args = parser.parse_args()
    print(f"{'loss_chunk':>10} {'temp MiB/device':>16} {'args MiB/device':>16}")
    for chunk in map(int, args.chunks.split(",")):
        cfg = config_lib.load(args.config, [*args.overrides, f"impl.loss_chunk={chunk}"])
        memory = compiled_step(cfg).memory_analysis()
        print(f"{chunk:>10} {memory.temp_size_in_bytes / 2**20:>16.2f} {memory.argument_size_in_bytes / 2**20:>16.2f}")


if __name__ == "__main__":
    main()
