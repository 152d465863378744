"""`jaxdist launch -n N [--devices-per-process K] [--timeout S] [--max-restarts R] [--min-processes M] -- train CONFIG ...`: N processes on this host.

Each process runs `jaxdist <command>` with `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` set, so it joins the others through `jax.distributed` like processes on separate
hosts would. Process i gets K devices: GPUs i*K .. i*K+K-1 (`JAX_LOCAL_DEVICE_IDS`) where GPUs
exist, else K simulated CPU devices (`JAXDIST_CPU_DEVICES`, set for each process from K; a
different value in the launcher's own environment is refused rather than silently replaced).
Every output line is prefixed with `[i] `. Notes that libraries print in every multi-process run
(gloo's connections, JAX's and Orbax's notes on a SIGTERM: `LIBRARY_NOTES`) go to a log file
instead, named on stderr at the first one (`--log FILE`; default `jaxdist-launch-<pid>.log` in the
temporary folder); `--verbose` relays them like any line.

The launcher never waits forever; it stops every process (each child leads its own process
group, so the child's own children go too) when:

- a process fails: the exit code is that process's, unless `--max-restarts N` allows starting
  the whole group again (at most N times; not after a user error, exit code 2, nor a stop at a
  non-finite step, exit code 3, which the resumed run would repeat, nor after a forwarded
  signal): a `train` run resumes from its newest complete checkpoint. With `--min-processes M`
  the group is elastic: each restart leaves the failed process out (a lost host), down to M
  processes; the run resumes on the smaller mesh with the same config (the same
  `train.global_batch`: each device takes a larger share), so its mesh axes must follow the device
  count (`-1`) and its global batch must divide over every count it may shrink to;
- no process printed a line for `--timeout` seconds: exit code 124. Progress is any output line,
  from any process: only process 0 reports steps, and since every step is collective, one stuck
  process silences all of them. So the timeout must exceed the longest quiet stretch: start-up,
  compiling, `log.every` steps, a checkpoint save or an eval;
- a process exited 0 and others still run `PEER_EXIT_GRACE_S` later (they wait in a collective
  for a peer that is gone): exit code 124.

Once every process has exited, what they started and left running in their process groups (a
data loader's workers) is stopped too. Output still held open by a process outside those groups
is relayed for at most `RELAY_DRAIN_S` more seconds.

SIGINT or SIGTERM to the launcher is forwarded to every process as SIGTERM (a training run saves a
checkpoint and stops); the launcher exits 0 if every process then exits 0, else 128 + the signal.
The launcher's stdout or stderr closing (its reader gone: `jaxdist launch ... | head`) counts as a
SIGPIPE, forwarded the same way; the rest of the output is dropped.
Each process dies with the launcher, even if the launcher is killed outright (`die_with_launcher`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO, TextIO

from jaxdist.commands import arguments
from jaxdist.errors import UserError, discard_output

HELP = "run a command as N processes on this host"
OFFLINE = True

# Seconds between SIGTERM and SIGKILL. After a process died the others cannot go on (a JAX
# multi-controller run needs every process), so they get little time; when the launcher itself is
# told to stop (Ctrl-C, a scheduler's preemption) they get time to save a checkpoint.
FAILURE_GRACE_S = 3.0
SIGNAL_GRACE_S = 120.0
# Processes of one run finish together (the end of a run is collective); a process still running
# this long after another exited 0 is waiting for a peer that will never come.
PEER_EXIT_GRACE_S = 60.0
# Seconds to wait, after every process has exited, for the last of their output: a process that
# left its process group (setsid) is out of the launcher's reach and may hold a pipe for good.
RELAY_DRAIN_S = 2.0
# The launcher's exit code when it stopped a run that made no progress (the code `timeout` uses).
STUCK_EXIT = 124
# A process's exit code for a mistake in the user's input (jaxdist.errors.UserError): never restarted.
USER_ERROR_EXIT = 2
# A process's exit code for a stop at a non-finite step (jaxdist.errors.NonFiniteError): never
# restarted, since the run resumes bit-exactly and so reaches the same non-finite step again.
NON_FINITE_EXIT = 3
# Where a child finds the launcher's pid (see die_with_launcher).
LAUNCHER_PID = "JAXDIST_LAUNCHER_PID"
_POLL_S = 0.1
# Lines libraries print in every multi-process run that tell a user nothing to act on, or what a
# jaxdist line says too: gloo's connections (several per process, written piece by piece from
# several threads, so a line may hold parts of two, or the end of one), JAX's preemption notifier
# and Orbax's preemption sync point on a SIGTERM (the run's own line says where it stopped and saved).
LIBRARY_NOTES = re.compile(r"\[Gloo\] Rank|peer ranks\b|preemption_notifier\.cc:\d+\]|Reached preemption sync point, step=")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--num", type=arguments.COUNT, required=True, help="number of processes")
    parser.add_argument("--devices-per-process", type=arguments.COUNT, default=1,
                        help="GPUs (or simulated CPU devices) per process (default 1)")
    parser.add_argument("--timeout", type=arguments.AMOUNT, metavar="SECONDS",
                        help="stop every process (exit 124) when none printed a line, on stdout or stderr, for "
                             "this long (default: off); any line counts as progress and only process 0 logs "
                             "steps, so allow for start-up, compiling and log.every steps")
    parser.add_argument("--max-restarts", type=arguments.INDEX, default=0,
                        help="start the whole group again after a process failed (not a user error), up to this "
                             "many times; train resumes from the newest complete checkpoint (default 0)")
    parser.add_argument("--min-processes", type=arguments.COUNT, metavar="M",
                        help="elastic: each restart leaves the failed process out, down to M processes; the run "
                             "resumes on the smaller mesh with the same train.global_batch (default: restart all)")
    parser.add_argument("--log", metavar="FILE",
                        help="where libraries' notes (gloo connections, preemption notices) go instead of the "
                             "terminal (default: jaxdist-launch-<pid>.log in the temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="relay libraries' notes too, like any line")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- train CONFIG [overrides]")


def run(args: argparse.Namespace) -> int:
    return launch(args.num, args.devices_per_process, args.program, args.timeout, max_restarts=args.max_restarts,
                  notes=args.log, verbose=args.verbose, min_processes=args.min_processes)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(base: dict[str, str], coordinator: str, num_processes: int, process_id: int,
                devices_per_process: int) -> dict[str, str]:
    """The environment of process `process_id`: who it is, where the coordinator is, which devices."""
    first = process_id * devices_per_process
    return {
        **base,
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "JAX_LOCAL_DEVICE_IDS": ",".join(str(first + i) for i in range(devices_per_process)),
        "JAXDIST_CPU_DEVICES": str(devices_per_process),
        LAUNCHER_PID: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    }


def child_command(program: Sequence[str]) -> list[str]:
    """`jaxdist <program>` run by this Python interpreter."""
    return [sys.executable, "-m", "jaxdist.cli", *program]


def launch(num_processes: int, devices_per_process: int, program: Sequence[str], timeout_s: float | None = None,
           stdout: TextIO | None = None, stderr: TextIO | None = None, max_restarts: int = 0,
           notes: str | os.PathLike | None = None, verbose: bool = False, min_processes: int | None = None) -> int:
    """Runs `jaxdist <program>` as `num_processes` processes; returns the exit code for the launcher.

    `timeout_s`: stop everything when no process printed a line for this long (None: no limit).
    `max_restarts`: start the whole group again, up to this many times, after a process failed
    (see `_Group.restartable`); a `train` run then resumes from its newest complete checkpoint.
    `notes`: the file libraries' notes (`LIBRARY_NOTES`) go to (None: `default_notes_path()`);
    `verbose`: relay them like any line instead. `min_processes`: restart elastically, each time
    without the process that failed, while at least this many remain (None: always all of them).
    """
    program = list(program[1:] if program and program[0] == "--" else program)
    if num_processes < 1:
        raise UserError(f"launch -n {num_processes}: the process count must be at least 1")
    if devices_per_process < 1:
        raise UserError(f"launch --devices-per-process {devices_per_process}: must be at least 1")
    if timeout_s is not None and timeout_s <= 0:
        raise UserError(f"launch --timeout {timeout_s:g}: must be more than 0 seconds")
    if max_restarts < 0:
        raise UserError(f"launch --max-restarts {max_restarts}: must be 0 or more")
    if min_processes is not None and not 1 <= min_processes <= num_processes:
        raise UserError(f"launch --min-processes {min_processes}: must be from 1 to -n {num_processes}")
    if min_processes is not None and not max_restarts:
        raise UserError(f"launch --min-processes {min_processes} shrinks the group at a restart: give --max-restarts "
                        f"too")
    if not program:
        raise UserError("launch: no command given; e.g. jaxdist launch -n 2 -- train configs/tiny.yaml")
    _check_cpu_devices(os.environ.get("JAXDIST_CPU_DEVICES"), devices_per_process)
    stderr = stderr or sys.stderr
    restarts = 0
    with contextlib.closing(_Notes(notes or default_notes_path(), stderr)) as library_notes:
        while True:
            group = _Group(stdout or sys.stdout, stderr, timeout_s, restarts=restarts, max_restarts=max_restarts,
                           notes=None if verbose else library_notes, processes=num_processes,
                           min_processes=min_processes)
            code = _run_group(group, num_processes, devices_per_process, program)
            if not group.restarting:
                return code
            restarts += 1
            num_processes = group.next_processes


def default_notes_path() -> str:
    """Where `launch` writes libraries' notes unless told: `jaxdist-launch-<pid>.log` in the temporary folder."""
    return os.path.join(tempfile.gettempdir(), f"jaxdist-launch-{os.getpid()}.log")


