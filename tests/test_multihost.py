"""Multi-host: the same program on 2 processes x 4 simulated CPU devices, joined by jax.distributed.

The multi-process tests start `jaxdist launch -n 2 --devices-per-process 4` (or a lone process with
deliberately wrong settings) as real subprocesses on localhost.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import logged_losses, logged_steps, make_config

from jaxdist import loop
from jaxdist.errors import UserError
from jaxdist.commands.launch import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240

# Same layout under 1 process x 8 devices and 2 processes x 4: data=2 (one slice per process) x fsdp=4.
LAYOUT = {"mesh": {"data": 2, "fsdp": 4, "tensor": 1}, "rules": {"preset": "fsdp"}}
TRAIN_STEPS = 4


def write_config(path: Path, cfg) -> Path:
    path.write_text(cfg.to_yaml())
    return path


_COMPILE_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """The launched processes share JAX's compilation cache: the train and kill tests compile one step."""
    _COMPILE_CACHE["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    _COMPILE_CACHE["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    yield
    _COMPILE_CACHE.clear()


_TORCHRUN = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def _foreign(key: str) -> bool:
    """Settings of the machine running the tests that would change who a launched process is."""
    return key.startswith(("JAX_", "JAXDIST_", "SLURM_", "OMPI_")) or key in _TORCHRUN or "proxy" in key.lower()


def jaxdist_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _foreign(k)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **_COMPILE_CACHE, **extra}


def run_jaxdist(*args: str, env: dict[str, str] | None = None, timeout: float = LAUNCH_TIMEOUT_S):
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args], env=env or jaxdist_env(), capture_output=True,
        text=True, timeout=timeout, cwd=REPO,
    )


# -- the training Must-show: launch -n 2 gives the 1 x 8 losses ------------------------------------

REFERENCE_STEPS = 6


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
    """The reference: this (pytest) process with all 8 devices, same layout."""
    run_dir = tmp_path_factory.mktemp("one_process")
    loop.train(make_config(run_dir, **LAYOUT, train={"steps": REFERENCE_STEPS}))
    result = logged_losses(run_dir)
    assert len(result) == REFERENCE_STEPS and result[-1] < result[0]
    return result


def launch_train(config_file: Path) -> subprocess.CompletedProcess:
    return run_jaxdist("launch", "-n", "2", "--devices-per-process", "4", "--log", str(config_file.with_suffix(".log")),
                       "--", "train", str(config_file))


# What the launcher writes to its log file rather than among the run's lines (jaxdist.commands.launch.LIBRARY_NOTES).
LIBRARY_NOTE_WORDS = re.compile(r"Gloo|peer ranks|preemption_notifier|absl")


def test_launch_two_processes_trains_like_one_process(tmp_path, one_process_losses):
    cfg = make_config(tmp_path / "two", **LAYOUT, train={"steps": TRAIN_STEPS}, sample={"tokens": 6})
    result = launch_train(write_config(tmp_path / "two.yaml", cfg))
    assert result.returncode == 0, result.stderr[-3000:]

    two = logged_losses(tmp_path / "two")  # one line per step: only process 0 writes metrics
    assert len(two) == TRAIN_STEPS
    np.testing.assert_allclose(two, one_process_losses[:TRAIN_STEPS], rtol=1e-5, atol=0)

    out = result.stdout.splitlines()
    assert any(line.startswith("[0] mesh data=2 x stage=1 x fsdp=4") and "(2 process(es))" in line
               and line.endswith("process 0 feeds rows 0-7 of each global batch of 16") for line in out)
    assert sum(re.match(r"\[0\] step +\d+ +loss", line) is not None for line in out) == TRAIN_STEPS
    assert not [line for line in out if line.startswith("[1] ") and ("step" in line or "mesh" in line)]
    assert "[0] --- sample ---" in out  # generation gathers its rows from both processes
    # gloo's notes on its connections go to the launcher's log file, named in one line.
    assert not LIBRARY_NOTE_WORDS.search(result.stdout + result.stderr), result.stdout + result.stderr
    log = tmp_path / "two.log"
    assert f"libraries' notes (gloo connections, preemption notices) go to {log}" in result.stderr
    assert "[Gloo] Rank" in log.read_text()


