"""Joining JAX's multi-controller runtime: one call, first thing, in every entry point.

Every process runs the same program; `initialize()` finds out which process this is and joins the
others through `jax.distributed` (JAX's coordinator service), before any JAX computation. Where the
coordinator address, the process count and this process's id come from, first match wins:

1. explicit arguments (the CLI's `--coordinator`, `--num-processes`, `--process-id`);
2. `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (what `jaxdist launch` and the
   Kubernetes template set);
3. torchrun-style `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`;
4. SLURM (`srun`) or Open MPI (`mpirun`): JAX detects these itself;
5. none of these: a single process, and nothing is initialized.

Local devices: `JAX_LOCAL_DEVICE_IDS` (read by JAX) restricts the GPUs a process uses; with
torchrun-style env a process gets GPU `LOCAL_RANK`, and under SLURM or Open MPI JAX gives each
process the GPU of its local rank, unless `JAX_LOCAL_DEVICE_IDS` says otherwise.

A missing peer or an unreachable coordinator is an error within the initialization timeout
(`--init-timeout` or `JAXDIST_INIT_TIMEOUT`, seconds): one line on stderr and exit code 2, never a
silent hang. JAX itself aborts the process with a stack trace when its own deadline passes, so a
watchdog reports the problem first and JAX's deadline is set a little later.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import zlib
from collections.abc import Mapping

import jax
import numpy as np
from jax._src import xla_bridge

from jaxdist.errors import UserError

DEFAULT_INIT_TIMEOUT_S = 300
# JAX's own deadline comes this much after ours, so that the clear message wins the race.
_JAX_DEADLINE_MARGIN_S = 30
_USER_ERROR_EXIT = 2


@dataclasses.dataclass(frozen=True)
class Setting:
    """A value and the name of the flag or variable it came from (for error messages)."""

    value: str
    origin: str


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Who this process is among the processes of one run."""

    num_processes: int
    process_id: int
    coordinator: str | None  # host:port of process 0's coordinator; None: JAX derives it (SLURM, MPI)
    local_device_ids: tuple[int, ...] | None  # None: JAX_LOCAL_DEVICE_IDS or JAX's default
    source: str  # where the settings came from, e.g. "JAX_* variables", "torchrun variables", "SLURM"

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1


