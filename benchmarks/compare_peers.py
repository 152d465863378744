"""Runs jaxdist's benchmark and the matching peer one after the other on this host; prints ratios.

    python3 benchmarks/compare_peers.py SUITE [SUITE ...] [--peers DIR] [--out results.jsonl]

Suites: `one_gpu`, `long_sequences`, `resnet50`, `accumulation` (one GPU), `two_gpus_dp_fsdp` (2 GPUs),
`tensor_parallel` (4 GPUs); see README.md.

Each run is a separate process (one GPU program at a time); every result is one JSON line. The
peers are the PyTorch peer programs (torch_gpt.py, torch_dist.py, torch_resnet.py, plain_jax_gpt.py;
not part of this repository): pass their folder with --peers, or in JAXDIST_PEERS. Ratios are only
meaningful between runs of one invocation on one machine: absolute times drift between hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jaxdist
from jaxdist.observe import clocks

JAXDIST = [sys.executable, "-m", "jaxdist.cli", "bench"]
GPT_406M = ["configs/gpt_406m.yaml"]
GPT_1B4 = ["configs/gpt_1b4.yaml"]


def suites(peers: str) -> dict[str, list[tuple[str, list[str]]]]:
    """The runs behind README.md's latest results, by suite: (label, command) in the order they run.

    `peers`: the folder of the peers' programs. The multi-GPU suites take the host's first 2 or 4
    GPUs (`--devices`), so they run on a larger host as well.
    """
    torch_gpt = [sys.executable, f"{peers}/torch_gpt.py"]
    torch_dist = ["torchrun", "--standalone", "--nproc_per_node=2", f"{peers}/torch_dist.py"]
    torch_resnet = [sys.executable, f"{peers}/torch_resnet.py", "--batch", "256"]
    torch_accumulate = [sys.executable, "benchmarks/peer_accumulation.py", "--peers", peers, "--batch", "16"]
    resnet50 = JAXDIST + ["resnet50_imagenet", "--devices", "1"]
    # jaxdist's own 1-GPU step: the baseline of the multi-GPU ratios (the first GPU of a larger host).
    one_gpu_406m = JAXDIST + GPT_406M + ["mesh.fsdp=1", "--devices", "1"]
    one_gpu_1b4 = JAXDIST + GPT_1B4 + ["mesh.fsdp=1", "--devices", "1"]
    # 16 sequences per GPU on 2 GPUs, as the torch peers run.
    dp2 = GPT_406M + ["train.global_batch=32", "mesh.data=-1", "mesh.fsdp=1", "rules.preset=dp", "--devices", "2"]
    fsdp = GPT_406M + ["train.global_batch=32", "--devices", "2"]
    tensor = GPT_1B4 + ["mesh.fsdp=1", "rules.preset=tp"]
    return {
        # jaxdist against torch at both sizes; each loss chunk's softmax by XLA's passes beside the kernel.
        "one_gpu": [
            ("torch 406m b16", torch_gpt + ["--batch", "16"]),
            ("jaxdist 406m", JAXDIST + GPT_406M),
            ("jaxdist 406m loss_impl=xla", JAXDIST + GPT_406M + ["model.impl.loss_impl=xla"]),
            ("torch 1b4 b8", torch_gpt + ["--d", "2048", "--batch", "8"]),
            ("jaxdist 1b4", JAXDIST + GPT_1B4),
            ("jaxdist 1b4 loss_impl=xla", JAXDIST + GPT_1B4 + ["model.impl.loss_impl=xla"]),
        ],
        # The 406M model at 4,096 tokens per sequence, batch 4 (the same tokens per step).
        "long_sequences": [
            ("torch 406m seq4096 b4", torch_gpt + ["--seq", "4096", "--batch", "4"]),
            ("jaxdist 406m seq4096 b4", JAXDIST + GPT_406M + ["model.seq_len=4096", "train.global_batch=4"]),
        ],
        # ResNet-50 at 224x224, batch 256, against torchvision's under torch.compile (channels_last,
        # bfloat16 autocast), twice each in turn: one pair moves by up to 2% with the card's clock.
        "resnet50": [
            ("torch resnet50 b256", torch_resnet),
            ("jaxdist resnet50", resnet50),
            ("torch resnet50 b256 again", torch_resnet),
            ("jaxdist resnet50 again", resnet50),
        ],
        # The 406M model's 16 sequences in 1, 2, 4 and 8 microbatches: what each size costs torch's
        # accumulation and jaxdist's (a pipeline's microbatches are these sizes). Torch also in CUDA
        # graphs: at 4 rows and fewer its kernel launches set the pace without them.
        "accumulation": [
            *((f"torch 406m b16 mb{k}", torch_accumulate + ["--microbatches", str(k)]) for k in (1, 2, 4, 8)),
            *((f"torch graphs b16 mb{k}", torch_accumulate + ["--microbatches", str(k), "--mode", "reduce-overhead"])
              for k in (1, 4, 8)),
            *((f"jaxdist 406m mb{k}", JAXDIST + GPT_406M + [f"train.microbatches={k}"]) for k in (1, 2, 4, 8)),
        ],
        # Data parallel, FSDP and ZeRO-2 on 2 GPUs against one GPU, torch's DDP and FSDP2.
        "two_gpus_dp_fsdp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", ["env", "MODE=ddp"] + torch_dist),
            ("jaxdist dp2", JAXDIST + dp2),
            ("torch fsdp2", ["env", "MODE=fsdp"] + torch_dist),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist zero2", JAXDIST + fsdp + ["train.fsdp_gather=per_step"]),
        ],
        # The 5B mixture of experts on one GPU against torch's grouped GEMMs (benchmarks/peer_moe.py).
        "moe": [
            ("torch moe 5b", [sys.executable, "benchmarks/peer_moe.py", "--steps", "20"]),
            ("jaxdist moe 5b", JAXDIST + ["configs/moe_5b.yaml", "--steps", "20", "--devices", "1"]),
        ],
        # Tensor parallelism at 1.4B on 2 and 4 GPUs against one GPU.
        "tensor_parallel": [
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=2", JAXDIST + tensor + ["mesh.tensor=2", "--devices", "2"]),
            ("jaxdist 1b4 tensor=4", JAXDIST + tensor + ["mesh.tensor=4", "--devices", "4"]),
        ],
    }


def run(label: str, command: list[str], timeout: int, gpus: int) -> dict:
    start = time.perf_counter()
    print(f"=== {label}: {' '.join(command)}", flush=True)
    # The GPUs' clocks around the whole command, for the peers, whose steps are its busiest part
    # (`jaxdist bench` reports its own, sampled over exactly the timed steps).
    sampler = clocks.ClockSampler(list(range(gpus)), interval_s=0.5)
    try:
        with sampler:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"label": label, "error": f"timed out after {timeout} s"}
    # `jaxdist launch` prefixes each process's lines with "[i] "; process 0 prints the result.
    lines = [line.removeprefix("[0] ") for line in proc.stdout.splitlines() if line.removeprefix("[0] ").startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        print("\n".join(tail), flush=True)
        return {"label": label, "error": f"exit {proc.returncode}"}
    result = {**sampler.summary(busy_share=0.8), **json.loads(lines[-1])}
    result.update(label=label, wall_s=round(time.perf_counter() - start, 1))
    print(json.dumps(result), flush=True)
    return result


def per_device(result: dict) -> float | None:
    for key in ("tokens_per_sec_per_device", "tokens_per_s_per_gpu", "examples_per_sec_per_device",
                "images_per_s_per_gpu"):
        if key in result:
            return result[key]
    return result.get("tokens_per_s")


def table(results: list[dict]) -> str:
    base = next((per_device(r) for r in results if "error" not in r), None)
    rows = [f"{'run':<28} {'step ms':>8} {'per dev/s':>10} {'MFU':>6} {'mem GiB':>8} {'compile s':>9} {'vs first':>8}"
            f" {'MHz':>5} {'W':>4}"]
    for r in results:
        if "error" in r:
            rows.append(f"{r['label']:<28} {r['error']}")
            continue
        tps = per_device(r)
        mem = r.get("peak_mem_gib") or r.get("peak_mem_GiB") or ""
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else ""  # the ResNet peer reports none
        rows.append(
            f"{r['label']:<28} {r['step_ms']:>8} {tps:>10,} {mfu:>6} {mem!s:>8} "
            f"{r.get('compile_s', '')!s:>9} {tps / base:>8.3f} {r.get('sm_clock_mhz', '')!s:>5} {r.get('power_w', '')!s:>4}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+", choices=sorted(suites("")))
    parser.add_argument("--peers", default=os.environ.get("JAXDIST_PEERS"),
                        help="folder of the PyTorch peer programs (default: $JAXDIST_PEERS)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs present (default: all that nvidia-smi lists)")
    parser.add_argument("--out", help="append every result as a JSON line")
    parser.add_argument("--timeout", type=int, default=420)
    args = parser.parse_args()
    if args.peers is None:
        parser.error("pass the folder of the PyTorch peer programs with --peers DIR (or set JAXDIST_PEERS)")
    # Every run inherits jaxdist's XLA flags, so the plain-JAX peer compiles under the same ones.
    jaxdist.gpu_defaults()
    gpus = args.gpus or int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU "))
    known = suites(args.peers)
    for suite in args.suites:
        results = []
        for label, command in known[suite]:
            results.append(run(label, command, args.timeout, gpus))
            # Each result is kept as it comes, so a call cut short still returns what it measured.
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps({"suite": suite, **results[-1]}) + "\n")
        print(f"\n## {suite} ({gpus} GPU(s) present)\n{table(results)}\n", flush=True)


if __name__ == "__main__":
    main()
