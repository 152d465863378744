"""Pipeline stages against one GPU: gpt_406m per GPU, `jaxdist bench` runs one after the other.

    python3 benchmarks/pipeline_vs_one_gpu.py [--stages 2,4] [--microbatches 4,8,16] [--repeats 1,2] [--out r.jsonl]
    JAXDIST_CPU_DEVICES=2 python benchmarks/pipeline_vs_one_gpu.py --steps 2 --microbatches 2 \
        --set model.d_model=32 model.layers=4 model.heads=4 model.seq_len=16 model.vocab=256 \
        impl.loss_chunk=0 precision.compute=float32                                  # CPU: checks it runs

Runs, each a separate `jaxdist bench jaxdist/recipes/gpt_406m.yaml` process on this host's first
GPUs (as many as the largest stage count):

- 1 GPU, the recipe (16 sequences, layers unrolled): the baseline;
- 1 GPU with `impl.scan_layers=true`: what the stacked layers cost without a pipeline;
- for each stage count S, `mesh.stage=S` with 16 x S sequences (16 per GPU) for each
  `pipeline.microbatches` M and `pipeline.repeats` R.

and prints one table: step ms, tokens/s per GPU, per-GPU ratio to the 1-GPU recipe, and the
measured bubble (1 - that ratio: every cost of the pipeline beyond the recipe's step, its idle
iterations included) beside theory, (S - 1) / (R * M + S - 1). Each result is also printed (and
with `--out` appended) as a JSON line.
"""

from __future__ import annotations

import argparse
import json

import jaxdist
from compare_peers import GPT_406M, JAXDIST, run


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def runs(stage_counts: list[int], microbatches: list[int], repeats: list[int], batch_per_gpu: int,
         overrides: list[str], steps: int) -> list[tuple[str, list[str]]]:
    """(label, command) of every run, the 1-GPU baseline first; `overrides` go to every run."""
    timing = ["--steps", str(steps)]
    one_gpu = JAXDIST + GPT_406M + ["mesh.fsdp=1", f"train.global_batch={batch_per_gpu}", *overrides]

    def staged(stages: int) -> list[str]:
        return JAXDIST + GPT_406M + [f"mesh.stage={stages}", "mesh.fsdp=1", "impl.scan_layers=true",
                                     f"train.global_batch={batch_per_gpu * stages}", *overrides]

    return [
        ("1 GPU, recipe", one_gpu + ["--devices", "1", *timing]),
        ("1 GPU, scanned layers", one_gpu + ["impl.scan_layers=true", "--devices", "1", *timing]),
        *[(f"stage={s} R={r} M={m}",
           staged(s) + [f"pipeline.microbatches={m}", f"pipeline.repeats={r}", "--devices", str(s), *timing])
          for s in stage_counts for r in repeats for m in microbatches],
    ]


def table(results: list[dict]) -> str:
    """The markdown table of `results` (the first one the baseline)."""
    base = results[0].get("tokens_per_sec_per_device")
    lines = ["| run | GPUs | step ms | tokens/s per GPU | per GPU vs 1 GPU | bubble measured | theory |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['label']} | | {result['error']} | | | | |")
            continue
        per_gpu = result["tokens_per_sec_per_device"]
        ratio = per_gpu / base if base else float("nan")
        bubbles = ["", ""]
        if result.get("pipeline_microbatches") is not None:
            bubbles = [f"{1 - ratio:.3f}", f"{result['pipeline_bubble']:.3f}"]
        lines.append(f"| {result['label']} | {result['devices']} | {result['step_ms']:.2f} | {per_gpu:,} | "
                     f"{ratio:.3f} | {bubbles[0]} | {bubbles[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=_ints, default=[2], help="mesh.stage values (one GPU per stage)")
    parser.add_argument("--microbatches", type=_ints, default=[4, 8, 16])
    parser.add_argument("--repeats", type=_ints, default=[1], help="1 = GPipe, >1 = circular")
    parser.add_argument("--batch-per-gpu", type=int, default=16)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every run, e.g. model.vocab=512 (the head's share of the step)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", help="append every result as a JSON line")
    args = parser.parse_args()
    jaxdist.gpu_defaults()
    results = []
    for label, command in runs(args.stages, args.microbatches, args.repeats, args.batch_per_gpu, args.set, args.steps):
        results.append(run(label, command, args.timeout, max(args.stages)))
        if args.out:  # kept as they come: a call cut short still returns what it measured
            with open(args.out, "a") as out:
                out.write(json.dumps(results[-1]) + "\n")
    print(f"\n{table(results)}\n", flush=True)


if __name__ == "__main__":
    main()