# -- checkpoints across process counts --------------------------------------------------------------


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_checkpoint_restores_under_another_process_count(tmp_path, one_process_losses, first, second):
    """A run checkpointed by `first` processes resumes under `second` and continues the same losses."""
    run_dir = tmp_path / "run"

    def train(processes: int, steps: int) -> None:
        cfg = make_config(run_dir, **LAYOUT, train={"steps": steps}, checkpoint={"every": 2})
        if processes == 1:
            loop.train(cfg)
        else:
            result = launch_train(write_config(tmp_path / f"to_{steps}.yaml", cfg))
            assert result.returncode == 0, result.stderr[-3000:]

    train(first, 4)
    train(second, REFERENCE_STEPS)
    steps = logged_steps(run_dir)
    assert steps == list(range(1, REFERENCE_STEPS + 1)), steps  # resumed at step 5, not restarted
    np.testing.assert_allclose(logged_losses(run_dir), one_process_losses, rtol=1e-5, atol=0)


def test_damaged_checkpoints_are_set_aside_by_every_process(tmp_path, one_process_losses):
    """Checkpoint 6's meta is not UTF-8 (met when choosing where to resume) and an array of
    checkpoint 4 is corrupt (met when restoring): both processes set both aside together and
    resume from step 2."""
    run_dir = tmp_path / "run"
    loop.train(make_config(run_dir, **LAYOUT, train={"steps": REFERENCE_STEPS}, checkpoint={"every": 2}))
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "6" / "meta" / "metadata").write_bytes(b"\x9a" * 64)
    data = max((f for f in (checkpoints / "4" / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    corrupt = bytearray(data.read_bytes())
    for i in range(len(corrupt) // 2, len(corrupt) // 2 + 8):
        corrupt[i] ^= 0xFF
    data.write_bytes(bytes(corrupt))
    cfg = make_config(run_dir, **LAYOUT, train={"steps": REFERENCE_STEPS}, checkpoint={"every": 2})
    result = launch_train(write_config(tmp_path / "resume.yaml", cfg))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"checkpoint {checkpoints / '6'} is unreadable (UnicodeDecodeError" in result.stderr
    assert f"checkpoint {checkpoints / '4'} is unreadable" in result.stderr
    assert "resuming from step 2 (" in result.stdout
    assert sorted(path.name for path in checkpoints.iterdir()) == ["2", "4", "6", "unreadable-4", "unreadable-6"]
    np.testing.assert_allclose(logged_losses(run_dir), one_process_losses, rtol=1e-5, atol=0)


# -- the launcher stops everything when one process dies -------------------------------------------


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.killpg(pid, 0)  # each child leads its own process group
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@contextlib.contextmanager
def launch_in_background(config_file: Path, *options: str, processes: int = 2,
                         devices: int = 4) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`launch -n 2 --devices-per-process 4 [OPTIONS] -- train CONFIG` running: yields the launcher (read
    its stdout) and the list its stderr lines collect in. Its --timeout bounds every read of its output."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.cli", "launch", "-n", str(processes), "--devices-per-process", str(devices),
         "--timeout", "120",
         "--log", str(config_file.with_suffix(".log")), *options, "--", "train", str(config_file)],
        env=jaxdist_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    stderr_lines: list[str] = []
    drain = threading.Thread(target=lambda: stderr_lines.extend(launcher.stderr), daemon=True)
    drain.start()
    try:
        yield launcher, stderr_lines
    finally:
        if launcher.poll() is None:
            launcher.kill()  # its processes die with it
        drain.join(timeout=10)


def read_until(launcher: subprocess.Popen, pattern: str, stderr_lines: list[str]) -> str:
    """The first line of the launcher's stdout that matches `pattern` (a regular expression)."""
    for line in launcher.stdout:
        if re.match(pattern, line):
            return line
    pytest.fail(f"no line matched {pattern!r}: " + "".join(stderr_lines)[-3000:])


def launched_pids(stderr_lines: list[str]) -> list[int]:
    """The pids of the latest group the launcher started."""
    started = [line for line in stderr_lines if re.search(r"started \d+ process\(es\)", line)][-1]
    return [int(pid) for pid in started.rsplit("pids ", 1)[1].split(", ")]


def test_killing_one_process_stops_the_launcher(tmp_path):
    cfg = make_config(tmp_path / "run", **LAYOUT, train={"steps": 100_000}, log={"every": 1})
    with launch_in_background(write_config(tmp_path / "long.yaml", cfg)) as (launcher, stderr_lines):
        # Both joined and process 0 compiled: about to step together.
        read_until(launcher, re.escape("[0] ready to train"), stderr_lines)
        pids = launched_pids(stderr_lines)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.stdout.read()
        code = launcher.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    assert code != 0
    assert elapsed < 60, elapsed
    assert _pids_alive(pids) == []  # neither process nor anything in their process groups is left
    assert any("process 1 exited with signal SIGKILL; stopping process 0" in line
               for line in stderr_lines), stderr_lines[-5:]
    print(f"launcher exited {code} {elapsed:.2f} s after process 1 was killed")


def test_an_elastic_group_goes_on_without_each_process_it_loses(tmp_path):
    """launch -n 4 --max-restarts 3 --min-processes 2: the last process is killed once checkpoint 2 is
    complete; the restart leaves it out, the run resumes from the newest complete checkpoint on the
    3 processes' 6 devices with the same global batch, and ends with the losses of an uninterrupted
    run on all 8 (each step logged once: re-run steps replace their first lines). The launcher's
    shrinking down to its minimum, and its stop below it: tests/test_launch.py."""
    # Data parallel: 24 rows divide over 8 and 6 devices (FSDP would split d_model=64 six ways too).
    elastic = {"mesh": {"data": -1, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"},
               "train": {"steps": 6, "global_batch": 24}}
    reference_dir = tmp_path / "reference"
    loop.train(make_config(reference_dir, **elastic))
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, **elastic, checkpoint={"every": 2})
    with launch_in_background(write_config(tmp_path / "c.yaml", cfg), "--max-restarts", "3", "--min-processes", "2",
                              processes=4, devices=2) as (launcher, stderr_lines):
        read_until(launcher, r"\[0\] saved checkpoint step 2 ", stderr_lines)
        os.kill(launched_pids(stderr_lines)[-1], signal.SIGKILL)
        rest = launcher.stdout.read()
        code = launcher.wait(timeout=LAUNCH_TIMEOUT_S)
    said = "".join(stderr_lines)
    assert code == 0, said[-3000:]
    assert [int(n) for n in re.findall(r"started (\d+) process\(es\)", said)] == [4, 3]
    assert ("process 3 exited with signal SIGKILL; stopping processes 0, 1, 2; restarting the group without it "
            "(1 of 3): 3 processes (--min-processes 2), the same config and train.global_batch on fewer devices") in said
    assert re.search(r"^\[0\] mesh data=6 x stage=1 x fsdp=1 x tensor=1 on 6 devices \(3 process", rest, re.M), rest[-2000:]
    steps = logged_steps(run_dir)
    assert steps == list(range(1, 7)), steps
    np.testing.assert_allclose(logged_losses(run_dir), logged_losses(reference_dir), rtol=1e-5, atol=0)


def test_an_export_by_two_processes_is_the_export_by_one(tmp_path):
    """`launch -n 2 -- export RUN OUT --format hf`: each process reads its shards, process 0 writes the
    folder; it holds the tensors and config.json one process writes."""
    from jaxdist import cli
    from jaxdist.checkpoint import safetensors_file
    from jaxdist.config import Config

    run_dir = tmp_path / "run"
    raw = make_config(run_dir, train={"steps": 2}, checkpoint={"every": 2}).model_dump(mode="json")
    raw["model"] = {"init_from": f"hf:{REPO / 'tests' / 'fixtures' / 'hf' / 'llama'}", "seq_len": 16}
    loop.train(Config.model_validate(raw))
    assert cli.main(["export", str(run_dir), str(tmp_path / "one"), "--format", "hf"]) == 0
    run = run_jaxdist("launch", "-n", "2", "--devices-per-process", "4", "--log", str(tmp_path / "launch.log"), "--",
                      "export", str(run_dir), str(tmp_path / "two"), "--format", "hf")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[0] wrote a Hugging Face folder (params at step 2)" in run.stdout and "[1] wrote" not in run.stdout

    def tensors(folder):
        files = [safetensors_file.File(path) for path in sorted(folder.glob("*.safetensors"))]
        return {name: file.get(name) for file in files for name in file.keys()}

    one, two = tensors(tmp_path / "one"), tensors(tmp_path / "two")
    assert sorted(one) == sorted(two) and len(one) > 10
    for name in one:
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    assert (tmp_path / "one" / "config.json").read_text() == (tmp_path / "two" / "config.json").read_text()


# fsdp spans both processes, so each process writes its own shards: a checkpoint shows who saved it.
SPREAD = {"mesh": {"data": 1, "fsdp": 8, "tensor": 1}, "rules": {"preset": "fsdp"}}


def test_sigterm_to_the_launcher_saves_at_one_step_and_resumes(tmp_path):
    """SIGTERM to the launcher reaches JAX's preemption notifier in both processes: both stop after
    the same step, save it together, exit 0, and a resumed run continues the uninterrupted losses."""
    from jaxdist.checkpoint import Checkpoints

    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, **SPREAD, train={"steps": 1000}, checkpoint={"every": 1000})
    with launch_in_background(write_config(tmp_path / "long.yaml", cfg)) as (launcher, stderr_lines):
        first = int(read_until(launcher, r"\[0\] step +\d+ +loss", stderr_lines).split()[2])
        launcher.send_signal(signal.SIGTERM)
        rest = launcher.stdout.read()
        code = launcher.wait(timeout=60)
    stopped = re.search(r"^\[0\] stopped by SIGTERM after step (\d+); checkpoint saved in (\S+);", rest, re.M)
    assert stopped, rest[-3000:] + "".join(stderr_lines)[-3000:]
    step = int(stopped.group(1))
    assert code == 0, "".join(stderr_lines)[-3000:]
    assert "jaxdist launch: every process exited 0 after SIGTERM\n" in stderr_lines
    assert _pids_alive(launched_pids(stderr_lines)) == []
    # JAX's and Orbax's notes on the SIGTERM go to the launcher's log file.
    assert not LIBRARY_NOTE_WORDS.search(rest + "".join(stderr_lines)), rest + "".join(stderr_lines)
    notes = (tmp_path / "long.log").read_text()
    assert "preemption_notifier.cc" in notes and "Reached preemption sync point" in notes
    assert first <= step < cfg.train.steps

    saved = run_dir / "checkpoints" / str(step)
    assert stopped.group(2) == str(saved)
    with Checkpoints(run_dir / "checkpoints", create=False) as store:
        assert store.steps() == [step]  # complete, and nothing saved at another step
        assert store.meta(step)["process_count"] == 2
    # Saving is collective: process 1 wrote its shards of this very step, so it stopped there too.
    assert sorted(path.name for path in (saved / "state").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]

    loop.train(make_config(run_dir, **SPREAD, train={"steps": step + 2}, checkpoint={"every": 1000}))
    steps = logged_steps(run_dir)
    assert steps == list(range(1, step + 3)), steps  # resumed after `step`, not restarted
    reference = tmp_path / "uninterrupted"
    loop.train(make_config(reference, **SPREAD, train={"steps": step + 2}))
    np.testing.assert_allclose(logged_losses(run_dir), logged_losses(reference), rtol=1e-5, atol=0)


# -- doctor ----------------------------------------------------------------------------------------


def test_doctor_passes_under_launch(tmp_path):
    result = run_jaxdist("launch", "-n", "2", "--devices-per-process", "4", "--log", str(tmp_path / "launch.log"), "--",
                         "doctor", "mesh.tensor=2", "--megabytes", "0.25")
    assert result.returncode == 0, result.stderr[-3000:]
    out = [line.removeprefix("[0] ") for line in result.stdout.splitlines() if line.startswith("[0] ")]
    assert "doctor: 2 process(es), 8 devices, mesh data=2 x stage=1 x fsdp=2 x tensor=2" in out
    assert sum(re.match(r"process [01]  host \S+  4 device\(s\) \(cpu\)", line) is not None for line in out) == 2
    checks = [line.split() for line in out if line.split()[:1] in (["all-reduce"], ["all-gather"], ["ppermute"])]
    assert len(checks) == 12 and all(row[-1] == "ok" for row in checks), checks
    # The data axis joins the two processes; fsdp and tensor stay inside each.
    links = {row[1]: " ".join(row[2:4]) for row in checks}
    assert links == {"data+fsdp+tensor": "across processes", "data": "across processes",
                     "fsdp": "within a", "tensor": "within a"}
    bandwidth = [line.split() for line in out if re.match(r"(data|fsdp|tensor)\S* +\d+ ", line)]
    assert [row[0] for row in bandwidth] == ["data+fsdp+tensor", "data", "fsdp", "tensor"]
    assert all(float(row[-3]) > 0 and float(row[-1]) > 0 for row in bandwidth), bandwidth
    assert "doctor: 12 of 12 collective checks passed" in out


def test_doctor_checks_catch_a_wrong_result(devices):
    """The checker compares against numpy; a collective that moved data the wrong way is caught."""
    from jaxdist.observe import mesh_health
    from jaxdist.parallel.mesh import build_mesh

    mesh = build_mesh({"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}, devices)
    x = mesh_health.check_input(mesh)
    results = mesh_health.run_checks(mesh)
    assert len(results) == 12 and all(r.ok for r in results)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*mesh.axis_names, None))
    inputs = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    ring = ("data", "fsdp", "tensor")
    dims = tuple(mesh.axis_names.index(axis) for axis in ring)
    shifted = mesh_health.collective_program("ppermute", mesh, ring)(inputs)
    assert mesh_health.mismatched_shards(shifted, mesh_health.expected_result("ppermute", x, dims)) == 0
    assert mesh_health.mismatched_shards(shifted, x) == 8  # had nothing moved, every shard is flagged
    summed = mesh_health.collective_program("all-reduce", mesh, ("data", "tensor"))(inputs)
    first = np.asarray(summed.addressable_shards[0].data).reshape(-1)[0]
    assert first == x.sum(axis=(mesh.axis_names.index("data"), mesh.axis_names.index("tensor"))).reshape(-1)[0]


# -- wrong settings: a clear one-line error within the timeout -------------------------------------


def _single_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("jaxdist: error: ")
    return lines[0]


def test_process_id_not_below_count_is_a_user_error(tmp_path):
    config_file = write_config(tmp_path / "c.yaml", make_config(tmp_path / "run"))
    env = jaxdist_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="2")
    result = run_jaxdist("train", str(config_file), env=env, timeout=60)
    assert result.returncode == 2
    assert "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2" in _single_line_error(result.stderr)


def test_unreachable_coordinator_and_missing_peer_fail_within_the_timeout(tmp_path):
    config_file = write_config(tmp_path / "c.yaml", make_config(tmp_path / "run"))
    timeout_s = 3
    nobody, lonely = free_port(), free_port()
    started = time.monotonic()
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "jaxdist.cli", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(process_id), "--init-timeout", str(timeout_s), "train", str(config_file)],
            env=jaxdist_env(JAXDIST_CPU_DEVICES="4"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, port, process_id in (("unreachable", nobody, 1), ("missing_peer", lonely, 0))
    }
    outcomes = {name: (run.communicate(timeout=60), run.returncode) for name, run in runs.items()}
    elapsed = time.monotonic() - started
    for name, ((_, stderr), code) in outcomes.items():
        assert code == 2, (name, stderr[-3000:])
    unreachable = _single_line_error(outcomes["unreachable"][0][1])
    assert f"nothing answered at coordinator 127.0.0.1:{nobody} within {timeout_s} s" in unreachable
    missing = _single_line_error(outcomes["missing_peer"][0][1])
    assert f"not all 2 processes joined coordinator 127.0.0.1:{lonely} within {timeout_s} s" in missing
    assert elapsed < timeout_s + 20, elapsed  # interpreter start-up + the timeout, not JAX's 300 s


