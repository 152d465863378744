"""The launcher's stop policy, on plain Python children: a stuck group, a peer gone, a forwarded
signal, processes the children leave behind, a conflicting JAXDIST_CPU_DEVICES, and children that
die with the launcher."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxdist import cli
from jaxdist.commands import launch

# Children that, like a JAX process with its preemption notifier, survive SIGTERM: only SIGKILL ends them.
IGNORE_SIGTERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
HANG = IGNORE_SIGTERM + "time.sleep(600)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def start_group(commands: list[list[str]], err: io.StringIO | None = None,
                **options) -> tuple[launch._Group, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO() if err is None else err
    group = launch._Group(out, err, **options)
    for process_id, command in enumerate(commands):
        group.start(process_id, command, dict(os.environ))
    return group, out, err


def assert_all_gone(group: launch._Group) -> None:
    for child in group.children:
        assert child.returncode is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)  # nothing is left in the child's process group either


def test_a_silent_group_is_stopped_after_its_timeout():
    """Any line from any process is progress: process 1 stays silent throughout (as a training
    run's process 1 does), process 0 prints three lines a second apart and then hangs."""
    timeout_s = 2.0
    talks_then_hangs = IGNORE_SIGTERM + "[(print(i, flush=True), time.sleep(1)) for i in range(3)]; time.sleep(600)"
    started = time.monotonic()
    group, out, err = start_group([python(talks_then_hangs), python(HANG)], timeout_s=timeout_s)
    code = group.wait()
    elapsed = time.monotonic() - started

    assert code == launch.STUCK_EXIT == 124
    assert out.getvalue().splitlines() == ["[0] 0", "[0] 1", "[0] 2"]
    assert err.getvalue().splitlines() == [
        "jaxdist launch: no process printed a line for 2 s (--timeout 2): the run is stuck; stopping processes 0, 1"
    ]
    last_line_at = 2.0  # process 0's third line, after its start-up
    assert last_line_at + timeout_s < elapsed < last_line_at + timeout_s + launch.FAILURE_GRACE_S + 3, elapsed
    assert_all_gone(group)


def test_processes_left_running_after_a_peer_exited_0_are_stopped():
    started = time.monotonic()
    group, _, err = start_group([python("pass"), python(HANG)], peer_exit_grace_s=1.0)
    code = group.wait()
    elapsed = time.monotonic() - started

    assert code == launch.STUCK_EXIT
    assert err.getvalue().splitlines() == [
        "jaxdist launch: process 0 exited with code 0 and the others still run 1 s later (waiting for a peer "
        "that is gone); stopping process 1"
    ]
    assert elapsed < 1.0 + launch.FAILURE_GRACE_S + 3, elapsed
    assert_all_gone(group)


@pytest.mark.parametrize("codes, expected", [((0, 0), 0), ((0, 3), 128 + signal.SIGTERM)], ids=["clean", "failed"])
def test_a_signal_is_forwarded_and_clean_exits_give_0(codes, expected):
    """SIGTERM to the launcher reaches every child; the launcher exits 0 only if all of them do."""
    commands = [
        python(f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit({code})); "
               f"print('ready', flush=True); time.sleep(600)")
        for code in codes
    ]
    group, out, err = start_group(commands)

    def signal_once_ready() -> None:
        while out.getvalue().count("ready") < len(codes):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # caught by _signals_stop's handler, as in the launcher

    with launch._signals_stop(group):
        # Started once the handler is in place: a SIGTERM before it would kill this test process.
        threading.Thread(target=signal_once_ready, daemon=True).start()
        code = group.wait()

    assert code == expected
    assert [child.returncode for child in group.children] == list(codes)
    lines = err.getvalue().splitlines()
    assert lines[0] == "jaxdist launch: received SIGTERM; sending SIGTERM to every process (120 s to save and stop)"
    assert ("jaxdist launch: every process exited 0 after SIGTERM" in lines) == (expected == 0)


