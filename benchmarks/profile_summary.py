"""Where a profiled step spends its GPU time: kernel time by kind, and the top kernels.

    python3 benchmarks/profile_summary.py PROFILE_DIR [--steps 3] [--top 25] [--against OTHER_DIR]

Reads the newest `perfetto_trace.json.gz` under PROFILE_DIR (written by `jaxdist bench
--profile PROFILE_DIR`, which traces 3 steps, or by `jaxdist train` into RUN_DIR/profile/process_<i>
for `profile.steps` steps: pass that count as --steps) and sums the kernels on the GPU streams of the first
GPU. Times are per step. Kinds are told apart by kernel names: cuBLAS/CUTLASS GEMMs, cuDNN
attention, cuDNN convolutions, NCCL collectives, copies, and XLA's own fusions (elementwise and reductions).

It also says how long the GPU sat idle (no kernel on any stream), in gap sizes, and where the
longest gaps were: the difference between kernel time and step time; how much of the collectives'
time other kernels ran beside them; and, from the host's threads, what the host spent its time in.
With `--against`, it also says which kernels take longer or shorter than in another profile (say, data
parallel against one GPU): whether a layout loses its time in collectives or in slower compute.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
from pathlib import Path

KINDS = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa", re.I)),
    # cuDNN's other kernels: its convolutions (implicit GEMMs named by pass) and their padding. Not
    # "conv": XLA's convert fusions and torch's Triton kernels named after a convolution's backward.
    ("convolution", re.compile(r"fprop|dgrad|wgrad|implicit_?gemm|cudnn|nhwcaddpadding", re.I)),
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


def host_events(trace: dict) -> list[dict]:
    """Complete events on the host's threads (JAX/XLA trace annotations and CUDA API calls), each
    with its thread's name under "thread"."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    host = {pid for pid, name in processes.items() if "GPU" not in name and "TPU" not in name}
    return [dict(e, thread=threads.get((e["pid"], e["tid"]), "?")) for e in events
            if e.get("ph") == "X" and e["pid"] in host]


def print_host(events: list[dict], steps: int, top: int = 30) -> None:
    """Host time per step by event name: where the thread that launches the step waits."""
    total, calls, where = collections.Counter(), collections.Counter(), {}
    for event in events:
        total[event["name"]] += event["dur"] / 1e3 / steps
        calls[event["name"]] += 1
        where[event["name"]] = event["thread"]
    print("host events, longest total per step (ms, calls per step, thread):")
    for name, ms in total.most_common(top):
        print(f"  {ms:8.2f} {calls[name] / steps:7.1f}  {where[name][:24]:<24} {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--against", help="a second profile folder to compare kernel times with")
    args = parser.parse_args()
    trace = load_trace(args.profile_dir)
    kernels = gpu_kernels(trace)
    print_summary(kernels, args.steps, args.top, args.profile_dir)
    print_host(host_events(trace), args.steps)
    if args.against:
        print_difference(kernels, gpu_kernels(load_trace(args.against)), args.steps, args.top)


