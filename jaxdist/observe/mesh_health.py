"""Is every process, device and link of a mesh working, and how fast: what `jaxdist doctor` checks.

Run like training (`jaxdist launch -n 2 -- doctor`, `srun jaxdist doctor`, ...), it lists each
process's host and devices, then runs an all-reduce (psum), an all-gather and a ppermute (ring
shift) across the whole mesh and along each mesh axis, and compares every device's result with the
value computed independently in numpy. Last, it times an all-reduce and a ppermute per axis and
reports bandwidth in the nccl-tests convention (all-reduce bus bandwidth = bytes / time x 2(n-1)/n).
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import runtime
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib

COLLECTIVES = ("all-reduce", "all-gather", "ppermute")
CHECK_WIDTH = 8  # values per device in the correctness checks
TIMED_RUNS = 5  # calls timed; the median is reported
TIMED_REPEATS = 10  # collectives per timed call
# Buffers of the timed size a device holds while it times a collective: the input, the result, and
# the one the next collective in a row writes.
TIMED_BUFFERS = 3
_HOSTNAME_BYTES = 64


def axis_groups(mesh: Mesh) -> list[tuple[str, ...]]:
    """The axis groups to test: all axes of size > 1 together (if several), then each such axis."""
    sized = tuple(axis for axis in mesh.axis_names if mesh.shape[axis] > 1)
    return ([sized] if len(sized) > 1 else []) + [(axis,) for axis in sized]


def check_input(mesh: Mesh) -> np.ndarray:
    """Distinct small integers per device (exact in float32): shape mesh shape + (CHECK_WIDTH,)."""
    count = mesh.devices.size * CHECK_WIDTH
    return np.arange(count, dtype=np.float32).reshape(*mesh.devices.shape, CHECK_WIDTH)


def expected_result(collective: str, x: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """What `collective` over the mesh dims `dims` must give, computed in numpy."""
    if collective == "all-reduce":
        return x.sum(axis=dims, keepdims=True)
    if collective == "all-gather":
        return x
    if collective == "ppermute":  # device i of the group receives from device i - 1 (row-major order)
        moved = np.moveaxis(x, dims, tuple(range(len(dims))))
        flat = moved.reshape(-1, *moved.shape[len(dims):])
        rolled = np.roll(flat, 1, axis=0).reshape(moved.shape)
        return np.moveaxis(rolled, tuple(range(len(dims))), dims)
    raise ValueError(f"unknown collective {collective!r}")


def _collective_body(collective: str, mesh: Mesh, axes: tuple[str, ...]) -> Callable[[jax.Array], jax.Array]:
    """The per-device function of `collective` over `axes`, on blocks of shape (1, ..., 1, k)."""
    names = tuple(mesh.axis_names)
    group_size = rules_lib.axes_size(mesh, axes)

    def all_reduce(block):
        return jax.lax.psum(block, axes)

    def all_gather(block):
        gathered = jax.lax.all_gather(block.reshape(-1), axes)  # (group size, k), row-major over axes
        return gathered.reshape(*(mesh.shape[axis] if axis in axes else 1 for axis in names), -1)

    def ppermute(block):
        return jax.lax.ppermute(block, axes, [(i, (i + 1) % group_size) for i in range(group_size)])

    return {"all-reduce": all_reduce, "all-gather": all_gather, "ppermute": ppermute}[collective]


def collective_program(collective: str, mesh: Mesh, axes: tuple[str, ...]) -> Callable[[jax.Array], jax.Array]:
    """A jitted shard_map running `collective` over `axes` on arrays of shape mesh shape + (k,)."""
    names = tuple(mesh.axis_names)
    full = PartitionSpec(*names, None)
    reduced = PartitionSpec(*(None if axis in axes else axis for axis in names), None)
    out_spec = full if collective == "ppermute" else reduced
    # all_gather's result is equal along `axes`, but the type check cannot tell; each device's own
    # result is still what lands in its shard, so the check below still sees every device.
    check_vma = collective != "all-gather"
    body = _collective_body(collective, mesh, axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=full, out_specs=out_spec, check_vma=check_vma))


def repeated_program(collective: str, mesh: Mesh, axes: tuple[str, ...], repeats: int):
    """`collective` applied `repeats` times in a row inside one compiled call (for timing without
    the per-call dispatch cost). Only timed, never checked, so the value type is not tracked."""
    body = _collective_body(collective, mesh, axes)
    full = PartitionSpec(*mesh.axis_names, None)

    def repeated(block):
        return jax.lax.fori_loop(0, repeats, lambda _, b: body(b), block)

    return jax.jit(jax.shard_map(repeated, mesh=mesh, in_specs=full, out_specs=full, check_vma=False))


def mismatched_shards(result: jax.Array, expected: np.ndarray) -> int:
    """How many of this process's shards differ from the expected global value."""
    return sum(
        not np.array_equal(np.asarray(shard.data), expected[shard.index]) for shard in result.addressable_shards
    )


def crosses_processes(mesh: Mesh, axes: tuple[str, ...]) -> bool:
    """Whether some group of devices along `axes` spans more than one process (a network hop)."""
    dims = tuple(mesh.axis_names.index(axis) for axis in axes)
    owners = np.vectorize(lambda device: device.process_index, otypes=[int])(mesh.devices)
    group_size = int(np.prod([owners.shape[d] for d in dims]))
    groups = np.moveaxis(owners, dims, tuple(range(-len(dims), 0))).reshape(-1, group_size)
    return bool((groups != groups[:, :1]).any())


