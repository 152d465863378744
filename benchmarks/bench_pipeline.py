"""Pipeline parallelism on the GPUs of one host: step time and bubble against the microbatch count.

    python3 benchmarks/bench_pipeline.py                      # every GPU a stage; GPipe and circular
    python3 benchmarks/bench_pipeline.py --microbatches 4,8,16 --repeats 1,2,4 --out pipe.jsonl
    JAXDIST_CPU_DEVICES=4 python3 benchmarks/bench_pipeline.py --smoke   # tiny sizes: checks it runs

With S stages (S = the device count), each schedule (`pipeline.repeats` R: 1 is GPipe, more is
circular) and microbatch count M, it times the real train step (`Trainer.from_config`, the code
path of `jaxdist train`) on fixed random tokens. The ideal a pipeline can reach is every device
busy all the time, doing its share of the work: that is a step of the same model with layers / S
layers on the whole batch on one device, timed first. Then

    measured bubble = 1 - ideal step / pipelined step      theory = (S - 1) / (R * M + S - 1)

The measured bubble also holds what the schedule costs beyond idling (stage-to-stage transfers,
the regrouping of layers with R > 1, microbatches too small to fill a GPU), so it sits above
theory by that much. The vocabulary is small (bytes) so the layers, which are what is pipelined,
dominate the step. Prints a markdown table (for README.md) and writes one JSON line per row.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import numpy as np

import jaxdist
from jaxdist import config as config_lib
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import pipeline
from jaxdist.train.trainer import Trainer


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    parser.add_argument("--microbatches", type=_ints, default=None, help="default: S, 2S, 4S, 8S up to the batch")
    parser.add_argument("--repeats", type=_ints, default=[1, 2], help="1 = GPipe, >1 = circular")
    parser.add_argument("--compute", default="bfloat16")
    parser.add_argument("--remat", action="store_true",
                        help="pipeline.remat (the ideal then uses impl.remat=full): recompute forwards")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="append one JSON line per row to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny model and 2 steps: checks the script runs (CPU)")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.layers, args.heads, args.seq, args.batch = 32, 8, 4, 16, 16
        args.steps, args.warmup, args.compute = 2, 1, "float32"
    return args


def _config(args: argparse.Namespace, layers: int, stages: int, microbatches: int, repeats: int) -> config_lib.Config:
    # With --remat the ideal recomputes its forward too (per layer), so both sides do the same work.
    ideal_remat = "full" if args.remat and stages == 1 else "none"
    return config_lib.from_dict({
        "model": {"vocab": 256, "d_model": args.d_model, "layers": layers, "heads": args.heads, "seq_len": args.seq},
        "impl": {"scan_layers": True, "remat": ideal_remat},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "stage": stages},
        "rules": {"preset": "dp"},
        "train": {"global_batch": args.batch, "steps": args.warmup + args.steps},
        "precision": {"compute": args.compute},
        "pipeline": {"microbatches": microbatches, "repeats": repeats, "remat": args.remat},
    })


def time_step(cfg: config_lib.Config, devices: list, warmup: int, steps: int) -> float:
    """Seconds per train step, after `warmup` steps, on fixed random tokens."""
    trainer = Trainer.from_config(cfg, devices)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1))
    batch = trainer.global_batch({"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)})
    trainer.compile(batch)
    for _ in range(warmup):
        metrics = trainer.step(batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        metrics = trainer.step(batch)
    jax.block_until_ready(metrics)  # each step reads the last one's state: the last done means all done
    elapsed = (time.perf_counter() - start) / steps
    del trainer
    gc.collect()
    return elapsed


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    args = _arguments()
    devices = jax.devices()
    stages = len(devices)
    microbatches = args.microbatches or [m for m in (stages, 2 * stages, 4 * stages, 8 * stages) if args.batch % m == 0]
    tokens = args.batch * args.seq
    print(f"{stages} x {devices[0].device_kind}; GPT d{args.d_model} L{args.layers} seq {args.seq}, "
          f"batch {args.batch}, {args.compute}, layers scanned", flush=True)

    ideal = time_step(_config(args, args.layers // stages, 1, 1, 1), devices[:1], args.warmup, args.steps)
    print(f"ideal (one device, {args.layers // stages} layers, whole batch): {ideal * 1e3:.1f} ms", flush=True)

    header = ("schedule", "S", "R", "M", "rows/mb", "step ms", "tokens/s", "ideal ms", "bubble measured", "theory")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for repeats in args.repeats:
        for micro in microbatches:
            schedule = pipeline.Schedule(stages, micro, repeats)
            cfg = _config(args, args.layers, stages, micro, repeats)
            layout_lib.from_config(cfg, devices)
            step = time_step(cfg, devices, args.warmup, args.steps)
            row = {
                "schedule": "gpipe" if repeats == 1 else "circular", "stages": stages, "repeats": repeats,
                "microbatches": micro, "microbatch_rows": args.batch // micro, "step_ms": step * 1e3,
                "tokens_per_sec": tokens / step, "ideal_ms": ideal * 1e3,
                "bubble_measured": 1 - ideal / step, "bubble_theory": schedule.bubble,
                "device": devices[0].device_kind, "d_model": args.d_model, "layers": args.layers,
                "seq": args.seq, "batch": args.batch, "compute": args.compute,
                "remat": args.remat,
            }
            print(f"| {row['schedule']} | {stages} | {repeats} | {micro} | {row['microbatch_rows']} | "
                  f"{row['step_ms']:.1f} | {row['tokens_per_sec']:,.0f} | {row['ideal_ms']:.1f} | "
                  f"{row['bubble_measured']:.3f} | {row['bubble_theory']:.3f} |", flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