class _Notes:
    """The file libraries' notes go to: opened, and named in one line on `stderr`, at the first note."""

    def __init__(self, path: str | os.PathLike, stderr: TextIO):
        self.path, self.stderr = path, stderr
        self._file: TextIO | None = None

    def write(self, line: str) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
            print(f"jaxdist launch: libraries' notes (gloo connections, preemption notices) go to {self.path}; "
                  f"--verbose shows them here", file=self.stderr, flush=True)
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _run_group(group: _Group, num_processes: int, devices_per_process: int, program: list[str]) -> int:
    """Starts the processes of one attempt (a fresh coordinator port each time) and waits for them."""
    coordinator = f"127.0.0.1:{free_port()}"
    with _signals_stop(group):
        for process_id in range(num_processes):
            env = process_env(dict(os.environ), coordinator, num_processes, process_id, devices_per_process)
            group.start(process_id, child_command(program), env)
        pids = ", ".join(str(child.pid) for child in group.children)
        group.say(f"started {num_processes} process(es), coordinator {coordinator}, pids {pids}")
        return group.wait()


def _check_cpu_devices(requested: str | None, devices_per_process: int) -> None:
    """The launcher sets each process's JAXDIST_CPU_DEVICES itself; a different value set by the
    user would be ambiguous (per process or in all?), so it is refused instead of overridden."""
    if requested and requested != str(devices_per_process):
        raise UserError(
            f"JAXDIST_CPU_DEVICES={requested} is set, but launch gives each process --devices-per-process="
            f"{devices_per_process} device(s); pass --devices-per-process (devices per process) and unset "
            f"JAXDIST_CPU_DEVICES"
        )


