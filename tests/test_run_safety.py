"""One writer per run directory, no rewritten history, and writers that fail (a full disk) or stop
answering (a lost mount) end in the loop's error path, with signals honoured."""

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest
import yaml
from conftest import TINY_GPT, disk_full_past, make_config

from jaxdist import cli, loop
from jaxdist.checkpoint import Checkpoints, run_dir_guard
from jaxdist.checkpoint.run_dir_guard import LOCK_FILE, RunDirLock
from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.observe.metrics import drop_after

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# All devices along fsdp: one in the processes these tests start (the quickest compile), eight here.
ONE_DEVICE = {"mesh": {"data": 1, "fsdp": -1, "tensor": 1}, "rules": {"preset": "fsdp"}}


def config_file(run_dir: Path, **sections) -> Path:
    raw = {key: dict(value) for key, value in TINY_GPT.items()} | ONE_DEVICE | {"run_dir": str(run_dir)}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "JAXDIST_CPU_DEVICES": "1",
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or "",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_line(err: str) -> str:
    """The one error line of a command's stderr (warnings may come before it)."""
    lines = [line for line in err.splitlines() if line.startswith("jaxdist: error:")]
    assert len(lines) == 1, err
    return lines[0]


def saved_steps(run_dir: Path) -> list[int]:
    with Checkpoints(run_dir / "checkpoints", create=False) as store:
        return store.steps()


# --- one live run per run_dir ---------------------------------------------------------------------


