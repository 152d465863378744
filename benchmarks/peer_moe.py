"""The torch peer of a mixture of experts: the peers' GPT with each MLP an MoE of grouped GEMMs.

    python3 benchmarks/peer_moe.py [--d 2048 --layers 16 --experts 8 --k 2 --hidden 5632 --batch 8]

`gpt_torch_model.py`'s decoder (pre-LayerNorm, fused QKV, flash attention through SDPA, learned
positions, untied head) with its MLP replaced by the routed experts jaxdist's `model.moe` builds:
a softmax top-k router in float32, its k weights renormalized, SwiGLU experts run as grouped GEMMs
(`torch._grouped_mm` on the tokens sorted by expert, dropless), Switch's load-balancing loss at
`--aux` (jaxdist's `model.moe.aux_loss`). bf16 autocast, `torch.compile`, fused AdamW, fixed random
tokens, as torch_gpt.py. Prints one JSON line in the peers' keys; MFU counts the parameters a token
goes through (the k experts, the router), as jaxdist's `flops_per_token` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP = 5
H100_H200_BF16_FLOPS = 989e12


class Experts(nn.Module):
    """The routed SwiGLU experts of one layer, dropless: tokens sorted by expert, three grouped GEMMs."""

    def __init__(self, d: int, hidden: int, experts: int, k: int, layers: int):
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(d, experts, bias=False)
        self.gate = nn.Parameter(torch.randn(experts, d, hidden) * 0.02)
        self.up = nn.Parameter(torch.randn(experts, d, hidden) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, hidden, d) * 0.02 / (2 * layers) ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).float().softmax(-1)
        weights, chosen = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        order = chosen.reshape(-1).argsort(stable=True)
        rows = order // self.k
        offsets = torch.bincount(chosen.reshape(-1), minlength=self.experts).cumsum(0).to(torch.int32)
        tokens = flat[rows].to(torch.bfloat16)
        h = F.silu(torch._grouped_mm(tokens, self.gate.to(torch.bfloat16), offs=offsets))
        h = h * torch._grouped_mm(tokens, self.up.to(torch.bfloat16), offs=offsets)
        out = torch._grouped_mm(h, self.down.to(torch.bfloat16), offs=offsets)
        out = out.float() * weights.reshape(-1)[order, None]
        combined = torch.zeros(flat.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, out)
        load = torch.bincount(chosen.reshape(-1), minlength=self.experts).float() / flat.shape[0]
        aux = self.experts * (load * probs.mean(0)).sum()
        return combined.to(x.dtype).view(x.shape), aux


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads = a.heads
        self.ln1 = nn.LayerNorm(a.d)
        self.qkv = nn.Linear(a.d, 3 * a.d, bias=False)
        self.o = nn.Linear(a.d, a.d, bias=False)
        self.ln2 = nn.LayerNorm(a.d)
        self.moe = Experts(a.d, a.hidden, a.experts, a.k, a.layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        out, aux = self.moe(self.ln2(x))
        return x + out, aux


class MoEGPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.emb, self.pos = nn.Embedding(a.vocab, a.d), nn.Embedding(a.seq, a.d)
        self.blocks = nn.ModuleList([Block(a) for _ in range(a.layers)])
        self.ln, self.head = nn.LayerNorm(a.d), nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos.weight[: idx.shape[1]]
        aux = 0.0
        for block in self.blocks:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, self.a.vocab), tgt.view(-1)) + self.a.aux * aux / len(self.blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in dict(d=2048, layers=16, heads=16, seq=2048, vocab=50304, batch=8, steps=20, experts=8, k=2,
                              hidden=5632).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--aux", type=float, default=0.01)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = MoEGPT(a).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    forward = torch.compile(model)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda")
    targets = torch.roll(tokens, -1, 1)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / a.steps
    active = a.layers * (4 * a.d * a.d + 3 * a.d * a.hidden * a.k + a.d * a.experts) + a.vocab * a.d
    flops_per_token = 6 * active + 12 * a.layers * a.d * a.seq
    tokens_per_s = a.batch * a.seq / seconds
    print(json.dumps(dict(
        peer="torch_moe", d=a.d, layers=a.layers, experts=a.experts, k=a.k, hidden=a.hidden, seq=a.seq,
        batch=a.batch, params_M=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        active_params_M=round(active / 1e6, 1), step_ms=round(seconds * 1e3, 2), tokens_per_s=round(tokens_per_s),
        mfu=round(flops_per_token * tokens_per_s / H100_H200_BF16_FLOPS, 3), loss=loss.item(),
        peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 1))))


if __name__ == "__main__":
    sys.exit(main())
