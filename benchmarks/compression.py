"""Step time of each gradient compression, data parallel over 2 GPUs in 2 processes.

    python benchmarks/compression.py --link sockets   # NCCL over TCP on loopback: hosts joined by Ethernet
    python benchmarks/compression.py --link nvlink    # NCCL as it is on one host

With `--link sockets` NCCL is kept off NVLink, shared memory and InfiniBand
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1), so every byte of the gradient
reduction crosses a TCP socket, as between hosts joined by Ethernet. `jaxdist doctor` measures that
link's all-reduce bus bandwidth first; then `jaxdist bench` times gpt_406m with
`train.grad_compression` none, powersgd and int8 and reports the collectives' bytes per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
METHODS = ("none", "powersgd", "int8")


def run(command: list[str], env: dict[str, str], timeout: int) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def doctor_busbw(jaxdist: list[str], env: dict[str, str], megabytes: int) -> float:
    """The data axis's all-reduce bus bandwidth (GB/s) that `jaxdist doctor` measures."""
    out = run(jaxdist + ["launch", "-n", "2", "--", "doctor", "--megabytes", str(megabytes)], env, 300)
    print(out, flush=True)
    for line in out.splitlines():
        fields = line.removeprefix("[0] ").split()
        if fields[:1] == ["data"] and len(fields) >= 7:
            return float(fields[5])
    sys.exit(f"no data-axis bandwidth line in:\n{out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", choices=("sockets", "nvlink"), required=True)
    parser.add_argument("--config", default="configs/gpt_406m.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-per-gpu", type=int, default=16)
    args = parser.parse_args()
    env = dict(os.environ, **(SOCKETS if args.link == "sockets" else {}))
    jaxdist = [sys.executable, "-m", "jaxdist.cli"]
    busbw = doctor_busbw(jaxdist, env, 256)
    rows = []
    for method in METHODS:
        program = ["bench", args.config, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "rules.preset=dp",
                   f"train.global_batch={2 * args.batch_per_gpu}", f"train.grad_compression={method}",
                   "--steps", str(args.steps), "--warmup", "2"]
        lines = [line.removeprefix("[0] ") for line in run(jaxdist + ["launch", "-n", "2", "--", *program], env,
                                                            400).splitlines()]
        result = [json.loads(line) for line in lines if line.startswith("{")][-1]
        print(json.dumps(result), flush=True)
        rows.append((method, result))
    exact = rows[0][1]["step_ms"]
    print(f"| link (doctor's all-reduce busbw) | compression | step ms | vs exact | collectives MB per step | "
          f"loss after {args.steps + 2} steps |")
    print("|---|---|---|---|---|---|")
    for method, result in rows:
        sent = sum(sum(by_dtype.values()) for by_dtype in result["collective_mb"].values())
        print(f"| {args.link} ({busbw:.2f} GB/s) | {method} | {result['step_ms']:.1f} | {exact / result['step_ms']:.2f}x | "
              f"{sent:,.1f} | {result['loss']:.4f} |")


if __name__ == "__main__":
    main()