def running(pid: int) -> bool:
    """Whether `pid` runs. os.kill(pid, 0) would not do: it finds a zombie too, and an orphan's
    zombie stays until init reaps it, which some inits (a container's first process) never do."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_what_a_child_leaves_running_in_its_group_is_stopped(tmp_path):
    """A child exits while a process it started (as a data loader starts workers) still holds its
    output pipes: the launcher stops that process too, and returns at once."""
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    group, _, err = start_group([["sh", "-c", f"sleep 20 & echo $! > {pid_file}; exit 1"]])
    code = group.wait()
    elapsed = time.monotonic() - started

    assert code == 1
    assert err.getvalue().splitlines() == ["jaxdist launch: process 0 exited with code 1"]
    assert elapsed < launch.FAILURE_GRACE_S + 3, elapsed
    assert not running(int(pid_file.read_text()))


def test_output_held_outside_the_children_s_groups_is_not_waited_for(tmp_path):
    """A process that left its parent's process group cannot be stopped with it; the launcher stops
    relaying its output instead of waiting for it to end."""
    pid_file = tmp_path / "pid"
    leaves = python(f"import subprocess; leaver = subprocess.Popen(['sleep', '20'], start_new_session=True); "
                    f"open({str(pid_file)!r}, 'w').write(str(leaver.pid))")
    started = time.monotonic()
    group, _, err = start_group([python("pass"), leaves])
    try:
        code = group.wait()
        elapsed = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    assert code == 0
    assert err.getvalue().splitlines() == [
        "jaxdist launch: the output of process 1 is still held open by a process outside its process group; "
        "not waiting for it"
    ]
    assert elapsed < launch.RELAY_DRAIN_S + 3, elapsed


class SlowStream(io.StringIO):
    """A terminal that takes its time over each line (0.2 ms)."""

    def write(self, text: str) -> int:
        time.sleep(0.0002)
        return super().write(text)


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "beside_a_running_peer"])
def test_a_failed_process_s_last_lines_come_before_the_line_saying_how_it_ended(others):
    """A traceback is the last thing a failing process writes: the launcher passes all of it on
    before it says the process exited, whether or not others still run. The 3,000 lines fit in the
    pipe, so the process exits at once, and passing them on takes 0.6 s."""
    last_words = python("import sys\nfor i in range(3000): print(f'traceback line {i}', file=sys.stderr)\nsys.exit(1)")
    group, _, err = start_group([last_words] + [python("import time; time.sleep(60)")] * others, err=SlowStream())
    assert group.wait() == 1
    lines = err.getvalue().splitlines()
    ended = next(i for i, line in enumerate(lines) if line.startswith("jaxdist launch: process 0 exited with code 1"))
    assert lines[ended - 1] == "[0] traceback line 2999", lines[ended - 3:ended + 1]
    assert len([line for line in lines if line.startswith("[0] traceback line")]) == 3000
    assert_all_gone(group)


def test_a_conflicting_cpu_device_count_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("JAXDIST_CPU_DEVICES", "8")
    assert cli.main(["launch", "-n", "2", "--devices-per-process", "4", "--", "train", "any.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: JAXDIST_CPU_DEVICES=8 is set"), err
    assert "--devices-per-process=4" in err
    launch._check_cpu_devices("4", 4)  # the same count is no conflict


# A stand-in for the launcher: starts `CHILD` with its own pid as JAXDIST_LAUNCHER_PID, then waits.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    env = {**os.environ, "JAXDIST_LAUNCHER_PID": sys.argv[1] or str(os.getpid())}
    subprocess.run([sys.executable, "-c", sys.argv[2]], env=env)
""")
# It sleeps for less than a minute so that a failing run of the test leaves nothing behind for long.
CHILD = ("from jaxdist.commands.launch import die_with_launcher; die_with_launcher(); import time; "
         "print('ready', flush=True); time.sleep(50)")


