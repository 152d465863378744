"""`jaxdist launch -n N [--devices-per-process K] -- train CONFIG ...`: N processes on this host.

Each process runs `jaxdist <command>` with `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` set, so it joins the others through `jax.distributed` like processes on separate
hosts would. Process i gets K devices: GPUs i*K .. i*K+K-1 (`JAX_LOCAL_DEVICE_IDS`) where GPUs
exist, else K simulated CPU devices (`JAXDIST_CPU_DEVICES`). Every output line is prefixed with
`[i] `. If a process fails, the others are stopped (each child leads its own process group, so
its own children go too) and the launcher exits with the failed process's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import BinaryIO, TextIO

from jaxdist.errors import UserError

# Seconds between SIGTERM and SIGKILL. After a process died the others cannot go on (a JAX
# multi-controller run needs every process), so they get little time; when the launcher itself is
# told to stop (Ctrl-C, a scheduler's preemption) they get time to save a checkpoint.
FAILURE_GRACE_S = 3.0
SIGNAL_GRACE_S = 120.0
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
        "PYTHONUNBUFFERED": "1",
    }


def child_command(program: Sequence[str]) -> list[str]:
    """`jaxdist <program>` run by this Python interpreter."""
    return [sys.executable, "-m", "jaxdist.cli", *program]


def launch(num_processes: int, devices_per_process: int, program: Sequence[str],
           stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Runs `jaxdist <program>` as `num_processes` processes; returns the exit code for the launcher."""
    program = list(program[1:] if program and program[0] == "--" else program)
    if num_processes < 1:
        raise UserError(f"launch -n {num_processes}: the process count must be at least 1")
    if devices_per_process < 1:
        raise UserError(f"launch --devices-per-process {devices_per_process}: must be at least 1")
    if not program:
        raise UserError("launch: no command given; e.g. jaxdist launch -n 2 -- train configs/tiny.yaml")
    coordinator = f"127.0.0.1:{free_port()}"
    group = _Group(stdout or sys.stdout, stderr or sys.stderr)
    with _signals_stop(group):
        for process_id in range(num_processes):
            env = process_env(dict(os.environ), coordinator, num_processes, process_id, devices_per_process)
            group.start(process_id, child_command(program), env)
        pids = ", ".join(str(child.pid) for child in group.children)
        group.say(f"started {num_processes} process(es), coordinator {coordinator}, pids {pids}")
        return group.wait()


class _Group:
    """The child processes, their output relays, and the stop-everything policy."""

    def __init__(self, stdout: TextIO, stderr: TextIO):
        self.stdout, self.stderr = stdout, stderr
        self.children: list[subprocess.Popen] = []
        self.relays: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.stop_signal: int | None = None

    def start(self, process_id: int, command: list[str], env: dict[str, str]) -> None:
        child = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        self.children.append(child)
        for pipe, out in ((child.stdout, self.stdout), (child.stderr, self.stderr)):
            relay = threading.Thread(target=self._relay, args=(pipe, out, f"[{process_id}] "), daemon=True)
            relay.start()
            self.relays.append(relay)

    def _relay(self, pipe: BinaryIO, out: TextIO, prefix: str) -> None:
        for line in iter(pipe.readline, b""):
            with self.lock:
                out.write(prefix + line.decode("utf-8", errors="replace").rstrip("\n") + "\n")
                out.flush()
        pipe.close()

    def wait(self) -> int:
        """Waits for all children; on the first failure (or a signal) stops the rest. The exit code."""
        failure: int | None = None
        grace = FAILURE_GRACE_S
        while True:
            codes = [child.poll() for child in self.children]  # poll each one: it updates returncode
            if all(code is not None for code in codes):
                break
            if self.stop_signal is not None:
                self.say(f"received signal {self.stop_signal}; stopping all processes")
                failure = 128 + self.stop_signal
                grace = SIGNAL_GRACE_S
                break
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                process_id, code = failed[0]
                running = codes.count(None)
                self.say(f"process {process_id} exited with {_describe_exit(code)}; "
                         f"stopping the other {running} process(es)")
                failure = _exit_code(code)
                break
            time.sleep(_POLL_S)
        self._stop_all(grace)
        for relay in self.relays:
            relay.join()
        if failure is not None:
            return failure
        codes = [child.returncode for child in self.children]
        return next((_exit_code(code) for code in codes if code != 0), 0)

    def _stop_all(self, grace_s: float) -> None:
        """SIGTERM to every child's process group, then SIGKILL to what is left after `grace_s`."""
        for child in self.children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
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


def _die_with_parent() -> None:
    """In the child before exec: if the launcher is killed outright, the kernel kills the child."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"
