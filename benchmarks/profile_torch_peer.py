"""Where a torch peer's step spends its GPU time, in the same kinds as profile_summary.py.

    python3 benchmarks/profile_torch_peer.py --peers DIR [gpt] [--d 1024] [--batch 16] [--trace OUT.json.gz]
    python3 benchmarks/profile_torch_peer.py --peers DIR resnet [--depth 50] [--batch 256]

Trains the peer's model exactly as its script does, then traces 3 steps with torch.profiler and
sums the CUDA kernels by kind and by name, so that a jaxdist profile (`jaxdist bench --profile`)
and the peer's can be set side by side:
- gpt: `torch_gpt.py`'s model (bf16 autocast, torch.compile of the model, fused AdamW);
- resnet: `torch_resnet.py`'s torchvision ResNet (channels_last, bf16 autocast, SGD with
  momentum, torch.compile of the whole step).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile

import torch

from profile_summary import print_summary  # benchmarks/profile_summary.py, beside this file

STEPS = 3


def gpt_step(args):
    """torch_gpt.py's step on fixed random tokens."""
    sys.path.insert(0, args.peers)
    from gpt_torch_model import GPT

    torch.manual_seed(0)
    model = GPT(args).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fwd = torch.compile(model)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    y = torch.roll(x, -1, 1)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def resnet_step(args):
    """torch_resnet.py's step on fixed random images."""
    import torchvision

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, f"resnet{args.depth}")(num_classes=1000)
    model = model.cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return torch.compile(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", choices=("gpt", "resnet"), default="gpt")
    parser.add_argument("--peers", required=True)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--depth", type=int, default=50, help="resnet: 18, 34, 50, 101 or 152")
    parser.add_argument("--batch", type=int, help="per step (gpt: 16, resnet: 256)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--trace", help="also write the kernel list (name, dur us) as gzipped JSON here")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 16 if args.model == "gpt" else 256
    step = gpt_step(args) if args.model == "gpt" else resnet_step(args)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    print_summary(kernels, STEPS, args.top, f"torch peer ({args.model})")
    if args.trace:
        with gzip.open(args.trace, "wt") as out:
            json.dump([{"name": e["name"], "ts": e["ts"], "dur": e["dur"]} for e in kernels], out)


if __name__ == "__main__":
    main()
