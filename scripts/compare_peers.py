"""Runs jaxdist's benchmark and the matching peer one after the other on this host; prints ratios.

    python3 scripts/compare_peers.py SUITE [SUITE ...] [--peers DIR] [--out results.jsonl]

Each run is a separate process (one GPU program at a time); every result is one JSON line. The
peers are shared/peers/*.py (torch_gpt.py, torch_dist.py, plain_jax_gpt.py); pass their folder.
Ratios are only meaningful within one call on one machine: absolute times drift between hosts.
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
# XLA's latency-hiding scheduler: overlaps collectives with compute.
LHS = ["env", "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true"]
# ... and all-reduces combined only up to 64 MiB, so the first layers' reductions can start early.
OVERLAP = ["env", "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true "
           "--xla_gpu_all_reduce_combine_threshold_bytes=67108864"]
# XLA merges dots that share an operand (q, k and v's projections) into one and then slices its output.
NO_DOT_MERGE = ["env", "XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=0"]
# NCCL's symmetric-memory kernels / zero-copy registered buffers for XLA's collectives.
SYMMETRIC = ["env", "XLA_FLAGS=--xla_gpu_experimental_enable_nccl_symmetric_buffers=true"]
USER_BUFFERS = ["env", "XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true"]
SYMMETRIC_USER = ["env", "XLA_FLAGS=--xla_gpu_experimental_enable_nccl_symmetric_buffers=true "
                  "--xla_gpu_enable_nccl_user_buffers=true"]
# cuBLASLt lets XLA fuse GELU (and a bias) into the matmul's epilogue.
CUBLASLT = ["env", "XLA_FLAGS=--xla_gpu_enable_cublaslt=true"]
# XLA's collective matmul: all-gather -> matmul and matmul -> reduce-scatter run as chunked loops
# whose transfers overlap the partial matmuls (needs sequence parallelism to produce those pairs).
WINDOWED = ["env", "XLA_FLAGS=--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0"]
WINDOWED_LHS = ["env", "XLA_FLAGS=--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0 "
                "--xla_gpu_enable_latency_hiding_scheduler=true"]
OVERLAP_8MB = ["env", "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true "
               "--xla_gpu_all_reduce_combine_threshold_bytes=8388608"]


def hlo_dump(folder: str) -> list[str]:
    """Runs a command with XLA writing the step's HLO into $OUT/folder (what a device call brings back)."""
    return ["env", f"XLA_FLAGS=--xla_dump_to={os.environ.get('OUT', '/tmp')}/{folder} --xla_dump_hlo_module_re=.*step.*"]


