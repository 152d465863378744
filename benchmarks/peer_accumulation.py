"""The torch peer's GPT step with gradient accumulation: what microbatches cost torch on one GPU.

    python3 benchmarks/peer_accumulation.py --peers DIR [--microbatches 4] [--batch 16] [--d 1024] [--mode reduce-overhead]

`torch_gpt.py`'s model and training (bf16 autocast, torch.compile of the model, fused AdamW, fixed
random tokens), with each step's batch split into `--microbatches` equal parts: one forward and
backward pass each, the gradients summed in the parameters' float32 `.grad` (torch's own
accumulation), then one optimizer step. Each microbatch's loss is scaled by 1 / microbatches, so the
step's gradient is the batch's mean, as jaxdist's `train.microbatches` computes it. Prints one JSON
line in the peer's keys, MFU counted as the peers' README says; compare_peers.py's `accumulation`
suite runs it beside `jaxdist bench ... train.microbatches=K`. `--mode reduce-overhead` compiles the
model into CUDA graphs (torch.compile's mode), which small microbatches need where the host's kernel
launches, not the GPU, set the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

WARMUP = 5
H100_H200_BF16_FLOPS = 989e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True, help="folder of the peers' programs (gpt_torch_model.py)")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--mode", default="default", help="torch.compile's mode (default: as torch_gpt.py)")
    for name, default in dict(d=1024, layers=24, heads=16, seq=1024, vocab=50304, batch=16, steps=30).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if args.batch % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} does not divide --batch {args.batch}")
    sys.path.insert(0, os.path.abspath(args.peers))
    from gpt_torch_model import GPT

    torch.manual_seed(0)
    model = GPT(args).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    forward = torch.compile(model, mode=args.mode)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    targets = torch.roll(tokens, -1, 1)
    micro_tokens, micro_targets = tokens.chunk(args.microbatches), targets.chunk(args.microbatches)
    graphs = args.mode == "reduce-overhead"
    if graphs:
        # The gradients a graph outputs are overwritten by its next run: each microbatch's must be
        # added into buffers of their own, not become `.grad` (as the first backward's would).
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)

    def step():
        total = 0.0
        for x, y in zip(micro_tokens, micro_targets):
            if graphs:
                # Each microbatch is a new run of the graphs: the last one's outputs are consumed.
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(x, y) / args.microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not graphs)
        return total

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / args.steps
    matmul_params = 12 * args.layers * args.d * args.d + args.vocab * args.d
    flops_per_token = 6 * matmul_params + 12 * args.layers * args.d * args.seq
    tokens_per_s = args.batch * args.seq / step_s
    print(json.dumps(dict(
        peer="torch", microbatches=args.microbatches, mode=args.mode, d=args.d, layers=args.layers, seq=args.seq,
        batch=args.batch, step_ms=round(step_s * 1e3, 2), tokens_per_s=round(tokens_per_s),
        mfu=round(flops_per_token * tokens_per_s / H100_H200_BF16_FLOPS, 3), loss=float(loss),
        peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 1),
    )))


if __name__ == "__main__":
    main()