def test_children_die_with_the_launcher():
    """A child whose launcher is killed outright gets SIGKILL; one whose launcher is already gone
    (another pid than its parent's) exits at once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    killed, orphan = (
        subprocess.Popen(python(LAUNCHER) + [pid, CHILD], env=env, stdout=subprocess.PIPE, text=True)
        for pid in ("", "1")
    )
    assert killed.stdout.readline() == "ready\n"
    killed.kill()
    # The pipe closes once the child is gone too; a surviving child would keep it open.
    assert killed.communicate(timeout=30)[0] == ""
    assert orphan.communicate(timeout=60)[0] == ""  # it never printed 'ready'


@pytest.mark.parametrize("code, restartable, failure", [
    (1, True, "exited with code 1"),
    (-signal.SIGKILL, True, "exited with signal SIGKILL"),
    (2, False, "stopped on a user error (exit 2)"),
    (3, False, "stopped at a non-finite step (exit 3)"),
], ids=["crash", "killed", "user_error", "non_finite"])
def test_a_failed_group_may_restart_but_not_after_a_user_error_or_a_non_finite_stop(code, restartable, failure):
    """A crash or kill is worth a restart (`launch --max-restarts`); a user error (exit 2) would fail
    the same way, and so would a non-finite stop (exit 3): the resumed run repeats the same steps."""
    fail = f"import os, signal; os.kill(os.getpid(), {-code})" if code < 0 else f"import sys; sys.exit({code})"
    group, _, err = start_group([python(HANG), python(fail)])
    assert group.wait() == launch._exit_code(code)
    assert group.restartable == restartable
    assert err.getvalue().startswith(f"jaxdist launch: process 1 {failure}; stopping process 0")


@pytest.mark.parametrize("code, lines", [
    (1, ["process 0 exited with code 1; restarting the group (1 of 2)",
         "process 0 exited with code 1; restarting the group (2 of 2)",
         "process 0 exited with code 1; not restarting"]),
    (3, ["process 0 stopped at a non-finite step (exit 3); not restarting"]),
], ids=["crash", "non_finite"])
def test_launch_restarts_a_crashed_group_but_not_a_non_finite_stop(monkeypatch, code, lines):
    monkeypatch.delenv("JAXDIST_CPU_DEVICES", raising=False)
    monkeypatch.setattr(launch, "child_command", lambda program: python(f"import sys; sys.exit({code})"))
    err = io.StringIO()
    assert launch.launch(1, 1, ["--", "train", "any.yaml"], stdout=io.StringIO(), stderr=err, max_restarts=2) == code
    said = [line.removeprefix("jaxdist launch: ") for line in err.getvalue().splitlines()]
    assert [line for line in said if not line.startswith("started 1 process(es)")] == lines



@pytest.mark.parametrize("code, max_restarts, then", [
    (1, 0, [""]),
    (1, 1, ["; restarting the group (1 of 1)", "; not restarting"]),
    (2, 1, ["; not restarting"]),
], ids=["no_restarts", "one_restart", "user_error"])
def test_each_failure_is_said_once_with_what_happens_next(monkeypatch, code, max_restarts, then):
    """Process 1 fails while process 0 still runs: one line per failure says what stops and what the
    launcher does next, rather than the failure again in a line of its own."""
    monkeypatch.delenv("JAXDIST_CPU_DEVICES", raising=False)
    fails_second = f"import os, sys, time; sys.exit({code}) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(60)"
    monkeypatch.setattr(launch, "child_command", lambda program: python(fails_second))
    err = io.StringIO()
    code_seen = launch.launch(2, 1, ["train", "any.yaml"], stdout=io.StringIO(), stderr=err, max_restarts=max_restarts)
    assert code_seen == code
    said = [line.removeprefix("jaxdist launch: ") for line in err.getvalue().splitlines()]
    failure = f"process 1 {launch._describe_exit(code)}; stopping process 0"
    assert [line for line in said if not line.startswith("started 2 process(es)")] == [failure + t for t in then]


def test_an_elastic_group_restarts_without_the_failed_process_down_to_its_minimum(monkeypatch):
    """launch -n 4 --min-processes 2: the last process fails in every attempt; each restart leaves it
    out, and a group that would fall below 2 processes is not started again."""
    monkeypatch.delenv("JAXDIST_CPU_DEVICES", raising=False)
    last_fails = ("import os, sys, time; last = int(os.environ['JAX_NUM_PROCESSES']) - 1; "
                  "sys.exit(1) if os.environ['JAX_PROCESS_ID'] == str(last) else time.sleep(60)")
    monkeypatch.setattr(launch, "child_command", lambda program: python(last_fails))
    err = io.StringIO()
    code = launch.launch(4, 1, ["train", "any.yaml"], stdout=io.StringIO(), stderr=err, max_restarts=5, min_processes=2)
    said = [line.removeprefix("jaxdist launch: ") for line in err.getvalue().splitlines()]
    assert code == 1
    assert [line.split(",")[0] for line in said if line.startswith("started")] == [
        "started 4 process(es)", "started 3 process(es)", "started 2 process(es)"]
    assert [line for line in said if not line.startswith("started")] == [
        "process 3 exited with code 1; stopping processes 0, 1, 2; restarting the group without it (1 of 5): 3 "
        "processes (--min-processes 2), the same config and train.global_batch on fewer devices",
        "process 2 exited with code 1; stopping processes 0, 1; restarting the group without it (2 of 5): 2 "
        "processes (--min-processes 2), the same config and train.global_batch on fewer devices",
        "process 1 exited with code 1; stopping process 0; not restarting: 1 process(es) would remain, fewer than "
        "--min-processes 2",
    ]


@pytest.mark.parametrize("options, message", [
    ({"min_processes": 5, "max_restarts": 1}, "launch --min-processes 5: must be from 1 to -n 4"),
    ({"min_processes": 2}, "launch --min-processes 2 shrinks the group at a restart: give --max-restarts too"),
])
def test_a_minimum_the_group_cannot_have_is_refused(options, message):
    with pytest.raises(launch.UserError, match=re.escape(message)):
        launch.launch(4, 1, ["train", "any.yaml"], **options)


def test_a_closed_stdout_stops_the_group_like_a_sigpipe():
    """`jaxdist launch ... | head`: the launcher's reader leaves. The launcher stops the processes as
    it would on a SIGPIPE (they save and exit 0 here), drops the rest of their output, and neither
    the relay thread nor the final flush raises."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    saves_on_sigterm = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
                        "[(print('step', flush=True), time.sleep(0.1)) for _ in range(600)]")
    err = io.StringIO()
    with open(write_end, "w") as out:
        group = launch._Group(out, err)
        group.start(0, python(saves_on_sigterm), dict(os.environ))
        code = group.wait()
        out.write("the launcher's last words\n")
    assert code == 0
    assert err.getvalue().splitlines() == [
        "jaxdist launch: received SIGPIPE; sending SIGTERM to every process (120 s to save and stop)",
        "jaxdist launch: every process exited 0 after SIGPIPE",
    ]
    assert_all_gone(group)


