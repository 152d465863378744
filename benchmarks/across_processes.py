"""The same layout in one process over every GPU and in one process per GPU (`jaxdist launch`).

    python benchmarks/across_processes.py [--config configs/gpt_406m.yaml] [--steps 10]

For each layout (pipeline stages, FSDP) it runs `jaxdist bench` twice on all GPUs of this host:
once as one process, once as `jaxdist launch -n <GPUs>`, and prints the untrained model's first
loss (the data each process feeds and the assembled global batch decide it, so the two must
agree), the step time and tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

LAYOUTS = {
    # Each stage on its own GPU: the batch is split over the stages too, so each process feeds its half.
    "stage": ["mesh.stage=-1", "mesh.fsdp=1", "model.impl.scan_layers=true", "pipeline.microbatches=8"],
    # The batch split over fsdp: each process feeds its own rows.
    "fsdp": ["mesh.fsdp=-1"],
}


def bench(command: list[str]) -> dict:
    """The JSON result `jaxdist bench` printed (process 0's under `launch`)."""
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [line.removeprefix("[0] ") for line in proc.stdout.splitlines()]
    results = [json.loads(line) for line in lines if line.startswith("{")]
    if proc.returncode or not results:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return results[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt_406m.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-per-gpu", type=int, default=16)
    args = parser.parse_args()
    jaxdist = [sys.executable, "-m", "jaxdist.cli"]
    rows = []
    for name, overrides in LAYOUTS.items():
        program = ["bench", args.config, *overrides, f"train.global_batch={args.batch_per_gpu * args.gpus}",
                   "--steps", str(args.steps), "--warmup", "2"]
        for processes, command in ((1, jaxdist + program), (args.gpus, jaxdist + ["launch", "-n", str(args.gpus), "--", *program])):
            result = bench(command)
            print(json.dumps(result), flush=True)
            rows.append((name, processes, result))
    print("| layout | processes | mesh | first loss | step ms | tokens/s per GPU |\n|---|---|---|---|---|---|")
    for name, processes, result in rows:
        print(f"| {name} | {processes} | {result['layout']} | {result['first_loss']:.6f} | {result['step_ms']:.2f} | "
              f"{result['tokens_per_sec_per_device']:,} |")


if __name__ == "__main__":
    main()