def load_trace(profile_dir: str) -> dict:
    """The newest perfetto trace under `profile_dir`; exits with a message if there is none, or if
    it is empty or cut short (its run stopped while the profiler wrote it)."""
    paths = list(Path(profile_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {profile_dir}: write one with "
                         f"`jaxdist bench CONFIG --profile {profile_dir}`")
    path = max(paths, key=lambda p: p.stat().st_mtime)
    try:
        with gzip.open(path) as trace:
            return json.load(trace)
    except (EOFError, OSError, ValueError) as err:
        raise SystemExit(f"{path} is empty or cut short ({err}): was its run stopped while the profiler "
                         f"wrote it? Profile again, with time for the trace to be written") from None


def kernel_ms(kernels: list[dict], steps: int) -> tuple[collections.Counter, collections.Counter]:
    """Kernel time per step (ms) by kind and by kernel name."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    for event in kernels:
        by_kind[kind(event["name"])] += event["dur"] / 1e3 / steps
        by_name[event["name"]] += event["dur"] / 1e3 / steps
    return by_kind, by_name


def print_difference(kernels: list[dict], other: list[dict], steps: int, top: int) -> None:
    """Kernel time per step by kind in this profile and the other, then the kernels whose time
    changed most (XLA names fusions by their HLO, so the same program's kernels keep their names)."""
    kinds, names = kernel_ms(kernels, steps)
    other_kinds, other_names = kernel_ms(other, steps)
    print("against the other profile (ms per step: this, other, difference):")
    for label in sorted(set(kinds) | set(other_kinds), key=lambda k: -abs(kinds[k] - other_kinds[k])):
        print(f"  {label:<18} {kinds[label]:8.2f} {other_kinds[label]:8.2f} {kinds[label] - other_kinds[label]:+8.2f}")
    total, other_total = sum(kinds.values()), sum(other_kinds.values())
    print(f"  {'all kernels':<18} {total:8.2f} {other_total:8.2f} {total - other_total:+8.2f}")
    changed = sorted(set(names) | set(other_names), key=lambda n: -abs(names[n] - other_names[n]))
    print(f"the {top} kernels whose time changed most:")
    for name in changed[:top]:
        print(f"  {names[name]:7.2f} {other_names[name]:7.2f} {names[name] - other_names[name]:+7.2f}  "
              f"{kind(name):<10} {name[:90]}")


# Idle gaps by length (us): launch bubbles are a few us; tens to hundreds of us are the host.
GAP_BUCKETS_US = (2, 5, 10, 50, 500, 5000)


def idle_gaps(kernels: list[dict]) -> list[tuple[float, str, str]]:
    """(length us, kernel before, kernel after) for each time no kernel ran, on any stream.

    `kernels` need "ts" and "dur" (us); the traced steps ran back to back (`jaxdist bench --profile`),
    so gaps between steps count too.
    """
    spans = _busy_spans(kernels)
    return [(after[0] - before[1], before[3], after[2]) for before, after in zip(spans, spans[1:])]


def print_gaps(kernels: list[dict], steps: int, top: int = 8) -> None:
    gaps = idle_gaps(kernels)
    print(f"GPU idle: {sum(g for g, _, _ in gaps) / 1e3 / steps:.2f} ms per step, "
          f"{len(gaps) / steps:.0f} gaps per step")
    edges = (0, *GAP_BUCKETS_US, float("inf"))
    for low, high in zip(edges, edges[1:]):
        inside = [g for g, _, _ in gaps if low <= g < high]
        print(f"  {low:>5}-{high:<5} us: {len(inside) / steps:8.1f} gaps {sum(inside) / 1e3 / steps:7.2f} ms")
    print(f"longest {top} gaps (us, kernel before -> kernel after):")
    for length, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {length:7.1f}  {before[:60]} -> {after[:60]}")


def _busy_spans(kernels: list[dict]) -> list[tuple[float, float, str, str]]:
    """The times some kernel ran, overlapping kernels merged, in time order: (start, end, the first
    kernel's name, the name of the one that ended last)."""
    spans: list[tuple[float, float, str, str]] = []
    for event in sorted(kernels, key=lambda e: e["ts"]):
        start, end = event["ts"], event["ts"] + event["dur"]
        if spans and start <= spans[-1][1]:
            if end > spans[-1][1]:
                spans[-1] = (spans[-1][0], end, spans[-1][2], event["name"])
        else:
            spans.append((start, end, event["name"], event["name"]))
    return spans


def _length(spans: list[tuple]) -> float:
    return sum(span[1] - span[0] for span in spans)


def _intersection(a: list[tuple], b: list[tuple]) -> float:
    """Total time inside both lists of spans (each in time order, not overlapping)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def collective_overlap(kernels: list[dict]) -> tuple[float, float]:
    """(time any collective kernel ran, of it the time some other kernel ran too), in us."""
    collectives = _busy_spans([k for k in kernels if kind(k["name"]) == "collective"])
    others = _busy_spans([k for k in kernels if kind(k["name"]) != "collective"])
    return _length(collectives), _intersection(collectives, others)


def lone_collectives(kernels: list[dict]) -> list[tuple[float, float, str, str]]:
    """(us alone, us long, name, the last other kernel to start before it) for each collective
    kernel: the time of it during which no other kernel ran, longest first."""
    others = sorted((k for k in kernels if kind(k["name"]) != "collective"), key=lambda k: k["ts"])
    spans = _busy_spans(others)
    starts = [k["ts"] for k in others]
    rows = []
    for event in kernels:
        if kind(event["name"]) != "collective":
            continue
        span = [(event["ts"], event["ts"] + event["dur"])]
        before = others[max(0, bisect.bisect_right(starts, event["ts"]) - 1)]["name"] if others else "-"
        rows.append((event["dur"] - _intersection(span, spans), event["dur"], event["name"], before))
    return sorted(rows, reverse=True)


def print_summary(kernels: list[dict], steps: int, top: int, source: str) -> None:
    """Kernel time per step by kind, then the `top` kernels; `kernels` are events with name and dur (us)."""
    by_kind, by_name = kernel_ms(kernels, steps)
    calls = collections.Counter(event["name"] for event in kernels)
    print(f"kernel time per step: {sum(by_kind.values()):.2f} ms ({source})")
    for label, ms in by_kind.most_common():
        print(f"  {label:<18} {ms:8.2f} ms")
    print(f"top {top} kernels (ms per step, calls per step):")
    for name, ms in by_name.most_common(top):
        print(f"  {ms:7.2f} {calls[name] // steps:5d}  {kind(name):<10} {name[:110]}")
    if all("ts" in event for event in kernels):
        print_gaps(kernels, steps)
        running, overlapped = collective_overlap(kernels)
        if running:
            print(f"collectives running: {running / 1e3 / steps:.2f} ms per step, {overlapped / 1e3 / steps:.2f} "
                  f"beside other kernels, {(running - overlapped) / 1e3 / steps:.2f} alone")
            print("collectives longest alone (us alone of us long, name, the other kernel started last before it):")
            for alone, long, name, before in lone_collectives(kernels)[:8]:
                print(f"  {alone:7.1f} of {long:7.1f}  {name[:50]}  after {before[:50]}")


if __name__ == "__main__":
    main()