# -- where the settings come from (pure) -----------------------------------------------------------


def test_settings_come_from_flags_jax_env_torchrun_and_schedulers():
    from jaxdist.parallel.distributed import resolve

    jax_env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    group = resolve(jax_env)
    assert (group.num_processes, group.process_id, group.coordinator) == (4, 3, "10.0.0.1:1234")
    flags = resolve(jax_env, coordinator="10.0.0.2:99", num_processes=2, process_id=0)
    assert (flags.num_processes, flags.process_id, flags.coordinator, flags.source) == (
        2, 0, "10.0.0.2:99", "command-line flags")

    torchrun = resolve({"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "WORLD_SIZE": "16", "RANK": "9",
                        "LOCAL_RANK": "1"})
    assert (torchrun.num_processes, torchrun.process_id, torchrun.coordinator, torchrun.local_device_ids) == (
        16, 9, "node7:29500", (1,))
    slurm = resolve({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
                     "SLURM_STEP_NODELIST": "gpu[01-02]"})
    assert (slurm.num_processes, slurm.process_id, slurm.coordinator, slurm.source) == (8, 5, None, "SLURM")
    assert not resolve({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).is_multi_process
    mpi = resolve({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_RANK": "1"})
    assert (mpi.num_processes, mpi.process_id, mpi.source) == (2, 1, "Open MPI")
    single = resolve({})
    assert (single.num_processes, single.process_id, single.is_multi_process) == (1, 0, False)


@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES=2 needs a coordinator"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two' must be a positive integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "set JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     "JAX_COORDINATOR_ADDRESS='nohost' must be host:port"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=5 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "a"}, "MASTER_PORT is not"),
], ids=["no_coordinator", "bad_count", "no_id", "bad_address", "torchrun_rank", "torchrun_port"])
def test_inconsistent_settings_are_user_errors(env, message):
    from jaxdist.parallel.distributed import resolve

    with pytest.raises(UserError, match=re.escape(message)):
        resolve(env)