def die_with_launcher() -> None:
    """In a process started by `jaxdist launch`: die with the launcher, even if it is killed outright.

    The launcher passes its pid in JAXDIST_LAUNCHER_PID. On Linux this asks the kernel to SIGKILL
    this process when its parent dies; if the parent is already gone (it died before the request),
    this process exits at once. The variable is removed, so programs started from here ignore it.
    A no-op without the variable. Call it first thing: it runs after exec, where a `preexec_fn`
    would run between fork and exec, which is unsafe while the launcher's threads run.
    """
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher is None:
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):
        raise SystemExit(1)  # the launcher is gone, and with it whoever read our output


class _Group:
    """The child processes, their output relays, and the stop-everything policy.

    `timeout_s`: the longest time without an output line from any child (None: no limit);
    `peer_exit_grace_s`: how long the others may run after a child exited 0;
    `restarts`: how many times the launcher started the group again before this attempt, of at most
    `max_restarts` (see `restarting`); `notes`: where lines matching `LIBRARY_NOTES` go (None:
    relayed like the others).
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, timeout_s: float | None = None,
                 peer_exit_grace_s: float = PEER_EXIT_GRACE_S, restarts: int = 0, max_restarts: int = 0,
                 notes: _Notes | None = None, processes: int = 1, min_processes: int | None = None):
        self.stdout, self.stderr = stdout, stderr
        self.notes = notes
        self.timeout_s = timeout_s
        self.peer_exit_grace_s = peer_exit_grace_s
        self.restarts, self.max_restarts = restarts, max_restarts
        self.processes, self.min_processes = processes, min_processes
        self.children: list[subprocess.Popen] = []
        self.relays: list[tuple[int, threading.Thread]] = []  # (process id, relay), two per process
        self.lock = threading.Lock()
        self.stop_signal: int | None = None
        self.last_output = time.monotonic()
        self.clean_exit: tuple[int, float] | None = None  # the first process seen to exit 0, and when
        self.failure: str | None = None  # which process failed first, and how
        self.failed_with: int | None = None  # that process's return code

    def start(self, process_id: int, command: list[str], env: dict[str, str]) -> None:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
        self.children.append(child)
        for pipe, out in ((child.stdout, self.stdout), (child.stderr, self.stderr)):
            relay = threading.Thread(target=self._relay, args=(pipe, out, f"[{process_id}] "), daemon=True)
            relay.start()
            self.relays.append((process_id, relay))

    def _relay(self, pipe: BinaryIO, out: TextIO, prefix: str) -> None:
        for line in iter(pipe.readline, b""):
            text = prefix + line.decode("utf-8", errors="replace").rstrip("\n") + "\n"
            with self.lock:
                if self.notes is not None and LIBRARY_NOTES.search(text):
                    self.notes.write(text)
                else:
                    self._write(out, text)
                self.last_output = time.monotonic()
        pipe.close()

    def _write(self, out: TextIO, text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except BrokenPipeError:  # the launcher's reader is gone (`jaxdist launch ... | head`)
            # The run stops as on a SIGPIPE: the processes save and stop, their output is still
            # read (a process blocked on a full pipe would never stop) and dropped.
            discard_output(out)
            self.stop_signal = self.stop_signal or signal.SIGPIPE

    def wait(self) -> int:
        """Relays output until every child exited or the run must stop (see the module docstring);
        returns the launcher's exit code."""
        code = self._watch()
        self._drain(range(len(self.children)))
        held = sorted({process_id for process_id, relay in self.relays if relay.is_alive()})
        if held:
            self.say(f"the output of {_processes(held)} is still held open by a process outside its process "
                     f"group; not waiting for it")
        return code

    def _watch(self) -> int:
        while True:
            codes = [child.poll() for child in self.children]  # poll each one: it updates returncode
            self._note_failure(codes)
            if None not in codes:
                if self.failure is not None:
                    self._drain(range(len(codes)))
                    self.say(self.failure + self._what_next())
                self._stop_all(FAILURE_GRACE_S)  # what the processes started may still run
                return next((_exit_code(code) for code in codes if code != 0), 0)
            if self.stop_signal is not None:
                return self._forward_signal()
            if self.clean_exit is None and 0 in codes:
                self.clean_exit = (codes.index(0), time.monotonic())
            problem = self._problem(codes)
            if problem is not None:
                message, exit_code = problem
                running = [i for i, code in enumerate(codes) if code is None]
                self._drain([i for i, code in enumerate(codes) if code is not None])
                self.say(f"{message}; stopping {_processes(running)}{self._what_next()}")
                self._stop_all(FAILURE_GRACE_S)
                return exit_code
            time.sleep(_POLL_S)

    def _drain(self, process_ids: Iterable[int]) -> None:
        """Waits, `RELAY_DRAIN_S` at most in all, for the relays of `process_ids` to pass on what those
        processes wrote: their last lines (a traceback) come before the launcher's about how they ended."""
        process_ids = set(process_ids)
        deadline = time.monotonic() + RELAY_DRAIN_S
        for process_id, relay in self.relays:
            if process_id in process_ids:
                relay.join(timeout=max(0.0, deadline - time.monotonic()))

    def _note_failure(self, codes: list[int | None]) -> None:
        if self.failure is None and self.stop_signal is None:
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                process_id, self.failed_with = failed[0]
                self.failure = f"process {process_id} {_describe_exit(self.failed_with)}"

    @property
    def restartable(self) -> bool:
        """Whether starting the group again may help: a process failed or was killed, but not with a
        user error (exit 2) nor at a non-finite step (exit 3), which would recur, nor while the
        launcher forwarded a stop signal."""
        return (self.failure is not None and self.failed_with not in (USER_ERROR_EXIT, NON_FINITE_EXIT)
                and self.stop_signal is None)

    @property
    def next_processes(self) -> int:
        """How many processes a restart starts: all of them, or in an elastic group all but the failed one."""
        return self.processes if self.min_processes is None else self.processes - 1

    @property
    def restarting(self) -> bool:
        """Whether the launcher starts the group again: it is restartable, restarts are left and, in an
        elastic group, enough processes remain."""
        enough = self.min_processes is None or self.next_processes >= self.min_processes
        return self.restartable and self.restarts < self.max_restarts and enough

    def _what_next(self) -> str:
        """The end of the failure's line: whether the launcher restarts the group, said once with the
        failure; nothing when restarts were not asked for (--max-restarts 0) or nothing failed."""
        if self.failure is None or self.max_restarts == 0:
            return ""
        if self.restarting and self.min_processes is not None:
            return (f"; restarting the group without it ({self.restarts + 1} of {self.max_restarts}): "
                    f"{self.next_processes} processes (--min-processes {self.min_processes}), the same config and "
                    f"train.global_batch on fewer devices")
        if self.restarting:
            return f"; restarting the group ({self.restarts + 1} of {self.max_restarts})"
        if self.restartable and self.restarts < self.max_restarts:
            return (f"; not restarting: {self.next_processes} process(es) would remain, fewer than --min-processes "
                    f"{self.min_processes}")
        return "; not restarting"

    def _problem(self, codes: list[int | None]) -> tuple[str, int] | None:
        """Why the running children must be stopped, and the exit code; None while all is well."""
        if self.failure is not None:
            return self.failure, _exit_code(self.failed_with)
        now = time.monotonic()
        if self.timeout_s is not None and now - self.last_output > self.timeout_s:
            return (f"no process printed a line for {self.timeout_s:g} s (--timeout {self.timeout_s:g}): "
                    f"the run is stuck", STUCK_EXIT)
        if self.clean_exit is not None and now - self.clean_exit[1] > self.peer_exit_grace_s:
            return (f"process {self.clean_exit[0]} exited with code 0 and the others still run "
                    f"{self.peer_exit_grace_s:g} s later (waiting for a peer that is gone)", STUCK_EXIT)
        return None

    def _forward_signal(self) -> int:
        """SIGTERM to every child (a run saves and stops); 0 if all then exit 0, else 128 + the signal."""
        name = signal.Signals(self.stop_signal).name
        self.say(f"received {name}; sending SIGTERM to every process ({SIGNAL_GRACE_S:g} s to save and stop)")
        self._stop_all(SIGNAL_GRACE_S)
        codes = [child.returncode for child in self.children]
        if all(code == 0 for code in codes):
            self.say(f"every process exited 0 after {name}")
            return 0
        return 128 + self.stop_signal

    def _stop_all(self, grace_s: float) -> None:
        """SIGTERM to every child's process group, then SIGKILL to what is left after `grace_s`, or
        `FAILURE_GRACE_S` after the last child exited if that comes first."""
        for child in self.children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # A child's own children (data loader workers) may outlive it, holding its output pipes.
        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        while time.monotonic() < deadline and any(_group_running(child.pid) for child in self.children):
            time.sleep(_POLL_S)
        for child in self.children:
            _signal_group(child, signal.SIGKILL)
            child.wait()

    def say(self, message: str) -> None:
        with self.lock:
            print(f"jaxdist launch: {message}", file=self.stderr, flush=True)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)  # the child leads its group: this reaches its own children too
    except ProcessLookupError:
        pass


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: an orphan's zombie stays
    until init reaps it, which some inits (a container's first process) never do."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not os.path.isdir("/proc"):
        return True  # no way to tell zombies apart: wait for the grace to run out
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(os.path.join(entry.path, "stat"), "rb") as stat:
                    state, _, group = stat.read().rpartition(b")")[2].split()[:3]
            except OSError:
                continue  # it ended meanwhile
            if int(group) == pgid and state != b"Z":
                return True
    return False


@contextlib.contextmanager
def _signals_stop(group: _Group) -> Iterator[None]:
    """While children run, SIGINT/SIGTERM to the launcher stop them all instead of orphaning them."""

    def handle(signum, frame) -> None:
        group.stop_signal = signum

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _processes(ids: Iterable[int]) -> str:
    """'process 1' or 'processes 0, 2'."""
    ids = [str(i) for i in ids]
    return f"process {ids[0]}" if len(ids) == 1 else f"processes {', '.join(ids)}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    """How a process ended, after 'process 1 ': 'exited with code 1', 'stopped on a user error (exit 2)'."""
    if returncode < 0:
        return f"exited with signal {signal.Signals(-returncode).name}"
    if returncode == USER_ERROR_EXIT:
        return f"stopped on a user error (exit {returncode})"
    if returncode == NON_FINITE_EXIT:
        return f"stopped at a non-finite step (exit {returncode})"
    return f"exited with code {returncode}"
