"""The suite is the same CPU-simulated spec on every host; `make test-gpu` runs only the tests marked
`gpu`, on the accelerator."""

import os
import subprocess
import sys
from pathlib import Path

import jax

TESTS = Path(__file__).parent


def test_the_suite_runs_on_the_simulated_cpu_devices():
    # Set by conftest before JAX starts, so that a GPU host runs the 8-device meshes as CI does.
    assert jax.default_backend() == "cpu" and jax.device_count() == 8


def test_gpu_tests_mode_selects_only_the_tests_marked_gpu():
    env = {**os.environ, "JAXDIST_GPU_TESTS": "1"}
    env.pop("JAX_PLATFORMS", None)  # as a GPU host's shell has it, not as this session set it
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(TESTS / "test_fp8.py"), str(TESTS / "test_clocks.py")],
        env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=240)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    selected = {line.split("::")[-1].split("[")[0] for line in listed.stdout.splitlines() if "::" in line}
    assert selected == {
        "test_on_hopper_the_projections_are_cublaslt_fp8_gemms",
        "test_the_fp8_step_needs_no_more_memory_than_bfloat16s",
        "test_bench_reports_the_clocks_of_its_timed_steps",
        "test_a_real_gpu_is_sampled_while_it_works",
    }, listed.stdout
    assert " deselected" in listed.stdout