def test_launcher_gives_each_process_its_identity_and_devices():
    from jaxdist.commands.launch import process_env
    from jaxdist.parallel.distributed import init_timeout_s, resolve

    env = process_env({"PATH": "/bin"}, "127.0.0.1:5000", 2, 1, 4)
    assert env["JAX_LOCAL_DEVICE_IDS"] == "4,5,6,7" and env["JAXDIST_CPU_DEVICES"] == "4"
    group = resolve(env)
    assert (group.num_processes, group.process_id, group.coordinator) == (2, 1, "127.0.0.1:5000")
    assert init_timeout_s(None, {"JAXDIST_INIT_TIMEOUT": "7"}) == 7 and init_timeout_s(5, {}) == 5
    with pytest.raises(UserError, match="JAXDIST_INIT_TIMEOUT='0' must be a positive integer"):
        init_timeout_s(None, {"JAXDIST_INIT_TIMEOUT": "0"})


# -- scaling arithmetic ----------------------------------------------------------------------------


def test_scale_numbers_follow_from_the_parameter_count(capsys):
    from jaxdist import cli, config
    from jaxdist.observe import scaling

    cfg = config.load(REPO / "configs" / "gpt_406m.yaml")
    model = scaling.model_size(cfg)
    d, layers, vocab, seq = 1024, 24, 50304, 1024
    assert model.params == layers * (12 * d * d + 4 * d) + 2 * vocab * d + seq * d + 2 * d  # 406,259,712
    hw = scaling.Hardware()
    matmul = layers * 12 * d * d  # the blocks' matmul weights: read, copied and differentiated in bf16
    assert model.matmul_params == model.copied_params == matmul
    # As the compiled 406M data-parallel step all-reduces them (2 x H200,
    # benchmarks/reports/2026-11-26-fused-norms.md): 576.0 MiB of bf16 matmul gradients and 397.4 MiB of
    # float32 ones (embedding, head, norms, positions).
    grads = 2 * matmul + 4 * (model.params - matmul)
    assert model.gradient_bytes == grads
    assert 2 * matmul / 2**20 == pytest.approx(576.0) and grads / 2**20 == pytest.approx(576.0 + 397.4, rel=1e-3)
    ddp = scaling.layout_cost(model, hw, 8, {"data": 64, "stage": 1, "fsdp": 1, "tensor": 1}, 1024)
    assert ddp.traffic["data"].network == pytest.approx(2 * 7 / 8 * grads / 8)  # hierarchical: 1/8 per NIC
    assert ddp.traffic["data"].nvlink == pytest.approx(2 * 7 / 8 * grads)
    hsdp = scaling.layout_cost(model, hw, 8, {"data": 8, "stage": 1, "fsdp": 8, "tensor": 1}, 1024)
    assert hsdp.traffic["data"].network == pytest.approx(2 * 7 / 8 * grads / 8) and hsdp.traffic["data"].nvlink == 0
    # per_layer: the bf16 copies and the other float32 weights gathered twice, the gradients reduce-scattered.
    gathered = 2 * matmul + 4 * (model.params - matmul)
    assert hsdp.traffic["fsdp"].nvlink == pytest.approx(7 / 8 * (2 * gathered + grads))
    assert hsdp.traffic["fsdp"].network == 0
    assert hsdp.state_bytes == pytest.approx((16 * model.params + 2 * model.copied_params) / 8)
    assert scaling.checkpoint_cost(model, hw, 8, ddp).total_bytes == 12 * model.params

    # ZeRO-2 gathers once.
    zero2 = scaling.model_size(config.load(REPO / "configs" / "gpt_406m.yaml", ["train.fsdp_gather=per_step"]))
    fsdp8 = {"data": 1, "stage": 1, "fsdp": 8, "tensor": 1}
    assert scaling.layout_cost(zero2, hw, 1, fsdp8, 128).traffic["fsdp"].nvlink == pytest.approx(
        7 / 8 * (gathered + grads))
    assert "gradients cross devices as 1.02 GB" in scaling.report(cfg, hosts=1)

    big = config.load(REPO / "configs" / "gpt_1b4.yaml", ["model.d_model=4096", "model.layers=32", "model.heads=32"])
    costs = [scaling.layout_cost(scaling.model_size(big), hw, 128, shape, 4096)
             for shape in scaling.candidate_shapes(128, 8)]
    assert not costs[0].fits and "GB per GPU" in costs[0].problem  # 7B with Adam does not fit data-parallel
    assert scaling.choose(costs).shape["fsdp"] * scaling.choose(costs).shape["tensor"] == 8

    assert cli.main(["scale", str(REPO / "configs" / "gpt_406m.yaml"), "--hosts", "128"]) == 0
    out = capsys.readouterr().out
    assert "128 host(s) x 8 GPUs = 1024 GPUs" in out and "smallest global batch" in out
    assert re.search(r"data=1024 .*<- chosen", out)