def resolve(
    env: Mapping[str, str],
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessGroup:
    """The process group described by explicit arguments or the environment; pure, checks only."""
    explicit = {
        "coordinator": _explicit(coordinator, "--coordinator", env, "JAX_COORDINATOR_ADDRESS"),
        "count": _explicit(num_processes, "--num-processes", env, "JAX_NUM_PROCESSES"),
        "id": _explicit(process_id, "--process-id", env, "JAX_PROCESS_ID"),
    }
    if explicit["count"] is not None or explicit["id"] is not None:
        from_flags = any(s is not None and s.origin.startswith("--") for s in explicit.values())
        source = "command-line flags" if from_flags else "JAX_* variables"
        return _from_settings(explicit["coordinator"], explicit["count"], explicit["id"], None, source)
    if "WORLD_SIZE" in env:
        return _from_torchrun(env, explicit["coordinator"])
    if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return _from_cluster(env, explicit["coordinator"], "SLURM_NTASKS", "SLURM_PROCID", "SLURM")
    if all(key in env for key in ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        return _from_cluster(env, explicit["coordinator"], "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI")
    return ProcessGroup(1, 0, None, None, "single process (no coordinator set)")


def _explicit(value, flag: str, env: Mapping[str, str], variable: str) -> Setting | None:
    if value is not None:
        return Setting(str(value), flag)
    if env.get(variable):
        return Setting(env[variable], variable)
    return None


def _from_settings(
    coordinator: Setting | None,
    count: Setting | None,
    pid: Setting | None,
    local_device_ids: tuple[int, ...] | None,
    source: str,
    coordinator_optional: bool = False,
) -> ProcessGroup:
    if count is None:
        raise UserError(f"{pid.origin}={pid.value} is set but the process count is not: set JAX_NUM_PROCESSES "
                        f"(or --num-processes) to the number of processes")
    num = _positive_int(count)
    if pid is None:
        if num == 1:
            return ProcessGroup(1, 0, None, None, source)
        raise UserError(f"{count.origin}={num} is set but this process's id is not: set JAX_PROCESS_ID "
                        f"(or --process-id) to a distinct number in 0..{num - 1} for each process")
    index = _non_negative_int(pid)
    if index >= num:
        raise UserError(f"{pid.origin}={index} is not below {count.origin}={num}: process ids run "
                        f"0..{num - 1}; give each process a distinct id in that range")
    if num == 1:
        return ProcessGroup(1, 0, None, None, source)
    if coordinator is None and not coordinator_optional:
        raise UserError(f"{count.origin}={num} needs a coordinator: set JAX_COORDINATOR_ADDRESS=host:port "
                        f"(process 0's address and a free port) or pass --coordinator")
    address = _check_address(coordinator) if coordinator is not None else None
    return ProcessGroup(num, index, address, local_device_ids, source)


def _from_torchrun(env: Mapping[str, str], coordinator: Setting | None) -> ProcessGroup:
    if coordinator is None and env.get("MASTER_ADDR"):
        if not env.get("MASTER_PORT"):
            raise UserError(f"MASTER_ADDR={env['MASTER_ADDR']} is set but MASTER_PORT is not: set MASTER_PORT "
                            f"to a free port on that host")
        coordinator = Setting(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", "MASTER_ADDR:MASTER_PORT")
    rank = Setting(env["RANK"], "RANK") if "RANK" in env else None
    local_rank = env.get("LOCAL_RANK")
    local_ids = None
    if local_rank is not None and not env.get("JAX_LOCAL_DEVICE_IDS"):
        local_ids = (_non_negative_int(Setting(local_rank, "LOCAL_RANK")),)  # one process per GPU
    return _from_settings(coordinator, Setting(env["WORLD_SIZE"], "WORLD_SIZE"), rank, local_ids, "torchrun variables")


def _from_cluster(env: Mapping[str, str], coordinator: Setting | None, count: str, pid: str, name: str) -> ProcessGroup:
    return _from_settings(
        coordinator, Setting(env[count], count), Setting(env[pid], pid), None, name, coordinator_optional=True
    )


def _positive_int(setting: Setting, meaning: str = "the number of processes") -> int:
    if not setting.value.isdigit() or int(setting.value) < 1:
        raise UserError(f"{setting.origin}={setting.value!r} must be a positive integer ({meaning})")
    return int(setting.value)


def _non_negative_int(setting: Setting) -> int:
    if not setting.value.isdigit():
        raise UserError(f"{setting.origin}={setting.value!r} must be a non-negative integer")
    return int(setting.value)


def _check_address(setting: Setting) -> str:
    host, sep, port = setting.value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{setting.origin}={setting.value!r} must be host:port, e.g. 10.0.0.1:1234 "
                        f"(process 0's address and a free port)")
    return setting.value


def init_timeout_s(value: int | None, env: Mapping[str, str]) -> int:
    """Seconds to wait for every process to join: the argument, else JAXDIST_INIT_TIMEOUT, else 300."""
    if value is not None:
        setting = Setting(str(value), "--init-timeout")
    elif env.get("JAXDIST_INIT_TIMEOUT"):
        setting = Setting(env["JAXDIST_INIT_TIMEOUT"], "JAXDIST_INIT_TIMEOUT")
    else:
        return DEFAULT_INIT_TIMEOUT_S
    return _positive_int(setting, "seconds")


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    init_timeout: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessGroup:
    """Joins the other processes of this run (a no-op for a single process); call before any JAX work.

    Raises `UserError` for inconsistent settings. If the processes have not all joined within the
    timeout, prints one line naming the coordinator and the likely cause and exits with code 2.
    """
    env = os.environ if env is None else env
    group = resolve(env, coordinator, num_processes, process_id)
    timeout = init_timeout_s(init_timeout, env)
    if not group.is_multi_process or jax.distributed.is_initialized():
        return group
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jaxdist.distributed.initialize() must run before any JAX computation")
    watchdog = threading.Timer(timeout, _report_timeout, args=(group, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            local_device_ids=list(group.local_device_ids) if group.local_device_ids else None,
            initialization_timeout=timeout + _JAX_DEADLINE_MARGIN_S,
        )
    finally:
        watchdog.cancel()
    return group


def _report_timeout(group: ProcessGroup, timeout: int) -> None:
    print(f"jaxdist: error: {timeout_message(group, timeout)}", file=sys.stderr, flush=True)
    os._exit(_USER_ERROR_EXIT)  # the main thread is blocked inside JAX's connect; nothing to unwind


def timeout_message(group: ProcessGroup, timeout: int) -> str:
    """Why the processes did not all join: no coordinator listening, or peers missing."""
    where = group.coordinator or f"the address JAX derived from {group.source}"
    who = f"process {group.process_id} of {group.num_processes} ({group.source})"
    if group.process_id != 0 and group.coordinator and not _reachable(group.coordinator):
        return (f"{who}: nothing answered at coordinator {where} within {timeout} s; start process 0 "
                f"with the same address, check the host and port, or raise --init-timeout")
    return (f"{who}: not all {group.num_processes} processes joined coordinator {where} within {timeout} s; "
            f"start every process with the same coordinator and process count, or raise --init-timeout")


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def cpu_set_key() -> int:
    """A number that processes share where they run on one host on the same CPU cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return zlib.crc32(f"{socket.gethostname()} {cores}".encode())


def processes_sharing_cores() -> int:
    """How many of this run's processes, this one included, run on this host on the same CPU cores
    as this one: 1 for a single process, or where a launcher pinned each process to cores of its
    own (SLURM's CPU binding); all of a host's processes where they share its cores (`jaxdist
    launch`, torchrun). Collective: every process must call it."""
    if jax.process_count() == 1:
        return 1
    from jax.experimental import multihost_utils

    mine = cpu_set_key()
    keys = np.asarray(multihost_utils.process_allgather(np.array([mine], np.int64)))
    return int((keys.ravel() == mine).sum())
