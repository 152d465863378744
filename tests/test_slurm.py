"""The SLURM template under a real Slurm: a one-node cluster on this machine (`make slurm`,
.ci/local_cluster.sh) runs scripts/slurm/train_per_gpu.sbatch as submitted with `sbatch`.

The template runs unchanged on a node without GPUs: the submission asks for one node, 2 tasks of one
CPU and no GPUs (`--gpus-per-node=0` overrides the template's 8), and each task gets 4 simulated CPU
devices through `JAXDIST_CPU_DEVICES=4`, which `sbatch` passes on to the job with the rest of the
environment. So Slurm starts the 2 processes, sets their SLURM_* variables, and delivers its requeue
and time-limit signals; jaxdist finds its peers through the template's coordinator address.
"""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import logged_losses, logged_steps, make_config

from jaxdist import loop

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "scripts" / "slurm" / "train_per_gpu.sbatch"
# Each pytest process names its jobs after itself, so that it can tell its own jobs from those of a
# process that was stopped before it cancelled them.
JOB_PREFIX = "jaxdist-slurm-test-"
JOB_NAME = f"{JOB_PREFIX}{os.getpid()}"
# The same layout in the one-process reference (8 devices) and the job (2 tasks x 4 devices).
LAYOUT = {"mesh": {"data": 2, "fsdp": 4, "tensor": 1}, "rules": {"preset": "fsdp"}}
REFERENCE_STEPS = 12
JOB_TIMEOUT_S = 240  # a job may wait for the node while another test's job holds it
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


def slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(autouse=True)
def one_job_at_a_time():
    """The node runs one job of 2 tasks at a time, and the tests time their jobs: across pytest's
    workers, one test of this module at a time (a job queued behind another's timed out before)."""
    with open(Path(tempfile.gettempdir()) / "jaxdist-slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def cluster():
    """The local cluster answers and its node is up. Jobs that test processes no longer running left
    behind are cancelled first, and every job this module submitted is cancelled at the end."""
    missing = [name for name in ("sbatch", "sinfo", "scontrol", "scancel") if shutil.which(name) is None]
    if missing:
        pytest.fail(f"no Slurm here ({', '.join(missing)} not found): run `make slurm` to install and start a "
                    f"one-node cluster")
    state = slurm("sinfo", "--noheader", "--format=%T", check=False)
    if state.returncode != 0 or not state.stdout.split():
        pytest.fail(f"Slurm does not answer (sinfo: {state.stderr.strip() or state.stdout.strip()}): run `make slurm` "
                    f"to start the one-node cluster")
    if not set(state.stdout.split()) & {"idle", "mixed", "allocated", "completing"}:
        pytest.fail(f"the Slurm node is {state.stdout.split()[0]}: run `make slurm` to bring it back")
    queued = [line.split() for line in slurm("squeue", "--noheader", "--format=%i %j").stdout.splitlines()]
    orphans = [job for job, name in queued
               if name.startswith(JOB_PREFIX) and not Path("/proc", name.removeprefix(JOB_PREFIX)).exists()]
    if orphans:
        slurm("scancel", *orphans, check=False)
    submitted: list[str] = []
    yield submitted
    if submitted:
        slurm("scancel", *submitted, check=False)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    """The tiny GPT recipe; each submission names its run_dir and length after it on the command line."""
    folder = tmp_path_factory.mktemp("config")
    path = folder / "tiny.yaml"
    path.write_text(make_config(folder / "unused", **LAYOUT).to_yaml())
    return path


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    """The uninterrupted run: this (pytest) process on all 8 devices, the same global batch."""
    run_dir = tmp_path_factory.mktemp("reference")
    loop.train(make_config(run_dir, **LAYOUT, train={"steps": REFERENCE_STEPS}))
    result = logged_losses(run_dir)
    assert len(result) == REFERENCE_STEPS and result[-1] < result[0]
    return result


def job_environment() -> dict[str, str]:
    """What `sbatch` passes on to the job: this machine's environment without settings that would
    change who a process is, the venv's `jaxdist` first on PATH, and 4 simulated devices per task."""
    foreign = ("JAX_", "JAXDIST_", "SLURM_", "SBATCH_", "SRUN_", "OMPI_")
    torchrun = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(foreign) and k not in torchrun}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAXDIST_CPU_DEVICES"] = "4"
    # The jobs share the test session's compilation cache: the first job compiles the step, the others load it.
    if "JAXDIST_TEST_JAX_CACHE" in os.environ:
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXDIST_TEST_JAX_CACHE"]
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def submit(cluster: list[str], tmp_path: Path, config: Path, *overrides: str, options: tuple[str, ...] = ()) -> tuple[str, Path]:
    """`sbatch` the template from the repository root; returns the job id and its output file."""
    output = tmp_path / "job.out"
    result = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--gpus-per-node=0", "--time=5", f"--output={output}",
         # A requeued job appends to its output instead of starting it afresh (both runs' lines stay).
         "--open-mode=append", *options, str(TEMPLATE), str(config), *overrides],
        env=job_environment(), cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    cluster.append(job_id)
    return job_id, output


def assert_both_tasks_stopped_by_the_notice(out: str, step: int) -> None:
    """JAX's preemption notifier caught Slurm's SIGTERM, and both tasks reached the preemption sync
    point at `step`, the step they saved. The notifier logs from a thread of its own: a task that the
    other's notice stops, and that saves and exits first, may never print its line (seen under load),
    so one task's line is asked for, and each task's sync point."""
    assert re.search(r"^[01]: .*preemption_notifier.*SIGTERM caught", out, re.M), out[-3000:]
    for task in (0, 1):
        assert re.search(rf"^{task}: .*\[process={task}\].*Reached preemption sync point, step={step}$", out,
                         re.M), out[-3000:]