@dataclasses.dataclass(frozen=True)
class CheckResult:
    collective: str
    axes: tuple[str, ...]
    mismatches: int  # over all processes

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    axes: tuple[str, ...]
    size: int
    all_reduce_s: float
    all_reduce_busbw: float  # bytes/s
    ppermute_s: float
    ppermute_bw: float  # bytes/s


def run_checks(mesh: Mesh) -> list[CheckResult]:
    """Every collective on every axis group, checked on every device; mismatches summed over processes."""
    x = check_input(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(*mesh.axis_names, None))
    inputs = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    cases = [(collective, axes) for axes in axis_groups(mesh) for collective in COLLECTIVES]
    local = []
    for collective, axes in cases:
        dims = tuple(mesh.axis_names.index(axis) for axis in axes)
        result = collective_program(collective, mesh, axes)(inputs)
        local.append(mismatched_shards(result, expected_result(collective, x, dims)))
    totals = _sum_over_processes(np.asarray(local, np.int32))
    return [CheckResult(c, axes, int(n)) for (c, axes), n in zip(cases, totals)]


def check_buffer_fits(mesh: Mesh, megabytes: float) -> None:
    """Raises `UserError` where the devices cannot hold the timed buffers of `megabytes` each (on a
    CPU they share this host's memory), before anything is allocated."""
    available, where = runtime.memory_of(mesh.local_devices)
    buffers = TIMED_BUFFERS * len(mesh.local_devices)
    runtime.check_memory(int(buffers * megabytes * 2**20),
                         f"doctor --megabytes {megabytes:g}: timing collectives of {megabytes:g} MB per device",
                         f"pass at most --megabytes {available / (buffers * 2**20):.0f}", available, where)


def measure_bandwidth(mesh: Mesh, megabytes: float) -> list[Bandwidth]:
    """Time of one all-reduce and one ppermute of `megabytes` per device, per axis group."""
    width = max(1, int(megabytes * 2**20) // 4)
    sharding = NamedSharding(mesh, PartitionSpec(*mesh.axis_names, None))
    shape = (*mesh.devices.shape, width)
    buffer = jax.jit(lambda: jax.numpy.ones(shape, jax.numpy.float32), out_shardings=sharding)()
    nbytes = width * 4
    results = []
    for axes in axis_groups(mesh):
        size = rules_lib.axes_size(mesh, axes)
        reduce_s = _median_time(repeated_program("all-reduce", mesh, axes, TIMED_REPEATS), buffer) / TIMED_REPEATS
        permute_s = _median_time(repeated_program("ppermute", mesh, axes, TIMED_REPEATS), buffer) / TIMED_REPEATS
        results.append(Bandwidth(axes, size, reduce_s, nbytes / reduce_s * 2 * (size - 1) / size,
                                 permute_s, nbytes / permute_s))
    return results


def _median_time(program: Callable[[jax.Array], jax.Array], buffer: jax.Array) -> float:
    program(buffer).block_until_ready()  # compile and warm up
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        program(buffer).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sum_over_processes(local: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)


def hostnames() -> list[str]:
    """Each process's host name, gathered from every process."""
    mine = np.zeros(_HOSTNAME_BYTES, np.uint8)
    name = socket.gethostname().encode()[:_HOSTNAME_BYTES]
    mine[: len(name)] = np.frombuffer(name, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, _HOSTNAME_BYTES)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


def process_table(hosts: list[str]) -> list[str]:
    lines = []
    for process, host in enumerate(hosts):
        devices = [d for d in jax.devices() if d.process_index == process]
        kinds = sorted({d.device_kind for d in devices})
        lines.append(f"process {process}  host {host}  {len(devices)} device(s) ({', '.join(kinds)}): "
                     f"ids {', '.join(str(d.id) for d in devices)}")
    return lines


def _axes_str(axes: tuple[str, ...]) -> str:
    return "+".join(axes)


def report(mesh: Mesh, hosts: list[str], checks: list[CheckResult], bandwidth: list[Bandwidth],
           megabytes: float) -> list[str]:
    """The doctor's report as lines of text."""
    lines = [f"doctor: {jax.process_count()} process(es), {mesh.devices.size} devices, "
             f"mesh {mesh_lib.describe(mesh)}"]
    lines += process_table(hosts)
    lines.append(f"{'collective':<11} {'axes':<24} {'links':<18} result")
    for check in checks:
        links = "across processes" if crosses_processes(mesh, check.axes) else "within a process"
        verdict = "ok" if check.ok else f"FAILED ({check.mismatches} shard(s) wrong)"
        lines.append(f"{check.collective:<11} {_axes_str(check.axes):<24} {links:<18} {verdict}")
    lines.append(f"bandwidth, {megabytes:g} MB per device ({TIMED_REPEATS} in a row per call, median of "
                 f"{TIMED_RUNS} calls):")
    lines.append(f"{'axes':<24} {'size':>4} {'links':<18} {'all-reduce':>11} {'busbw GB/s':>11} "
                 f"{'ppermute':>10} {'GB/s':>8}")
    for bw in bandwidth:
        links = "across processes" if crosses_processes(mesh, bw.axes) else "within a process"
        lines.append(f"{_axes_str(bw.axes):<24} {bw.size:>4} {links:<18} {bw.all_reduce_s * 1e3:>9.2f}ms "
                     f"{bw.all_reduce_busbw / 1e9:>11.3f} {bw.ppermute_s * 1e3:>8.2f}ms {bw.ppermute_bw / 1e9:>8.3f}")
    failed = [check for check in checks if not check.ok]
    lines.append(f"doctor: {len(checks) - len(failed)} of {len(checks)} collective checks passed"
                 + ("" if not failed else "; FAILED: " + ", ".join(
                     f"{c.collective} over {_axes_str(c.axes)}" for c in failed)))
    return lines