def suites(peers: str, gpus: int) -> dict[str, list[tuple[str, list[str]]]]:
    torch_gpt = [sys.executable, f"{peers}/torch_gpt.py"]
    dist = ["torchrun", "--standalone", f"--nproc_per_node={gpus}", f"{peers}/torch_dist.py"]
    b406 = 16 * gpus
    # --devices: the first `gpus` GPUs, so a 2-GPU suite can run on a 4-GPU host (--gpus 2).
    dp = ["configs/gpt_406m.yaml", f"train.global_batch={b406}", "mesh.data=-1", "mesh.fsdp=1", "rules.preset=dp",
          "--devices", str(gpus)]
    fsdp = ["configs/gpt_406m.yaml", f"train.global_batch={b406}", "--devices", str(gpus)]
    zero2 = fsdp + ["train.fsdp_gather=per_step"]
    dp2 = ["configs/gpt_406m.yaml", "train.global_batch=32", "mesh.data=-1", "mesh.fsdp=1", "rules.preset=dp",
           "--devices", "2"]
    tensor4 = ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "mesh.tensor=4", "rules.preset=tp", "--devices", "4"]
    torch_406m = torch_gpt + ["--batch", "16"]
    torch_1b4 = torch_gpt + ["--d", "2048", "--batch", "8"]
    torch_ddp = ["env", "MODE=ddp"] + dist
    torch_fsdp2 = ["env", "MODE=fsdp"] + dist
    # jaxdist's own 1-GPU step, the baseline of the multi-GPU ratios (first GPU of a larger host).
    one_gpu_406m = JAXDIST + ["configs/gpt_406m.yaml", "mesh.fsdp=1", "--devices", "1"]
    one_gpu_1b4 = JAXDIST + ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "--devices", "1"]
    return {
        "1gpu_406m": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m b16 unrolled", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("jaxdist 406m b16 scan", JAXDIST + ["configs/gpt_406m.yaml", "impl.scan_layers=true"]),
        ],
        "ablate_406m": [
            ("plain-jax 406m unrolled", [sys.executable, f"{peers}/plain_jax_gpt.py", "--scan", "0"]),
            ("jaxdist unrolled+profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("no clip, no wd", JAXDIST + ["configs/gpt_406m.yaml", "optim.clip_norm=null", "optim.weight_decay=0"]),
            ("bf16 logits", JAXDIST + ["configs/gpt_406m.yaml", "impl.logits_dtype=compute"]),
            ("no triton gemm", ["env", "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"] + JAXDIST + ["configs/gpt_406m.yaml"]),
        ],
        "ablate3_406m": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("loss_chunk=256", JAXDIST + ["configs/gpt_406m.yaml", "impl.loss_chunk=256"]),
            ("cublaslt", ["env", "XLA_FLAGS=--xla_gpu_enable_cublaslt=true"] + JAXDIST + ["configs/gpt_406m.yaml"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 b8", JAXDIST + ["configs/gpt_1b4.yaml"]),
            ("jaxdist 1b4 loss_chunk=256", JAXDIST + ["configs/gpt_1b4.yaml", "impl.loss_chunk=256"]),
        ],
        "remat_mlp": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile +hlo", ["env", "XLA_FLAGS=--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*step.*"]
             + JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("jaxdist 406m remat=mlp", JAXDIST + ["configs/gpt_406m.yaml", "impl.remat=mlp"]),
            ("jaxdist 406m loss_chunk=512", JAXDIST + ["configs/gpt_406m.yaml", "impl.loss_chunk=512"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 b8", JAXDIST + ["configs/gpt_1b4.yaml"]),
            ("jaxdist 1b4 remat=mlp", JAXDIST + ["configs/gpt_1b4.yaml", "impl.remat=mlp"]),
        ],
        "1gpu_1b4": [
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 b8 unrolled", JAXDIST + ["configs/gpt_1b4.yaml"]),
        ],
        "multi_406m": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("torch fsdp2", torch_fsdp2),
            ("jaxdist dp", JAXDIST + dp),
            ("jaxdist dp +lhs", LHS + JAXDIST + dp),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist fsdp +lhs", LHS + JAXDIST + fsdp),
        ],
        "multi_406m_short": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp", JAXDIST + dp),
            ("jaxdist dp +lhs", LHS + JAXDIST + dp),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        "dp_406m": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp", JAXDIST + dp),
            ("jaxdist dp +overlap", OVERLAP + JAXDIST + dp),
        ],
        "final_multi": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp", JAXDIST + dp),
            ("jaxdist dp +overlap 8MB", OVERLAP_8MB + JAXDIST + dp),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=4", JAXDIST + ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "mesh.tensor=4",
                                                "rules.preset=tp", "--devices", "4"]),
            ("jaxdist 1b4 tensor=4 sp", JAXDIST + ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "mesh.tensor=4",
                                                   "rules.preset=tp", "rules.activations.seq=tensor", "--devices", "4"]),
        ],
        "multi_final": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp +profile", JAXDIST + dp + ["--profile", "/tmp/prof_dp"]),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        "fsdp_check": [
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist fsdp loss_chunk=0", JAXDIST + fsdp + ["impl.loss_chunk=0"]),
            ("jaxdist fsdp remat=none", JAXDIST + fsdp + ["impl.remat=none"]),
        ],
        "tensor_1b4": [
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=2", JAXDIST + ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "mesh.tensor=2",
                                                "rules.preset=tp", "--devices", "2"]),
            ("jaxdist 1b4 tensor=4", JAXDIST + ["configs/gpt_1b4.yaml", "mesh.fsdp=1", "mesh.tensor=4",
                                                "rules.preset=tp", "--devices", "4"]),
        ],
        # Fused residual add + norm kernels (impl.norm_impl), against XLA's fusions, and the dot merger
        # (measured before jaxdist turned the merger off by default: now the first and last 406M runs match).
        "fused_norm": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("jaxdist 406m norm_impl=xla", JAXDIST + ["configs/gpt_406m.yaml", "impl.norm_impl=xla"]),
            ("jaxdist 406m no dot merger", NO_DOT_MERGE + JAXDIST + ["configs/gpt_406m.yaml"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 b8", JAXDIST + ["configs/gpt_1b4.yaml"]),
        ],
        # GELU in the up-projection's epilogue (cuBLASLt GELU_AUX), with and without recomputing it.
        "gelu_epilogue": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("cublaslt +profile", CUBLASLT + JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/prof_lt"]),
            ("cublaslt remat=none +profile", CUBLASLT + JAXDIST + ["configs/gpt_406m.yaml", "impl.remat=none",
                                                                    "--profile", "/tmp/prof_lt_none"]),
            ("remat=none", JAXDIST + ["configs/gpt_406m.yaml", "impl.remat=none"]),
        ],
        # The recipes with remat=none (GELU keeps only its input).
        "remat_none": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 b8", JAXDIST + ["configs/gpt_1b4.yaml"]),
            ("jaxdist 1b4 remat=mlp", JAXDIST + ["configs/gpt_1b4.yaml", "impl.remat=mlp"]),
        ],
        # Where the step's time goes besides kernels (profile idle gaps, host dispatch), whether XLA's
        # command buffers (CUDA graphs) matter, and whether cuBLASLt now takes the GELU epilogue.
        "gaps_406m": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/jaxdist_profile"]),
            ("jaxdist 406m cublaslt +hlo", ["env", "XLA_FLAGS=--xla_gpu_enable_cublaslt=true --xla_dump_to=/tmp/hlo_lt "
                                            "--xla_dump_hlo_module_re=.*step.*"] + JAXDIST + ["configs/gpt_406m.yaml"]),
            ("jaxdist 406m no command buffers", ["env", "XLA_FLAGS=--xla_gpu_enable_command_buffer="]
             + JAXDIST + ["configs/gpt_406m.yaml"]),
        ],
        # Data parallelism on 2 GPUs (run with --gpus 2): the tail after the backward pass, traced
        # back to back.
        "dp_tail": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp +profile", JAXDIST + dp + ["--profile", "/tmp/prof_dp"]),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        # Tensor parallelism at 4 GPUs: sequence parallelism with XLA's collective matmul (windowed
        # einsum: all-gather / reduce-scatter split into chunks that overlap the matmuls).
        "tensor_overlap": [
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=4", JAXDIST + tensor4),
            ("tensor=4 sp +windowed einsum", WINDOWED + JAXDIST + tensor4 + ["rules.activations.seq=tensor"]),
            ("tensor=4 sp +windowed +lhs", WINDOWED_LHS + JAXDIST + tensor4 + ["rules.activations.seq=tensor"]),
            ("tensor=4 batch 32", JAXDIST + tensor4 + ["train.global_batch=32"]),
        ],
        # NCCL's Simple protocol only (the DP profile's all-reduce kernels were RING_LL, the low-latency
        # protocol that spends more SM time per byte): data parallel at 2 GPUs, tensor=4 at 1.4B.
        "nccl_simple": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("jaxdist dp2 NCCL_PROTO=Simple", ["env", "NCCL_PROTO=Simple"] + JAXDIST + dp2),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist 1b4 tensor=4 NCCL_PROTO=Simple", ["env", "NCCL_PROTO=Simple"] + JAXDIST + tensor4),
            ("jaxdist 1b4 tensor=4", JAXDIST + tensor4),
        ],
        # Fourth round, 1 GPU: XLA without its Triton GEMMs (scripts/probe_gelu_epilogue.py showed the
        # cuBLASLt rewriter then takes the GELU into the epilogue).
        "next_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("jaxdist 406m no triton gemm", ["env", "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"]
             + JAXDIST + ["configs/gpt_406m.yaml"]),
            ("406m no triton, cublaslt +prof", ["env", "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false "
                                                "--xla_gpu_enable_cublaslt=true"]
             + JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/prof_lt_notriton"]),
        ],
        # Fourth round, with Triton GEMMs off by default (the MLP's GELU in cuBLASLt's epilogue):
        # data parallel on 2 GPUs (run with --gpus 2) with and without the latency-hiding scheduler,
        # the scheduler's run profiled, and FSDP.
        "r4_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist dp2 +lhs +profile", LHS + JAXDIST + dp2 + ["--profile", "/tmp/prof_dp_lhs"]),
            ("jaxdist dp2 +lhs one CUDA queue", ["env", "CUDA_DEVICE_MAX_CONNECTIONS=1"] + LHS + JAXDIST + dp2),
            ("jaxdist dp2 NCCL_MAX_NCHANNELS=4", ["env", "NCCL_MAX_NCHANNELS=4"] + JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        # ... 1.4B on one GPU against torch, and tensor=4 with the scheduler and/or impl.batch_chunks=2.
        "r4_tensor": [
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=4", JAXDIST + tensor4),
            ("tensor=4 +lhs", LHS + JAXDIST + tensor4),
            ("tensor=4 batch_chunks=2", JAXDIST + tensor4 + ["impl.batch_chunks=2"]),
            ("tensor=4 batch_chunks=2 +lhs", LHS + JAXDIST + tensor4 + ["impl.batch_chunks=2"]),
        ],
        # ... after the one-pass logsumexp (1 GPU); DP as the gathered embedding-gradient experiment
        # was measured (since removed: it now measures main), with the 1-GPU step's optimized HLO.
        "r4b_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/prof_406m"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4", JAXDIST + ["configs/gpt_1b4.yaml"]),
        ],
        "r4b_dp": [
            ("jaxdist 406m 1gpu +hlo", hlo_dump("hlo") + one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist dp2 +lhs +profile", LHS + JAXDIST + dp2 + ["--profile", "/tmp/prof_dp_lhs"]),
            ("torch fsdp2", torch_fsdp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        # Fifth round: the MLP's GELU gradient in cuBLASLt's epilogue (impl.gelu_grad_impl) against
        # XLA's separate pass, on one GPU at both sizes, both profiled.
        "r5b_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m +profile", JAXDIST + ["configs/gpt_406m.yaml", "--profile", "/tmp/prof_406m"]),
            ("jaxdist 406m gelu_grad_impl=xla", JAXDIST + ["configs/gpt_406m.yaml", "impl.gelu_grad_impl=xla"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 +profile", JAXDIST + ["configs/gpt_1b4.yaml", "--profile", "/tmp/prof_1b4"]),
            ("jaxdist 1b4 gelu_grad_impl=xla", JAXDIST + ["configs/gpt_1b4.yaml", "impl.gelu_grad_impl=xla"]),
        ],
        # ... with the matmul weights' compute-dtype copies kept between steps (precision.compute_copies).
        "r5c_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("jaxdist 406m compute_copies=false", JAXDIST + ["configs/gpt_406m.yaml", "precision.compute_copies=false"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4 +profile", JAXDIST + ["configs/gpt_1b4.yaml", "--profile", "/tmp/prof_1b4"]),
            ("jaxdist 1b4 compute_copies=false", JAXDIST + ["configs/gpt_1b4.yaml", "precision.compute_copies=false"]),
        ],
        # The final code's 1-GPU ratios, on whichever card the call gets.
        "r8_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4", JAXDIST + ["configs/gpt_1b4.yaml"]),
        ],
        # ... data parallel, FSDP and their torch peers on 2 GPUs (run with --gpus 2 on a 4-GPU
        # host), then tensor=4 at 1.4B: the kernel per shard under each layout.
        "r5c_multi": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("torch fsdp2", torch_fsdp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist 1b4 1gpu", one_gpu_1b4),
            ("jaxdist 1b4 tensor=4", JAXDIST + tensor4),
        ],
        # Sixth round, data parallel on 2 GPUs (run with --gpus 2): both steps profiled (and the DP
        # step's optimized HLO dumped) to see where DP loses its time against one GPU; DP as two
        # processes of one GPU each, as torchrun runs DDP; the scheduler.
        "r6_dp": [
            ("jaxdist 406m 1gpu +profile", one_gpu_406m + ["--profile", "/tmp/prof_1gpu"]),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2 +profile +hlo", hlo_dump("hlo_dp2") + JAXDIST + dp2 + ["--profile", "/tmp/prof_dp2"]),
            ("jaxdist dp2 two processes", [sys.executable, "-m", "jaxdist.cli", "launch", "-n", "2", "--", "bench"]
             + dp2[:-2]),
            ("jaxdist dp2 +lhs +profile", LHS + JAXDIST + dp2 + ["--profile", "/tmp/prof_dp2_lhs"]),
        ],
        # ... data parallelism and FSDP, with the latency-hiding scheduler.
        "r6b_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2 +profile +hlo", hlo_dump("hlo_dp2") + JAXDIST + dp2 + ["--profile", "/tmp/prof_dp2"]),
            ("jaxdist dp2 +lhs", LHS + JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist 406m 1gpu again", one_gpu_406m),
        ],
        # ... with fewer NCCL channels (fewer SMs taken from the matmuls) or NCCL's Simple protocol.
        "r6c_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("dp2 NCCL_MAX_NCHANNELS=4", ["env", "NCCL_MAX_NCHANNELS=4"] + JAXDIST + dp2),
            ("dp2 NCCL_MAX_NCHANNELS=2", ["env", "NCCL_MAX_NCHANNELS=2"] + JAXDIST + dp2),
            ("dp2 NCCL_PROTO=Simple", ["env", "NCCL_PROTO=Simple"] + JAXDIST + dp2),
        ],
        # ZeRO-2 in its first form (train.fsdp_gather=per_step with the bf16 copies kept whole between
        # steps, gathered by the update; replaced after r8_dp).
        "r7_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist zero2", JAXDIST + zero2),
            ("jaxdist zero2 +profile", JAXDIST + zero2 + ["--profile", "/tmp/prof_zero2"]),
            ("jaxdist fsdp", JAXDIST + fsdp),
        ],
        # The copies gathered whole in the forward and kept for the backward (FSDP2's
        # reshard_after_forward=False); this call ran it as `fsdp_gather=per_microbatch`, which
        # then replaced per_step's gathering by the update (r7_dp's "zero2").
        "r8_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist zero2", JAXDIST + zero2),
            ("jaxdist zero2 +profile", JAXDIST + zero2 + ["--profile", "/tmp/prof_pm"]),
        ],
        # ... again, with the ZeRO-2 step's HLO (which collectives carry the gradients).
        "r8b_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist zero2 +hlo", hlo_dump("hlo_zero2") + JAXDIST + zero2),
        ],
        # NCCL's symmetric-memory kernels (XLA places the collectives' buffers in memory registered
        # with NCCL: fewer SMs per byte) and zero-copy user buffers, under data parallel; FSDP and
        # ZeRO-2 with the head gathered once per step (the chunked loss's fix).
        "r9_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist dp2 symmetric", SYMMETRIC + JAXDIST + dp2),
            ("jaxdist dp2 user buffers", USER_BUFFERS + JAXDIST + dp2),
            ("jaxdist dp2 symmetric cta=1", ["env", "NCCL_CTA_POLICY=1"] + SYMMETRIC + JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist zero2", JAXDIST + zero2),
        ],
        # r9_dp's NCCL settings again, alone and together; dp2 twice (noise).
        "r9b_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist dp2 user buffers", USER_BUFFERS + JAXDIST + dp2),
            ("jaxdist dp2 cta=1", ["env", "NCCL_CTA_POLICY=1"] + JAXDIST + dp2),
            ("jaxdist dp2 sym+ub cta=1", ["env", "NCCL_CTA_POLICY=1"] + SYMMETRIC_USER + JAXDIST + dp2),
            ("jaxdist dp2 again", JAXDIST + dp2),
        ],
        # FSDP and ZeRO-2 with the head gathered once, again on a second machine (FSDP twice: noise).
        "r9d_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist zero2", JAXDIST + zero2),
            ("jaxdist fsdp again", JAXDIST + fsdp),
        ],
        # Ninth round: each loss chunk's softmax and logits gradient as one Pallas kernel
        # (impl.loss_impl: auto) against XLA's two passes, on one GPU, then data parallel on 2.
        "r10_1gpu": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m", JAXDIST + ["configs/gpt_406m.yaml"]),
            ("jaxdist 406m loss_impl=xla", JAXDIST + ["configs/gpt_406m.yaml", "impl.loss_impl=xla"]),
            ("torch 1b4 b8", torch_1b4),
            ("jaxdist 1b4", JAXDIST + ["configs/gpt_1b4.yaml"]),
            ("jaxdist 1b4 loss_impl=xla", JAXDIST + ["configs/gpt_1b4.yaml", "impl.loss_impl=xla"]),
        ],
        "r10_dp": [
            ("jaxdist 406m 1gpu", one_gpu_406m),
            ("torch ddp", torch_ddp),
            ("jaxdist dp2", JAXDIST + dp2),
            ("jaxdist fsdp", JAXDIST + fsdp),
            ("jaxdist dp2 loss_impl=xla", JAXDIST + dp2 + ["impl.loss_impl=xla"]),
        ],
        # The fused, chunked cross-entropy (impl.loss_chunk): peak memory and step time per chunk size.
        "loss_chunk_406m": [
            ("torch 406m b16", torch_406m),
            ("jaxdist 406m b16", JAXDIST + ["configs/gpt_406m.yaml"]),
            *[(f"jaxdist 406m loss_chunk={c}", JAXDIST + ["configs/gpt_406m.yaml", f"impl.loss_chunk={c}"])
              for c in (128, 256, 512)],
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
    for key in ("tokens_per_sec_per_device", "tokens_per_s_per_gpu"):
        if key in result:
            return result[key]
    return result.get("tokens_per_s")


def table(results: list[dict]) -> str:
    base = next((per_device(r) for r in results if "error" not in r), None)
    rows = [f"{'run':<28} {'step ms':>8} {'tok/s/dev':>10} {'MFU':>6} {'mem GiB':>8} {'compile s':>9} {'vs first':>8}"
            f" {'MHz':>5} {'W':>4}"]
    for r in results:
        if "error" in r:
            rows.append(f"{r['label']:<28} {r['error']}")
            continue
        tps = per_device(r)
        mem = r.get("peak_mem_gib") or r.get("peak_mem_GiB") or ""
        rows.append(
            f"{r['label']:<28} {r['step_ms']:>8} {tps:>10,} {r['mfu']:>6.3f} {mem!s:>8} "
            f"{r.get('compile_s', '')!s:>9} {tps / base:>8.3f} {r.get('sm_clock_mhz', '')!s:>5} {r.get('power_w', '')!s:>4}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+")
    parser.add_argument("--peers", default=os.environ.get("JAXDIST_PEERS", "../shared/peers"))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for multi-GPU suites (default: all)")
    parser.add_argument("--out", help="append every result as a JSON line")
    parser.add_argument("--timeout", type=int, default=420)
    args = parser.parse_args()
    # Every run inherits jaxdist's XLA flags, so the plain-JAX peer compiles under the same ones.
    jaxdist.gpu_defaults()
    gpus = args.gpus or int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU "))
    known = suites(args.peers, gpus)
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
