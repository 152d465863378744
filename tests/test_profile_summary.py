"""benchmarks/profile_summary.py reads a JAX profiler trace: kernel time by kind, GPU idle gaps, host events.

The numbers in the profile tables of benchmarks/reports/ come from it, so a miscount here would misreport them.
"""

import gzip
import importlib.util
import json
import os
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("profile_summary", Path(__file__).parents[1] / "benchmarks" / "profile_summary.py")
profile_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_summary)


def kernel(name: str, ts: float, dur: float, tid: int = 1, pid: int = 1) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def trace() -> dict:
    """GPU 0 with a compute and a collective stream, GPU 1, and the host: as `jax.profiler.trace` writes them."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "Stream #20(Collective)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 9, "tid": 7, "args": {"name": "python3"}},
    ]
    events = [
        kernel("nvjet_sm90_gemm", 0, 100),
        kernel("ncclDevKernel_AllReduce", 50, 100, tid=2),   # overlaps the GEMM: no gap
        kernel("loop_add_fusion", 153, 10),                  # 3 us after the collective ends
        kernel("Memset 0", 170, 1),                          # 7 us
        kernel("cudnn_flash_fprop", 1171, 29),               # 1000 us: the host held the GPU up
        kernel("sm90_xmma_wgrad_implicit_gemm_bf16_cudnn", 1200, 10),
        kernel("loop_add_fusion", 0, 5000, tid=3),           # "XLA Ops" line: derived, not a kernel
        kernel("nvjet_sm90_gemm", 0, 300, pid=2),            # the second GPU
        kernel("cuGraphLaunch", 10, 80, tid=7, pid=9),
        kernel("cuGraphLaunch", 500, 40, tid=7, pid=9),
        kernel("PjitFunction(jit(step))", 0, 1200, tid=7, pid=9),
    ]
    return {"traceEvents": meta + events}


def test_kernels_are_those_of_the_first_gpus_streams():
    kernels = profile_summary.gpu_kernels(trace())
    assert sorted(k["name"] for k in kernels) == sorted(
        ["nvjet_sm90_gemm", "ncclDevKernel_AllReduce", "loop_add_fusion", "Memset 0", "cudnn_flash_fprop",
         "sm90_xmma_wgrad_implicit_gemm_bf16_cudnn"])
    kinds = [profile_summary.kind(k["name"]) for k in kernels]
    assert sorted(kinds) == sorted(["matmul", "collective", "xla fusion/other", "copy", "attention", "convolution"])
    for name in ("loop_convert_fusion_2", "triton_poi_fused_add_convolution_backward_native_batch_norm_backward_7"):
        assert profile_summary.kind(name) == "xla fusion/other", name
    for name in ("_ZN17cutlass__5x_cudnn6KernelINS_4conv6kernel23ImplicitGemmConvolution",
                 "void nhwcAddPaddingKernel<__nv_bfloat16, __nv_bfloat16, float, true>"):
        assert profile_summary.kind(name) == "convolution", name


def test_idle_gaps_count_time_when_no_stream_runs_a_kernel():
    gaps = profile_summary.idle_gaps(profile_summary.gpu_kernels(trace()))
    assert gaps == [
        (3, "ncclDevKernel_AllReduce", "loop_add_fusion"),
        (7, "loop_add_fusion", "Memset 0"),
        (1000, "Memset 0", "cudnn_flash_fprop"),
    ]


def test_gap_report_buckets_per_step(capsys):
    profile_summary.print_gaps(profile_summary.gpu_kernels(trace()), steps=1)
    out = capsys.readouterr().out
    assert "GPU idle: 1.01 ms per step, 3 gaps per step" in out
    assert "500-5000  us:      1.0 gaps    1.00 ms" in out
    assert "1000.0  Memset 0 -> cudnn_flash_fprop" in out


def test_host_events_total_per_name_with_their_thread(capsys):
    events = profile_summary.host_events(trace())
    assert {e["name"] for e in events} == {"cuGraphLaunch", "PjitFunction(jit(step))"}
    assert all(e["thread"] == "python3" for e in events)
    profile_summary.print_host(events, steps=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["0.60", "0.5"] and lines[1].endswith("PjitFunction(jit(step))")
    assert lines[2].split()[:2] == ["0.06", "1.0"] and lines[2].endswith("cuGraphLaunch")


def test_collective_time_is_split_into_overlapped_and_alone(capsys):
    kernels = profile_summary.gpu_kernels(trace())
    # The all-reduce runs 50-150 us; the GEMM beside it until 100 us.
    assert profile_summary.collective_overlap(kernels) == (100, 50)
    profile_summary.print_summary(kernels, steps=1, top=1, source="synthetic")
    assert "collectives running: 0.10 ms per step, 0.05 beside other kernels, 0.05 alone" in capsys.readouterr().out


def test_each_collective_has_its_time_alone_and_the_kernel_before_it(capsys):
    kernels = profile_summary.gpu_kernels(trace())
    assert profile_summary.lone_collectives(kernels) == [(50, 100, "ncclDevKernel_AllReduce", "nvjet_sm90_gemm")]
    profile_summary.print_summary(kernels, steps=1, top=1, source="synthetic")
    assert "     50.0 of   100.0  ncclDevKernel_AllReduce  after nvjet_sm90_gemm" in capsys.readouterr().out


def test_difference_against_another_profile_by_kind_and_kernel(capsys):
    data_parallel = profile_summary.gpu_kernels(trace())
    one_gpu = [kernel("nvjet_sm90_gemm", 0, 80), kernel("loop_add_fusion", 100, 10), kernel("only_here", 120, 4)]
    profile_summary.print_difference(data_parallel, one_gpu, steps=1, top=3)
    lines = capsys.readouterr().out.splitlines()
    by_kind = {line[:20].strip(): line[20:].split() for line in lines[1:8]}
    assert by_kind == {
        "collective": ["0.10", "0.00", "+0.10"],
        "attention": ["0.03", "0.00", "+0.03"],
        "convolution": ["0.01", "0.00", "+0.01"],
        "matmul": ["0.10", "0.08", "+0.02"],
        "xla fusion/other": ["0.01", "0.01", "-0.00"],
        "copy": ["0.00", "0.00", "+0.00"],
        "all kernels": ["0.25", "0.09", "+0.16"],
    }
    changed = lines[lines.index("the 3 kernels whose time changed most:") + 1:]
    assert [line.split()[-1] for line in changed] == ["ncclDevKernel_AllReduce", "cudnn_flash_fprop", "nvjet_sm90_gemm"]
    assert changed[0].split()[:3] == ["0.10", "0.00", "+0.10"]


def test_a_missing_empty_or_cut_short_trace_is_one_message(tmp_path):
    """A run stopped while the profiler wrote (a time limit) leaves an empty or truncated file."""
    with pytest.raises(SystemExit, match="no perfetto_trace.json.gz under"):
        profile_summary.load_trace(str(tmp_path))
    older, newer = tmp_path / "a" / "perfetto_trace.json.gz", tmp_path / "b" / "perfetto_trace.json.gz"
    older.parent.mkdir()
    older.write_bytes(gzip.compress(json.dumps(trace()).encode()))
    os.utime(older, (0, 0))
    assert profile_summary.load_trace(str(tmp_path)) == trace()
    newer.parent.mkdir()
    for cut_short in (b"", gzip.compress(json.dumps(trace()).encode())[:40]):
        newer.write_bytes(cut_short)
        with pytest.raises(SystemExit, match=f"{newer} is empty or cut short"):
            profile_summary.load_trace(str(tmp_path))
