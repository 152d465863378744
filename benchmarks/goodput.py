"""A real run's time on a GPU host: what saves cost, how long a start takes, and goodput.

    PYTHONPATH=. python benchmarks/goodput.py --out DIR [--scratch DIR] [--parts checkpoint,start,run] [--gpus 2]

- checkpoint: `benchmarks/bench_checkpoint.py` on gpt_406m and gpt_1b4 under `--host-copies`
  (default: pinned, the GPU's), one GPU: each save's cost to the loop, the write, the steps
  beside it, the restore.
- start: `jaxdist train gpt_406m` for 2 steps twice, from an empty cache (cold: kernels built,
  step compiled) and again (warm: both cached); the start-up's parts as the run reports them.
- run: gpt_406m for `--steps` steps (default 1,000) with a save every 100 and an eval every 500, on
  one GPU and on `--gpus` GPUs (global batch 16 per GPU); the summary's goodput and its causes.

Each part's output goes to --out (logs, goodput.json); checkpoints, caches and run directories to
--scratch; the figures are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

RECIPE_RUN = ["checkpoint.every=100", "eval.every=500", "eval.batches=20", "log.every=100", "sample.tokens=0"]


def run(command: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    """Runs `command`, teeing its output into `log`; returns the output."""
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})})
    log.write_text(done.stdout)
    print(done.stdout[-3000:], flush=True)
    print(f"(exit {done.returncode}, {time.perf_counter() - started:.0f} s)", flush=True)
    return done.stdout


def jaxdist(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxdist.cli", *args]


# Per recipe: the saves timed under each host copy.
CHECKPOINT_SAVES = {"gpt_406m": "4", "gpt_1b4": "3"}


def checkpoint_part(out: Path, scratch: Path, recipes: list[str], copies: str) -> list[dict]:
    rows = []
    for recipe in recipes:
        saves = CHECKPOINT_SAVES[recipe]
        text = run([sys.executable, "benchmarks/bench_checkpoint.py", recipe, "mesh.fsdp=1", "--dir",
                    str(scratch / "ckpt"), "--host-copies", copies, "--saves", saves],
                   out / f"checkpoint_{recipe}.log", {"CUDA_VISIBLE_DEVICES": "0"})
        rows += [{"recipe": recipe, **json.loads(line)} for line in text.splitlines() if line.startswith("{")]
    return rows


def start_part(out: Path, scratch: Path) -> list[dict]:
    cache = scratch / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for kind in ("cold", "warm"):
        run_dir = scratch / f"start_{kind}"
        shutil.rmtree(run_dir, ignore_errors=True)
        text = run(jaxdist("train", "gpt_406m", "mesh.fsdp=1", "train.steps=2", "log.every=1", "sample.tokens=0",
                           "checkpoint.every=0", f"run_dir={run_dir}"),
                   out / f"start_{kind}.log", {"CUDA_VISIBLE_DEVICES": "0", "JAXDIST_CACHE_DIR": str(cache)})
        ready = re.search(r"ready to train after ([\d.]+) s(?:: (.*))?", text)
        rows.append({"start": kind, "ready_s": float(ready.group(1)) if ready else None,
                     "parts": ready.group(2) if ready else text[-500:]})
    return rows


def run_part(out: Path, scratch: Path, steps: int, gpus: int) -> list[dict]:
    rows = []
    for count in sorted({1, gpus}):
        run_dir = scratch / f"run_{count}gpu"
        shutil.rmtree(run_dir, ignore_errors=True)
        visible = ",".join(str(i) for i in range(count))
        text = run(jaxdist("train", "gpt_406m", f"train.steps={steps}", f"train.global_batch={16 * count}",
                           f"run_dir={run_dir}", *RECIPE_RUN),
                   out / f"run_{count}gpu.log", {"CUDA_VISIBLE_DEVICES": visible, "JAXDIST_CACHE_DIR": str(scratch / "cache")})
        goodput = re.search(r"^goodput .*$", text, re.M)
        steady = re.search(r"^trained \d+ steps; steady .*$", text, re.M)
        saves = [json.loads(line).get("save_blocked_s") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                 ] if (run_dir / "metrics.jsonl").exists() else []
        rows.append({"gpus": count, "steady": steady.group(0) if steady else None,
                     "goodput": goodput.group(0) if goodput else text[-800:],
                     "save_blocked_s": [round(s, 3) for s in saves if s is not None]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--scratch", default="/tmp/jaxdist-goodput")
    parser.add_argument("--parts", default="checkpoint,start,run")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--checkpoint-recipes", default=",".join(CHECKPOINT_SAVES))
    parser.add_argument("--host-copies", default="pinned", help="checkpoint part: the host copies compared")
    args = parser.parse_args()
    out, scratch = Path(args.out), Path(args.scratch)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    results = {}
    if "checkpoint" in parts:
        results["checkpoint"] = checkpoint_part(out, scratch, args.checkpoint_recipes.split(","), args.host_copies)
    if "start" in parts:
        results["start"] = start_part(out, scratch)
    if "run" in parts:
        results["run"] = run_part(out, scratch, args.steps, args.gpus)
    (out / "goodput.json").write_text(json.dumps(results, indent=1))
    for part, rows in results.items():
        print(f"== {part}")
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
