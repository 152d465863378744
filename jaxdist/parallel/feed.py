"""Which rows of each global batch a process feeds, decided by the batch sharding on the mesh.

The batch dimension is split over the mesh axes of the `batch` rule (with pipeline stages, the
stage axis too: parallel/pipeline.py); every other mesh axis (tensor, and fsdp or data where the
rules leave them out of the batch) holds replicas of those rows. A process feeds exactly the
distinct rows its own devices hold: when a non-batch axis spans processes (tensor parallelism
across hosts), several processes hold, and so read, the same rows. The process count alone never
decides it.

Row r of global batch b is example `start + b * global_batch + r` of the global stream (data
pipelines), so processes that hold the same rows read the same examples.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.errors import UserError
from jaxdist.parallel import rules as rules_lib


def batch_sharding(mesh: Mesh, rules: rules_lib.Rules) -> NamedSharding:
    """Sharding of every batch array: the leading (example) dim split as the `batch` rule says."""
    return NamedSharding(mesh, rules.activation_spec(("batch",), "the input batch"))


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """The rows of a global batch of `global_batch` rows that one process feeds, in order.

    `rows` lists the distinct row indices the process's devices hold, ascending; the process's
    local batch is those rows, in that order (`len(rows)` of them).
    """

    global_batch: int
    rows: tuple[int, ...]

    @property
    def local_batch(self) -> int:
        return len(self.rows)

    def example(self, local_index: int, start: int = 0) -> int:
        """The global stream index of the `local_index`-th row this process reads, counting from `start`."""
        batch, row = divmod(local_index, len(self.rows))
        return start + batch * self.global_batch + self.rows[row]


def _row_slices(sharding: NamedSharding, global_batch: int) -> dict[jax.Device, range]:
    """Device -> the rows of a global batch it holds under `sharding` (batch = leading dim)."""
    return {
        device: range(*index[0].indices(global_batch))
        for device, index in sharding.devices_indices_map((global_batch,)).items()
    }


def batch_shards(sharding: NamedSharding, global_batch: int) -> list[range]:
    """The distinct row ranges the devices of `sharding` split a global batch into, in order."""
    return sorted(set(_row_slices(sharding, global_batch).values()), key=lambda rows: rows.start)


def process_rows(sharding: NamedSharding, global_batch: int, process_index: int | None = None) -> BatchRows:
    """The rows of a global batch that process `process_index` (default: this one) must feed."""
    process = jax.process_index() if process_index is None else process_index
    held = {rows for device, rows in _row_slices(sharding, global_batch).items() if device.process_index == process}
    if not held:
        raise ValueError(f"process {process} has no device in this sharding's mesh")
    return BatchRows(global_batch, tuple(row for rows in sorted(held, key=lambda r: r.start) for row in rows))


@functools.lru_cache(maxsize=64)
def global_size(sharding: NamedSharding, local_batch: int) -> int:
    """The global batch whose rows for this process number `local_batch`."""
    shards = len(batch_shards(sharding, sharding.mesh.size))  # a size every split divides
    held = len(process_rows(sharding, shards).rows)
    if local_batch % held:
        raise UserError(
            f"this process's batch of {local_batch} rows does not split over the {held} batch shards its "
            f"devices hold; feed a multiple of {held} rows"
        )
    return local_batch * shards // held


def assemble(local: Mapping[str, np.ndarray], sharding: NamedSharding, global_batch: int | None = None) -> dict[str, jax.Array]:
    """This process's rows (as `process_rows` says) -> one global `jax.Array` per key, on the mesh.

    `global_batch` defaults to what this process's row count implies.
    """
    result = {}
    for key, value in local.items():
        rows = global_size(sharding, len(value)) if global_batch is None else global_batch
        result[key] = jax.make_array_from_process_local_data(sharding, value, (rows, *value.shape[1:]))
    return result


def _digest(local: Mapping[str, np.ndarray], rows: slice) -> int:
    """A checksum of the given local rows of every key (keys in sorted order)."""
    digest = 0
    for key in sorted(local):
        digest = zlib.crc32(np.ascontiguousarray(local[key][rows]).tobytes(), digest)
    return digest


def shard_digests(local: Mapping[str, np.ndarray], sharding: NamedSharding, rows: BatchRows) -> np.ndarray:
    """One checksum per batch shard of the mesh for the shards this process holds, -1 elsewhere."""
    shards = batch_shards(sharding, rows.global_batch)
    position = {row: i for i, row in enumerate(rows.rows)}
    digests = np.full(len(shards), -1, np.int64)
    for i, shard in enumerate(shards):
        if shard.start in position:
            first = position[shard.start]
            digests[i] = _digest(local, slice(first, first + len(shard)))
    return digests


def _groups(values: Mapping[int, int]) -> dict[int, list[int]]:
    """Process -> value, as value -> the processes that have it (in order of first appearance)."""
    groups: dict[int, list[int]] = {}
    for process, value in values.items():
        groups.setdefault(value, []).append(process)
    return groups


def _processes(group: list[int]) -> str:
    return "processes " + ",".join(map(str, group))


def disagreeing_replicas(digests: np.ndarray, shards: list[range]) -> str | None:
    """Given every process's `shard_digests` (one row per process), the first shard whose replicas
    on different processes differ, as words; None if all agree."""
    for column, shard in enumerate(shards):
        held = {process: int(value) for process, value in enumerate(digests[:, column]) if value != -1}
        if len(set(held.values())) > 1:
            sides = " vs ".join(_processes(group) for group in _groups(held).values())
            return f"rows {shard.start}..{shard.stop - 1} differ between {sides}"
    return None


def disagreeing_sources(fingerprints: np.ndarray, names: list[str]) -> str | None:
    """Given every process's (examples, checksum) of each of the sources `names` (one row per
    process: examples and checksum of the first source, then of the second, ...), the first source
    that differs between processes, as words; None if all agree."""
    for i, name in enumerate(names):
        examples, checksums = (dict(enumerate(int(v) for v in fingerprints[:, 2 * i + j])) for j in (0, 1))
        if len(set(examples.values())) > 1:
            sides = ", ".join(f"{count} examples on {_processes(group)}" for count, group in _groups(examples).items())
            return f"{name} holds {sides}"
        if len(set(checksums.values())) > 1:
            sides = " vs ".join(_processes(group) for group in _groups(checksums).values())
            return f"{name} holds {examples[0]} examples on every process, but they differ between {sides}"
    return None


def check_sources_agree(fingerprints: Mapping[str, tuple[int, int]]) -> None:
    """Raises a `UserError` unless every process has the same (examples, checksum) for each named
    data source (`jaxdist.data.loader.fingerprint`). Processes index one global stream of
    examples, so each must hold the same data: `check_replicas_agree` only compares the rows that
    several processes hold, and a layout may have none.

    Collective: every process must call it with the same names.
    """
    if jax.process_count() == 1:
        return
    local = np.array([value for pair in fingerprints.values() for value in pair], np.int64)
    problem = disagreeing_sources(_per_process(local), list(fingerprints))
    if problem:
        raise UserError(
            f"the data differs across processes: {problem}; every process must read the same data "
            f"(same data.path contents on every host)"
        )


def _per_process(local: np.ndarray) -> np.ndarray:
    """Every process's 1-D `local`, one row per process. Collective."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), -1)


def check_replicas_agree(local: Mapping[str, np.ndarray], sharding: NamedSharding, rows: BatchRows) -> None:
    """Raises a `UserError` unless every process that holds a batch row read the same values for it.

    Collective: every process must call it with its local rows of the same global batch.
    """
    if jax.process_count() == 1:
        return
    digests = _per_process(shard_digests(local, sharding, rows))
    problem = disagreeing_replicas(digests, batch_shards(sharding, rows.global_batch))
    if problem:
        raise UserError(
            f"the first global batch disagrees across processes: {problem}, though those processes hold "
            f"the same rows; every process must see the same data (same data.path contents, seed and "
            f"jaxdist version on every host)"
        )
