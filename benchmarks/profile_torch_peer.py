"""Where the torch peer's step spends its GPU time, in the same kinds as profile_summary.py.

    python3 benchmarks/profile_torch_peer.py --peers DIR [--d 1024] [--batch 16] [--trace OUT.json.gz]

Trains `torch_gpt.py`'s model exactly as that script does (bf16 autocast, torch.compile, fused
AdamW), then traces 3 steps with torch.profiler and sums the CUDA kernels by kind and by name,
so that a jaxdist profile (`jaxdist bench --profile`) and the peer's can be set side by side.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from profile_summary import print_summary  # noqa: E402

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--trace", help="also write the kernel list (name, dur us) as gzipped JSON here")
    args = parser.parse_args()
    sys.path.insert(0, args.peers)
    from gpt_torch_model import GPT

    torch.manual_seed(0)
    model = GPT(args).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fwd = torch.compile(model)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    y = torch.roll(x, -1, 1)
    for _ in range(5):
        step(x, y)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(STEPS):
            step(x, y)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    print_summary(kernels, STEPS, args.top, "torch peer")
    if args.trace:
        with gzip.open(args.trace, "wt") as out:
            json.dump([{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in kernels], out)


if __name__ == "__main__":
    main()
