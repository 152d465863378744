"""The same `jaxdist bench` with this tree and another checkout of jaxdist, alternating, on one GPU.

    git archive REV jaxdist | tar -x -C .other      # e.g. the commit before a change
    python benchmarks/against_tree.py .other [--config configs/gpt_406m.yaml] [--pairs 2]

Runs `--pairs` x (this tree, the other), each as a fresh process on the same GPU, then prints
each run's step time, trace and compile times and first loss, and the ratio of the medians. Before
the pairs, this tree runs once more to fill the compilation cache and build the kernels, so its first
timed run shows what a second start costs (`trace_s`, paid at every start, and `compile_s`, the
XLA compile the cache turns into a load; older trees report only `compile_s`, both together).
Both trees read this tree's config file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def bench(tree: Path, config: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "jaxdist.cli", "bench", config, "--steps", str(steps)],
                          capture_output=True, text=True, cwd=tree, env=env)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not results:
        sys.exit(f"bench in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return results[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="another jaxdist tree (holding jaxdist/)")
    parser.add_argument("--config", default="configs/gpt_406m.yaml")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    args.config = str((here / args.config).resolve())  # older trees keep their recipes elsewhere
    first = bench(here, args.config, args.steps)
    rows = [("this tree, first start", first)]
    for _ in range(args.pairs):
        rows.append(("this tree", bench(here, args.config, args.steps)))
        rows.append((str(args.other), bench(args.other.resolve(), args.config, args.steps)))
    for name, result in rows:
        print(json.dumps({"tree": name, **result}), flush=True)
    print("| tree | step ms | trace s | compile s | setup s | first loss | SM MHz |\n|---|---|---|---|---|---|---|")
    for name, result in rows:
        print(f"| {name} | {result['step_ms']:.2f} | {result.get('trace_s', '')} | {result['compile_s']:.1f} | "
              f"{result['setup_s']:.1f} | {result.get('first_loss', float('nan')):.6f} | {result.get('sm_clock_mhz', '')} |")
    mine = statistics.median(r["step_ms"] for n, r in rows[1:] if n == "this tree")
    other = statistics.median(r["step_ms"] for n, r in rows[1:] if n != "this tree")
    print(f"median step: this tree {mine:.2f} ms, {args.other} {other:.2f} ms, ratio {mine / other:.4f}; "
          f"compile: first start {first['compile_s']:.1f} s, later starts "
          f"{statistics.median(r['compile_s'] for n, r in rows[1:] if n == 'this tree'):.1f} s")


if __name__ == "__main__":
    main()
