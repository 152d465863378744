"""Where a profiled step spends its GPU time: kernel time by kind, and the top kernels.

    python3 scripts/profile_summary.py PROFILE_DIR [--steps 3] [--top 25]

Reads the newest `perfetto_trace.json.gz` under PROFILE_DIR (written by `jaxdist bench
--profile PROFILE_DIR`, which traces 3 steps) and sums the kernels on the GPU streams of the first
GPU. Times are per step. Kinds are told apart by kernel names: cuBLAS/CUTLASS GEMMs, cuDNN
attention, NCCL collectives, copies, and XLA's own fusions (elementwise and reductions).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

KINDS = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"cudnn|fmha|flash", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|triton_gemm", re.I)),
    ("copy", re.compile(r"memcpy|memset", re.I)),
)


def kind(name: str) -> str:
    return next((label for label, pattern in KINDS if pattern.search(name)), "xla fusion/other")


def gpu_kernels(trace: dict) -> list[dict]:
    """Kernel events on the stream lines of the first GPU (not the derived "XLA Ops" lines)."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    gpu = min((pid for pid, name in processes.items() if "GPU" in name), key=lambda pid: processes[pid], default=None)
    if gpu is None:
        raise SystemExit("no GPU in this trace")
    threads = {
        e["tid"]: e["args"]["name"] for e in events
        if e.get("ph") == "M" and e["pid"] == gpu and e["name"] == "thread_name"
    }
    streams = {tid for tid, name in threads.items() if "Stream" in name}
    if not streams:
        raise SystemExit(f"no stream lines on {processes[gpu]}: {sorted(threads.values())}")
    return [e for e in events if e.get("ph") == "X" and e["pid"] == gpu and e["tid"] in streams]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    path = max(Path(args.profile_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    print_summary(gpu_kernels(json.load(gzip.open(path))), args.steps, args.top, str(path))


def print_summary(kernels: list[dict], steps: int, top: int, source: str) -> None:
    """Kernel time per step by kind, then the `top` kernels; `kernels` are events with name and dur (us)."""
    by_kind, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for event in kernels:
        ms = event["dur"] / 1e3 / steps
        by_kind[kind(event["name"])] += ms
        by_name[event["name"]] += ms
        calls[event["name"]] += 1
    print(f"kernel time per step: {sum(by_kind.values()):.2f} ms ({source})")
    for label, ms in by_kind.most_common():
        print(f"  {label:<18} {ms:8.2f} ms")
    print(f"top {top} kernels (ms per step, calls per step):")
    for name, ms in by_name.most_common(top):
        print(f"  {ms:7.2f} {calls[name] // steps:5d}  {kind(name):<10} {name[:110]}")


if __name__ == "__main__":
    main()