# What libraries print in a multi-process run: gloo's connections (two threads' lines interleaved
# into one, and the end of one on a line of its own), JAX's and Orbax's notes on a SIGTERM.
LIBRARY_LINES = [
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
    "1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
    "W1128 08:30:23.474814   24496 preemption_notifier.cc:90] SIGTERM caught at 2026-11-28T08:30:23.474812467+00:00",
    "WARNING:absl:[process=0][thread=MainThread] Reached preemption sync point, step=4",
]


def test_library_notes_go_to_the_log_file_and_the_run_s_own_lines_stay(monkeypatch, tmp_path):
    """One line, once (across restarts), names the file the notes go to; jaxdist's lines, and other
    libraries' lines (a warning a user may act on), are relayed as before."""
    monkeypatch.delenv("JAXDIST_CPU_DEVICES", raising=False)
    prints = (f"import sys; lines = {LIBRARY_LINES!r}; "
              "print('step 1 loss 5.6', flush=True); [print(line, file=sys.stderr, flush=True) for line in lines]; "
              "print('WARNING:absl:a warning of another kind', file=sys.stderr, flush=True); sys.exit(1)")
    monkeypatch.setattr(launch, "child_command", lambda program: python(prints))
    out, err, log = io.StringIO(), io.StringIO(), tmp_path / "notes.log"
    assert launch.launch(1, 1, ["train", "any.yaml"], stdout=out, stderr=err, max_restarts=1, notes=log) == 1

    assert out.getvalue().splitlines() == ["[0] step 1 loss 5.6"] * 2
    said = [line for line in err.getvalue().splitlines() if not line.startswith("jaxdist launch: started")]
    assert said == [
        f"jaxdist launch: libraries' notes (gloo connections, preemption notices) go to {log}; --verbose shows "
        f"them here",
        "[0] WARNING:absl:a warning of another kind",
        "jaxdist launch: process 0 exited with code 1; restarting the group (1 of 1)",
        "[0] WARNING:absl:a warning of another kind",
        "jaxdist launch: process 0 exited with code 1; not restarting",
    ]
    assert log.read_text().splitlines() == [f"[0] {line}" for line in LIBRARY_LINES] * 2


def test_verbose_relays_the_library_notes(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXDIST_CPU_DEVICES", raising=False)
    prints = f"import sys; [print(line, file=sys.stderr, flush=True) for line in {LIBRARY_LINES!r}]"
    monkeypatch.setattr(launch, "child_command", lambda program: python(prints))
    err, log = io.StringIO(), tmp_path / "notes.log"
    assert launch.launch(1, 1, ["train", "any.yaml"], stdout=io.StringIO(), stderr=err, notes=log, verbose=True) == 0
    assert [line for line in err.getvalue().splitlines() if line.startswith("[0] ")] == [
        f"[0] {line}" for line in LIBRARY_LINES]
    assert not log.exists()