# -- schedulers: torchrun-style and SLURM variables join real processes; the templates are consistent


def test_torchrun_and_slurm_variables_join_one_run():
    """Process 0 described torchrun-style, process 1 SLURM-style (JAX derives its coordinator)."""
    port = str(free_port())
    torchrun = {"MASTER_ADDR": "localhost", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "JAX_COORDINATOR_PORT": port}
    runs = [
        subprocess.Popen([sys.executable, "-m", "jaxdist.cli", "--init-timeout", "60", "doctor", "--megabytes", "0.01"],
                         env=jaxdist_env(JAXDIST_CPU_DEVICES="2", **extra), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
        for extra in (torchrun, slurm)
    ]
    (out0, err0), (out1, err1) = (run.communicate(timeout=LAUNCH_TIMEOUT_S) for run in runs)
    assert [run.returncode for run in runs] == [0, 0], (err0[-2000:], err1[-2000:])
    assert "doctor: 2 process(es), 4 devices, mesh data=2 x stage=1 x fsdp=2 x tensor=1" in out0
    assert "doctor: 9 of 9 collective checks passed" in out0  # data+fsdp, data, fsdp x 3 collectives
    assert "doctor" not in out1 and "process" not in out1  # only process 0 reports


def _run_sbatch(tmp_path: Path, script: str) -> dict[str, str]:
    """Runs a SLURM template with stub `scontrol`/`srun`; returns the variables srun would pass on."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text("#!/bin/sh\nprintf 'gpu07\\ngpu08\\n'\n")
    (stubs / "srun").write_text("#!/bin/sh\nenv | grep -E '^(JAX|JAXDIST)_'\necho \"ARGS=$*\"\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8"}
    result = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / script), "configs/gpt_406m.yaml",
                             "mesh.data=16"], env=env, capture_output=True, text=True, timeout=30, check=True)
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_slurm_templates_point_every_task_at_the_first_node(tmp_path):
    from jaxdist.parallel.distributed import resolve

    per_gpu = _run_sbatch(tmp_path, "train_per_gpu.sbatch")
    assert per_gpu["JAX_COORDINATOR_ADDRESS"] == f"gpu07:{61440 + 1234 % 4096}"
    assert per_gpu["ARGS"] == "--kill-on-bad-exit=1 --label jaxdist train configs/gpt_406m.yaml mesh.data=16"
    assert "JAX_LOCAL_DEVICE_IDS" not in per_gpu  # JAX gives each task the GPU of its SLURM_LOCALID
    task = {**per_gpu, "SLURM_JOB_ID": "1234", "SLURM_NTASKS": "16", "SLURM_PROCID": "13", "SLURM_LOCALID": "5"}
    group = resolve(task)
    assert (group.num_processes, group.process_id, group.coordinator, group.source) == (16, 13, "gpu07:62674", "SLURM")

    per_node = _run_sbatch(tmp_path, "train_per_node.sbatch")
    assert per_node["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"  # all of the node's GPUs, not GPU 0 alone
    assert per_node["JAX_COORDINATOR_ADDRESS"] == per_gpu["JAX_COORDINATOR_ADDRESS"]


def test_kubernetes_job_gives_each_pod_its_process_id():
    import yaml

    from jaxdist.parallel.distributed import resolve

    service, job = yaml.safe_load_all((REPO / "scripts" / "k8s" / "jaxdist-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    count = int(env["JAX_NUM_PROCESSES"]["value"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == count
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].split(":")
    # Pod 0's DNS name: <job>-0.<subdomain>, the subdomain being the headless Service.
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == int(port)
    assert container["ports"][0]["containerPort"] == int(port)
    for index in range(count):
        values = {name: item.get("value", str(index)) for name, item in env.items()}
        group = resolve(values)
        assert (group.num_processes, group.process_id, group.coordinator) == (count, index, f"{host}:{port}")


def test_scale_keeps_one_microbatch_of_activations_and_the_optimizers_own_state(capsys):
    from jaxdist import cli, config
    from jaxdist.observe import scaling

    recipe = REPO / "configs" / "gpt_1b4.yaml"
    hw = scaling.Hardware()
    data8 = {"data": 8, "stage": 1, "fsdp": 1, "tensor": 1}
    whole = scaling.model_size(config.load(recipe))
    accumulated = scaling.model_size(config.load(recipe, ["train.microbatches=8"]))
    one, eight = (scaling.layout_cost(model, hw, 1, data8, 512) for model in (whole, accumulated))
    assert eight.activation_bytes == pytest.approx(one.activation_bytes / 8) and eight.state_bytes == one.state_bytes
    assert not one.fits and eight.fits
    # Optimizer state per parameter (float32): AdamW and LAMB two moments, SGD with momentum and LARS
    # one, SGD without momentum and Adafactor (factored) none; fp32 gradients 4 B besides.
    for overrides, moments in ((["optim.name=lamb"], 2), (["optim.name=sgd"], 1), (["optim.name=lars"], 1),
                               (["optim.name=sgd", "optim.momentum=0"], 0), (["optim.name=adafactor"], 0)):
        model = scaling.model_size(config.load(recipe, overrides))
        cost = scaling.layout_cost(model, hw, 1, data8, 512)
        assert cost.state_bytes == pytest.approx(whole.params * (4 + 4 * moments + 4) + 2 * whole.copied_params)
        assert scaling.checkpoint_cost(model, hw, 1, cost).total_bytes == whole.params * 4 * (1 + moments)

    # 64 sequences per GPU fit no layout at once; accumulating 2 microbatches fits fsdp=8.
    assert cli.main(["scale", str(recipe), "--hosts", "1", "--batch-per-gpu", "64"]) == 0
    out = capsys.readouterr().out
    assert "no candidate layout fits" in out
    assert "or accumulate: train.microbatches=2 fits fsdp=8 (58.06 GB of activations per microbatch)" in out
    assert cli.main(["scale", str(recipe), "train.microbatches=8", "--hosts", "1", "--batch-per-gpu", "64"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^data=8 +25\.08 +14\.51 .*<- chosen$", out, re.M)
    assert "checkpoint: 17.00 GB (params + adamw state, float32)" in out