def job_info(job_id: str) -> dict[str, str]:
    text = slurm("scontrol", "show", "job", "--oneliner", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for_line(job_id: str, output: Path, pattern: str, timeout: float = JOB_TIMEOUT_S) -> re.Match:
    """The first line of the job's output that matches `pattern`, waiting for it while the job runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = output.read_text() if output.exists() else ""
        found = re.search(pattern, text, re.M)
        if found:
            return found
        if job_info(job_id)["JobState"] in FINISHED:
            pytest.fail(f"job {job_id} ended without a line matching {pattern!r}:\n{text[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no line matched {pattern!r} within {timeout} s:\n{output.read_text()[-3000:]}")


def wait_until_finished(job_id: str, output: Path, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info["JobState"] in FINISHED:
            return info
        time.sleep(0.2)
    pytest.fail(f"job {job_id} still {info['JobState']} after {timeout} s:\n{output.read_text()[-3000:]}")


def test_job_trains_like_one_process(cluster, config_file, reference_losses, tmp_path):
    """2 tasks x 4 devices under srun give the losses of one process on 8 devices."""
    steps = 6
    job_id, output = submit(cluster, tmp_path, config_file, f"run_dir={tmp_path / 'run'}", f"train.steps={steps}")
    info = wait_until_finished(job_id, output)
    out = output.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    # srun --label: process 0's lines only; it reports both processes and the 8 devices.
    assert re.search(r"^0: mesh data=2 x stage=1 x fsdp=4 x tensor=1 on 8 devices \(2 process\(es\)\)", out, re.M), out
    assert not re.search(r"^1: step ", out, re.M)
    assert logged_steps(tmp_path / "run") == list(range(1, steps + 1))
    np.testing.assert_allclose(logged_losses(tmp_path / "run"), reference_losses[:steps], rtol=1e-5, atol=0)


def test_requeued_job_resumes_from_its_checkpoint(cluster, config_file, reference_losses, tmp_path):
    """`scontrol requeue` once checkpoint 2 is saved: Slurm sends SIGTERM to the tasks, both save at
    the same step and exit; the job runs again and the same command resumes from that checkpoint,
    ending with the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    job_id, output = submit(cluster, tmp_path, config_file, f"run_dir={run_dir}", f"train.steps={REFERENCE_STEPS}",
                            "checkpoint.every=2", options=("--requeue",))
    wait_for_line(job_id, output, r"^0: saved checkpoint step 2 ")
    slurm("scontrol", "requeue", job_id)
    # Slurm holds a requeued job for its credential lifetime (AuthInfo cred_expire, 120 s by default)
    # and starts it at a later scheduling pass; making it eligible now changes nothing the job sees.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job_info(job_id)["JobState"] != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
    info = wait_until_finished(job_id, output)
    out = output.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-3000:]

    stopped = re.search(r"^0: stopped by SIGTERM after step (\d+); checkpoint saved in (\S+);", out, re.M)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < REFERENCE_STEPS and stopped.group(2) == str(run_dir / "checkpoints" / str(step))
    assert_both_tasks_stopped_by_the_notice(out, step)
    assert re.search(rf"^0: resuming from step {step} \(checkpoint {re.escape(str(run_dir))}/checkpoints/{step},", out,
                     re.M), out[-3000:]
    # Each step logged once (the resumed run's lines follow the first run's) and the losses are the
    # uninterrupted run's.
    assert logged_steps(run_dir) == list(range(1, REFERENCE_STEPS + 1))
    np.testing.assert_allclose(logged_losses(run_dir), reference_losses, rtol=1e-5, atol=0)
    print(f"job {job_id}: stopped by Slurm's SIGTERM after step {step}, requeued, resumed from step {step}")


def test_signal_before_the_time_limit_saves_and_exits_0(cluster, config_file, tmp_path):
    """`sbatch --signal=TERM@120`: Slurm sends SIGTERM to the tasks before the time limit; the run
    saves at one step and exits 0 before the limit, and the job ends COMPLETED.

    slurmctld looks at time limits every 30 s and sends the signal at one of these looks. A job that
    asks for 10 minutes would get it some 8 minutes in; instead, once the job trains, its limit is
    lowered to 2 minutes (`scontrol update`, as a user may do to their own job): the signal's time
    has then passed, and the next look, about 30 s later at most, sends it. Slurm's timing and
    delivery are the same as at the end of any job; only the wait is shorter."""
    run_dir = tmp_path / "run"
    job_id, output = submit(cluster, tmp_path, config_file, f"run_dir={run_dir}", "train.steps=100000",
                            "checkpoint.every=100000", "log.every=5", options=("--time=10", "--signal=TERM@120"))
    wait_for_line(job_id, output, r"^0: step +\d+ +loss")
    assert job_info(job_id)["JobState"] == "RUNNING"
    slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=2")
    lowered = time.monotonic()
    info = wait_until_finished(job_id, output, timeout=110)
    waited = time.monotonic() - lowered
    out = output.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert info["TimeLimit"] == "00:02:00"
    stopped = re.search(r"^0: stopped by SIGTERM after step (\d+); checkpoint saved in (\S+);", out, re.M)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert stopped.group(2) == str(run_dir / "checkpoints" / str(step))
    assert (run_dir / "checkpoints" / str(step)).is_dir()
    assert_both_tasks_stopped_by_the_notice(out, step)
    assert waited < 45, waited  # the next time-limit pass (every 30 s) sent it, then the save
    print(f"job {job_id}: SIGTERM from --signal {waited:.1f} s after the limit was lowered; saved step {step}, exit 0")