def test_a_locked_run_dir_refuses_a_second_run_with_one_line_and_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = config_file(run_dir, train={"steps": 2}, checkpoint={"every": 2})
    assert cli.main(["train", str(first)]) == 0
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    capsys.readouterr()
    with RunDirLock(run_dir):  # another run holds it
        second = config_file(run_dir, train={"steps": 4}, checkpoint={"every": 2})
        assert cli.main(["train", str(second), "seed=1"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"jaxdist: error: run_dir={run_dir} is in use by another run (pid {os.getpid()} on "
                           f"{socket.gethostname()}, started ") and line.endswith("; wait for it to end, or use "
                                                                                  "another run_dir"), line
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert saved_steps(run_dir) == [2]


def test_two_runs_started_together_one_trains_the_other_refuses(tmp_path):
    run_dir = tmp_path / "run"
    first = config_file(run_dir, train={"steps": 1000}, log={"every": 1}, checkpoint={"every": 1000})
    running = subprocess.Popen([sys.executable, "-m", "jaxdist.cli", "train", str(first)], env=env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists():  # it holds the lock and trains
        assert running.poll() is None and time.monotonic() < deadline, running.communicate()
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-m", "jaxdist.cli", "train", str(first), "seed=1"], env=env(),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and "is in use by another run" in one_line(second.stderr), second.stderr
    assert running.poll() is None  # the first trains on
    running.send_signal(signal.SIGTERM)
    out, err = running.communicate(timeout=300)
    assert running.returncode == 0, err
    saved = saved_steps(run_dir)[-1]
    assert [r["step"] for r in records(run_dir)] == list(range(1, saved + 1))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 0


def test_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # A process that took the lock and died with it held (kill -9): the kernel dropped its flock.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, json, sys, time
        file = open({str(run_dir / LOCK_FILE)!r}, "a+")
        fcntl.flock(file, fcntl.LOCK_EX)
        file.write(json.dumps({{"pid": 1, "host": "gone", "released": False}})); file.flush()
        print("locked", flush=True); time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UserError, match="in use by another run"), RunDirLock(run_dir):
        pass
    holder.kill()
    holder.wait()
    with RunDirLock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (run_dir / LOCK_FILE).exists()


def test_a_deleted_or_swapped_lock_file_never_lets_a_second_run_in(tmp_path):
    """People delete RUN/jaxdist.lock (or put another file there) while a run is live: the run holds
    the directory itself, so a second start is still refused. (A flock is held by an open file
    description: a second one in this process is refused as another process's would be; a killed
    holder: test_a_dead_runs_lock_is_taken_over.)"""
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):  # the live run
        (run_dir / LOCK_FILE).unlink()
        with pytest.raises(UserError, match=f"run_dir={run_dir} is in use by another run"), RunDirLock(run_dir):
            pass
        (run_dir / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere", "released": true}')
        with pytest.raises(UserError, match="is in use by another run"), RunDirLock(run_dir):
            pass
    with RunDirLock(run_dir):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (run_dir / LOCK_FILE).exists()  # a run leaves no lock file to clean up


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    run_dir, target = tmp_path / "run", tmp_path / "precious.txt"
    run_dir.mkdir()
    target.write_text("someone's notes\n")
    (run_dir / LOCK_FILE).symlink_to(target)
    with pytest.raises(UserError) as refused, RunDirLock(run_dir):
        pass
    assert str(refused.value) == (f"run_dir={run_dir}: {run_dir / LOCK_FILE} is a symbolic link, and jaxdist never "
                                  f"writes through one; remove it (a run makes its own lock file)")
    assert target.read_text() == "someone's notes\n" and (run_dir / LOCK_FILE).is_symlink()

@pytest.mark.parametrize("holder, refused", [
    ({"pid": 2**22 + 7, "host": socket.gethostname(), "released": False}, False),  # a dead process here
    ({"pid": os.getpid(), "host": socket.gethostname(), "released": False}, True),  # a live one here
    ({"pid": 12, "host": "another-host", "released": False}, True),  # another host: no way to tell
    ({"pid": 12, "host": "another-host", "released": True}, False),  # released
], ids=["dead_here", "alive_here", "other_host", "released"])
def test_without_file_locks_the_recorded_holder_decides(tmp_path, monkeypatch, holder, refused):
    def no_locks(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    if refused:
        with pytest.raises(UserError, match=f"in use by another run \\(pid {holder['pid']} on {holder['host']}"):
            with RunDirLock(tmp_path):
                pass
        assert json.loads((tmp_path / LOCK_FILE).read_text()) == holder
    else:
        with RunDirLock(tmp_path):
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.skipif(sys.platform != "linux", reason="launches CPU processes")
def test_two_launches_on_one_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    first = config_file(run_dir, train={"steps": 1000}, log={"every": 1}, checkpoint={"every": 1000},
                        mesh={"data": 2, "fsdp": 1, "tensor": 1})
    launch = [sys.executable, "-m", "jaxdist.cli", "launch", "-n", "2", "--log", str(tmp_path / "notes.log"), "--"]
    environment = {key: value for key, value in env().items() if key != "JAXDIST_CPU_DEVICES"}
    running = subprocess.Popen([*launch, "train", str(first)], env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").exists():
        assert running.poll() is None and time.monotonic() < deadline, running.communicate()
        time.sleep(0.05)
    second = subprocess.run([*launch, "train", str(first), "seed=1"], env=environment, capture_output=True,
                            text=True, timeout=180)
    assert second.returncode == 2 and "is in use by another run" in second.stdout + second.stderr, second.stdout
    assert running.poll() is None  # the first trains on
    running.send_signal(signal.SIGTERM)  # and saves where it is
    out, _ = running.communicate(timeout=300)
    assert running.returncode == 0, out
    saved = saved_steps(run_dir)[-1]
    assert [r["step"] for r in records(run_dir)] == list(range(1, saved + 1))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 0


# --- no rewritten history -------------------------------------------------------------------------


def test_a_fresh_start_over_an_earlier_runs_metrics_is_refused_unless_restarted(tmp_path, capsys):
    run_dir = tmp_path / "run"
    path = config_file(run_dir, train={"steps": 3})  # checkpoint.every=0: nothing to resume from
    assert cli.main(["train", str(path)]) == 0
    before = (run_dir / "metrics.jsonl").read_bytes(), (run_dir / "config.yaml").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", str(path), "seed=1"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (f"jaxdist: error: run_dir={run_dir} holds an earlier run's metrics.jsonl with 3 logged steps and "
                    f"TensorBoard events in tb/, and no checkpoint to resume from; a fresh start would overwrite them: "
                    f"pass --restart to move them to {run_dir}/replaced-<time>/ and start over, or use another run_dir")
    assert ((run_dir / "metrics.jsonl").read_bytes(), (run_dir / "config.yaml").read_bytes()) == before

    assert cli.main(["train", str(path), "seed=1", "--restart"]) == 0
    [replaced] = run_dir.glob("replaced-*")
    assert "--restart: moved the earlier run's files to " in capsys.readouterr().out
    assert ((replaced / "metrics.jsonl").read_bytes(), (replaced / "config.yaml").read_bytes()) == before
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 1


def test_a_rerun_after_every_checkpoint_was_unreadable_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    path = config_file(run_dir, train={"steps": 4}, checkpoint={"every": 2})
    assert cli.main(["train", str(path)]) == 0
    for step in (2, 4):  # every array data file of every checkpoint cut short
        for file in (run_dir / "checkpoints" / str(step) / "state" / "ocdbt.process_0" / "d").iterdir():
            file.write_bytes(file.read_bytes()[:100])
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", str(path)]) == 2  # the first run after the damage: nothing could be read
    assert "no checkpoint in" in one_line(capsys.readouterr().err)
    assert cli.main(["train", str(path)]) == 2  # a scheduler's requeue: refused, not a fresh start
    assert "holds an earlier run's metrics.jsonl with 4 logged steps and TensorBoard events in tb/ and set-aside " \
           "checkpoints (unreadable-2, unreadable-4)" in one_line(capsys.readouterr().err)
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_malformed_metrics_lines_are_set_aside_and_the_history_kept(tmp_path, capsys):
    """A line that is no logged step (cut short by a kill, edited: `{}`, `5`, bytes that are not UTF-8)
    never stops a resume and is never lost: it moves to a side file named in one warning."""
    logged = [json.dumps({"step": step, "loss": 1.0 / step}).encode() for step in (1, 2, 3, 4, 5)]
    malformed = [b"{}", b"5", b"\xff\xfe not UTF-8", b'{"step": "3"}', b'{"step": true}', b"[1, 2]"]
    lines = [*logged[:2], *malformed, *logged[2:], b'{"step": 6, "lo']  # the last cut short by a kill
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert run_dir_guard.history(tmp_path) == ["metrics.jsonl with 12 logged steps"]  # what a fresh start is told
    drop_after(tmp_path, 4)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"".join(line + b"\n" for line in logged[:4])
    [aside] = tmp_path.glob("metrics.jsonl.set-aside-*")
    assert aside.read_bytes() == b"".join(line + b"\n" for line in [*malformed, b'{"step": 6, "lo'])
    assert capsys.readouterr().err == (
        f"jaxdist: warning: {tmp_path / 'metrics.jsonl'}: moved 7 line(s) that are no logged step's JSON object (the "
        f"first: line 3) to {aside}; the other lines are kept\n")
    drop_after(tmp_path, 4)  # nothing more to move or drop: the file is left as it is
    assert len(list(tmp_path.glob("metrics.jsonl.set-aside-*"))) == 1 and not capsys.readouterr().err


# Runs metrics.drop_after(RUN_DIR, 50) in forked children, each killed with SIGKILL at another file
# call of the rewrite (just before it, or just after it returns), picked at random; after each
# kill the file must be the old one or the new one, and the next start's rewrite must finish it.
KILLED_REWRITES = textwrap.dedent("""
    import json, os, random, signal, sys
    from pathlib import Path
    from jaxdist.observe.metrics import drop_after

    FILE_CALLS = {"open", "read", "write", "flush", "fsync", "close", "replace", "rename", "truncate", "unlink",
                  "__exit__"}
    run_dir, points, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    path = run_dir / "metrics.jsonl"
    old = path.read_bytes()
    new = b"".join(line + b"\\n" for line in old.splitlines() if json.loads(line)["step"] <= 50)

    def rewrite_killed_at(point):
        pid = os.fork()
        if pid == 0:
            calls = 0
            def profile(frame, event, arg):
                nonlocal calls
                if event in ("c_call", "c_return") and getattr(arg, "__name__", None) in FILE_CALLS:
                    calls += event == "c_call"
                    if (calls, event) == point:
                        os.kill(os.getpid(), signal.SIGKILL)
            sys.setprofile(profile)
            drop_after(run_dir, 50)
            sys.setprofile(None)
            os._exit(min(calls, 255))
        _, status = os.waitpid(pid, 0)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)

    calls = rewrite_killed_at(None)  # a whole rewrite, to count its file calls
    path.write_bytes(old)
    every = [(call, event) for call in range(1, calls + 1) for event in ("c_call", "c_return")]
    chosen = random.Random(seed).sample(every, min(points, len(every)))
    chosen += random.Random(seed).choices(every, k=points - len(chosen))
    outcomes = []
    for point in chosen:
        code = rewrite_killed_at(point)
        found = path.read_bytes()
        drop_after(run_dir, 50)  # the next start
        outcomes.append({"point": point, "code": code, "file": "old" if found == old else "new" if found == new
                         else f"cut: {len(found)} bytes", "then": "new" if path.read_bytes() == new else "broken"})
        path.write_bytes(old)
    print(json.dumps({"calls": calls, "outcomes": outcomes}))
""")


def test_a_kill_at_any_point_of_a_resumes_metrics_rewrite_leaves_the_history_whole(tmp_path):
    lines = [json.dumps({"step": step, "loss": 1.0 / step, "tokens_per_sec": 1e5 + step}) for step in range(1, 101)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    seed = int.from_bytes(os.urandom(4), "little")
    run = subprocess.run([sys.executable, "-c", KILLED_REWRITES, str(tmp_path), "20", str(seed)], env=env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    outcomes = report["outcomes"]
    assert len(outcomes) == 20 and report["calls"] >= 3
    assert sum(outcome["code"] == -signal.SIGKILL for outcome in outcomes) == 20, outcomes
    assert all(outcome["file"] in ("old", "new") and outcome["then"] == "new" for outcome in outcomes), (seed, outcomes)


def tensorboard_scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """`tag`'s values by step as TensorBoard shows them: events a later run purged are gone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return {}  # no event of it written yet (the writer thread may be on its first)
    steps = [event.step for event in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), f"{tag}: a step shown twice: {steps}"
    return {event.step: event.value for event in events.Scalars(tag)}


def test_a_resumed_run_purges_the_steps_it_trains_again_from_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    path = config_file(run_dir, train={"steps": 8}, checkpoint={"every": 3})
    assert cli.main(["train", str(path)]) == 0
    reference = {r["step"]: r["loss"] for r in records(run_dir)}
    # A run killed after step 7 whose last checkpoint was step 6: its steps 7-8 are in tb/ already.
    for step in (8,):
        (run_dir / "checkpoints" / str(step)).rename(tmp_path / f"kept-{step}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:7]) + "\n")
    assert cli.main(["train", str(path)]) == 0
    shown = tensorboard_scalars(run_dir / "tb", "train/loss")
    assert list(shown) == list(range(1, 9))
    assert shown == pytest.approx(reference, rel=1e-6)
    assert [r["step"] for r in records(run_dir)] == list(range(1, 9))
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2


def test_each_logged_step_reaches_tensorboard_before_the_next(tmp_path, monkeypatch):
    """Events are flushed at every logged step: a kill loses at most the step being written."""
    seen = []
    write = loop.MetricsWriter.write

    def write_then_look(self, step, values):
        write(self, step, values)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if step in tensorboard_scalars(tmp_path / "run" / "tb", "train/loss"):
                seen.append(step)
                return
            time.sleep(0.05)

    monkeypatch.setattr(loop.MetricsWriter, "write", write_then_look)
    loop.train(make_config(tmp_path / "run", **ONE_DEVICE, train={"steps": 3}), devices=jax.devices()[:1])
    assert seen == [1, 2, 3]


# --- writers that fail or stop answering ----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root to mount): a disk that really fills up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_a_full_disk_under_tensorboard_stops_the_run_with_one_line(tmp_path, small_disk, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tb").symlink_to(small_disk, target_is_directory=True)
    fill(small_disk)
    path = config_file(run_dir, train={"steps": 6}, checkpoint={"every": 2})
    started = time.monotonic()
    assert cli.main(["train", str(path)]) == 2
    assert time.monotonic() - started < 120
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"jaxdist: error: could not write {run_dir / 'tb'}") and "No space left on device" in line, line


def test_a_disk_that_fills_while_config_yaml_is_written_leaves_the_old_one(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = "# the resolved config of an earlier start\nseed: 0\n"
    (run_dir / "config.yaml").write_text(old)
    path = config_file(run_dir, train={"steps": 1})
    to_yaml, full = Config.to_yaml, contextlib.ExitStack()

    def filling_the_disk(cfg):  # the disk fills as config.yaml is written: 1 KiB of it fits
        text = to_yaml(cfg)
        full.enter_context(disk_full_past(1024))
        return text

    monkeypatch.setattr(Config, "to_yaml", filling_the_disk)
    with full:
        code = cli.main(["train", str(path)])
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert line == (f"jaxdist: error: could not write {run_dir / 'config.yaml'} (File too large); the file there is "
                    f"left as it was; free space there or fix the folder, then run again")
    assert (run_dir / "config.yaml").read_text() == old
    assert not list(run_dir.glob(".config.yaml*"))  # nothing half-written beside it


STUCK = textwrap.dedent("""
    import sys, threading
    from jaxdist import cli
    from jaxdist.checkpoint import store
    from jaxdist.observe import metrics
    def never_returns(*args, **kwargs):
        threading.Event().wait()
    if sys.argv[1] == "metrics":
        metrics._Files.write = never_returns  # a file system that stopped answering
        metrics.CLOSE_WAIT_S = 2.0
    else:
        store.Checkpoints._write = never_returns
    sys.exit(cli.main(["train", *sys.argv[2:]]))
""")


def stuck_run(which: str, path: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STUCK, which, str(path), *overrides], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(run: subprocess.Popen, prefix: str, seconds: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = run.stdout.readline()
        assert line, f"the run ended (rc {run.poll()}) before {prefix!r}: {lines} {run.stderr.read()}"
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no {prefix!r} within {seconds} s: {lines}")


def test_sigterm_while_the_metrics_writer_is_stuck_saves_and_exits(tmp_path):
    run_dir = tmp_path / "run"
    path = config_file(run_dir, train={"steps": 1000}, checkpoint={"every": 1000})
    run = stuck_run("metrics", path)
    wait_for_line(run, "step ")  # the steps run; their metrics are never written
    run.send_signal(signal.SIGTERM)
    started = time.monotonic()
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert time.monotonic() - started < 60
    assert "stopped by SIGTERM after step" in out
    assert "the metrics of the last logged steps could not be written" in err
    step = saved_steps(run_dir)[-1]
    assert out.count(f"checkpoint saved in {run_dir / 'checkpoints' / str(step)}") == 1


def test_a_stuck_checkpoint_write_stops_the_run_within_the_write_timeout(tmp_path):
    path = config_file(tmp_path / "run", train={"steps": 40}, checkpoint={"every": 2, "write_timeout": 3})
    run = stuck_run("checkpoints", path)
    out, err = run.communicate(timeout=180)
    assert run.returncode == 2, err
    assert one_line(err).startswith(f"jaxdist: error: checkpoint {tmp_path / 'run' / 'checkpoints' / '2'} was not "
                                    f"written within checkpoint.write_timeout=3 s (is the file system of ")


def test_a_second_ctrl_c_while_a_checkpoint_write_is_stuck_ends_the_run_at_once(tmp_path):
    path = config_file(tmp_path / "run", train={"steps": 1000}, checkpoint={"every": 1000})
    run = stuck_run("checkpoints", path)
    wait_for_line(run, "step ")  # the steps run: a signal now asks for a save
    run.send_signal(signal.SIGINT)  # saves, then waits for the write that never ends
    time.sleep(3)
    assert run.poll() is None
    run.send_signal(signal.SIGINT)
    started = time.monotonic()
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert time.monotonic() - started < 20
    assert err.strip().endswith("jaxdist: interrupted")
