"""The Orbax checkpoint store: asynchronous, sharded, resumable onto any mesh and process count.

`run_dir/checkpoints/<step>/` holds three Orbax items:

- `state`: the whole train-state pytree (step, params, optimizer state, and any field added to it
  later), in OCDBT. With several processes, every process writes only the shards it holds; nobody
  gathers the model. A single process holds every shard: it copies the state to host memory in one
  batched transfer and writes each array whole (see `_Snapshot`).
- `meta`: JSON written by process 0: the step, the data position (global example index and data
  seed), the resolved config, and where it was written (mesh, process and device counts, versions).
- `digests`: JSON written by process 0: two checksums per array of the state, computed on the
  devices before the write (see `jaxdist.checkpoint.integrity`). A restore computes them again
  over what it read, in the target layout, and a checkpoint that differs is damaged.

`save` returns once the copy of the arrays off the devices is under way (`HOST_COPIES` says how, by
platform); a background thread finishes the copy, writes the files and commits them while the next
steps run, and `poll` reports each save once it is complete. Orbax writes each step into a
temporary directory and renames it when every process is done, so a checkpoint killed mid-write is
never listed (and is removed at the next start).

Reading back, onto any mesh and process count, is `jaxdist.checkpoint.restore`'s: the store offers
its reads once the write in progress is done, and `restore_latest` falls back past damaged
checkpoints, setting each aside.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import math
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.checkpoint.integrity import PendingDigests, is_damage, start_digests
from jaxdist.checkpoint.names import DIGESTS, META, STATE, named_arrays
from jaxdist.checkpoint.restore import CheckpointReader, Restored
from jaxdist.errors import UserError, warn

# Where checkpoints that are not to be resumed from are moved, by why: damaged files, the state of a
# diverging run (its next step was bad), newer than the step a run was told to resume from.
UNREADABLE_PREFIX, DIVERGED_PREFIX, SUPERSEDED_PREFIX = "unreadable-", "diverged-", "superseded-"
SET_ASIDE_PREFIXES = (UNREADABLE_PREFIX, DIVERGED_PREFIX, SUPERSEDED_PREFIX)
_MIN_CHUNK_BYTES = 2**20
# How TensorStore's errors begin (its status codes); others are not about the files.
_TENSORSTORE_CODES = ("RESOURCE_EXHAUSTED", "DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                      "PERMISSION_DENIED", "UNAVAILABLE", "INTERNAL", "UNKNOWN", "ABORTED")


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (e.g. the disk is full); the ones before it are intact."""


def is_intact(state: Any) -> bool:
    """False if any buffer of `state` was donated or deleted (e.g. by a step that failed midway)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array))


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard leaf handlers, tuned for saving often (see `_Snapshot`).

    - jax.Array, written shard by shard as held: Orbax's default on CPU ("replica-parallel":
      replicated shards split among their replicas) compiles a slice program per shard shape at
      the first save and makes every save's blocking part several times longer; on GPU Orbax
      already turns it off. No `_sharding` file: restores always pass the target shardings, and
      writing it costs a TensorStore open per array (docs/checkpoints.md, "Cost").
    - numpy arrays, not copied again: every one handed to Orbax is a fresh host copy made by
      `_Snapshot` (Orbax's own copy was most of what a save blocked).
    """
    scalar = ocp.type_handlers.ScalarHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (np.number, scalar),
        (np.ndarray, _numpy_handler()),
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False, enable_write_sharding_file=False)),
    )


def _numpy_handler() -> ocp.type_handlers.NumpyHandler:
    try:
        return ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # orbax-checkpoint 0.12.4 (the GPU hosts) has no such option: it always copies
        return ocp.type_handlers.NumpyHandler()


# How a save copies the state off the devices before the next step may overwrite it (the step
# donates its input state):
# - numpy: one batched `jax.device_get` into numpy arrays, before `save` returns (one process
#   only). On a CPU there is no transfer to hide, and whole host arrays are the cheapest to write
#   (Orbax writes a jax.Array shard by shard, with Python bookkeeping for each: 231 device shards
#   for the tiny GPT on 8 devices took twice the CPU, and on a CPU-bound step that is step time).
# - device: a copy on the device (at HBM bandwidth: milliseconds), then, on the writer thread, the
#   transfer of that copy into pinned host memory while the next steps run. Costs the state's bytes
#   of device memory until the transfer is done.
# - pinned: the transfer into pinned host memory dispatched from `save`, for a state that cannot
#   be held twice on the devices: the next step waits for the copy of the buffers it overwrites,
#   and the loop for the allocation of the pinned buffers (about 1 GB/s).
# A GPU uses `device` where the device has room for the copy, else `pinned` (the measurements:
# benchmarks/reports/2026-11-28-run-around-the-step.md).
HostCopy = Literal["numpy", "pinned", "device"]
HOST_COPIES: tuple[HostCopy, ...] = ("numpy", "pinned", "device")
_ROOM = 1.25  # free device memory a device copy needs, over the state's bytes on that device


def default_host_copy(state: Any) -> HostCopy:
    """The host copy for `state` where none is set: numpy on a CPU with one process (several
    processes each hold only some shards, which must stay jax.Arrays), else device where every
    device has room for a copy of its part of the state, else pinned."""
    arrays = _arrays(state)
    if not arrays:
        return "numpy"
    if _platform(state) == "cpu":
        return "numpy" if jax.process_count() == 1 else "pinned"
    held: dict[Any, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    for device, nbytes in held.items():
        stats = device.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        if free < _ROOM * nbytes:
            return "pinned"
    return "device"


def _arrays(state: Any) -> list[jax.Array]:
    """The state's arrays a save copies off the devices (typed PRNG keys stay: Orbax stores their key data)."""
    return [leaf for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
            and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)]


def _pinned(arrays: list[jax.Array]) -> list[jax.Array]:
    """The arrays' copies in pinned host memory (dispatched; blocks only to allocate them)."""
    return jax.device_put(arrays, [array.sharding.with_memory_kind("pinned_host") for array in arrays])


def _allocate_pinned(arrays: list[jax.Array]) -> None:
    """Copies the arrays into pinned host memory and lets the copies go: what a save allocates."""
    for copy in jax.block_until_ready(_pinned(arrays)):
        copy.delete()


@jax.jit
def _device_copies(arrays: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(array) for array in arrays]


class _Snapshot:
    """The state of one save, taken off the devices' live buffers: `start` runs on the loop's thread
    (before the next step can donate the buffers), `to_write` on the writer's."""

    def __init__(self, state: Any, how: HostCopy):
        self.started = time.perf_counter()
        leaves, self._treedef = jax.tree.flatten(state)
        self._save_args = [ocp.SaveArgs() for _ in leaves]
        one_process = jax.process_count() == 1
        if how == "numpy" and not one_process:
            raise ValueError("host copy 'numpy' writes whole arrays, which needs one process")
        moved = {id(array) for array in _arrays(state)}
        self._moved = [i for i, leaf in enumerate(leaves) if id(leaf) in moved]
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, np.ndarray):
                leaves[i] = leaf.copy()  # the caller may change it while the write goes on
        arrays = [leaves[i] for i in self._moved]
        if one_process:  # written whole (see `_chunked`)
            for i in self._moved:
                self._save_args[i] = _chunked(leaves[i])
        copies = {"numpy": jax.device_get, "pinned": _pinned, "device": _device_copies}[how](arrays)
        if arrays and _platform(arrays) == "cpu":
            # XLA's in-process CPU collectives can deadlock while another program runs on the same
            # simulated devices: the copy ends before the next step starts, as each step does there.
            jax.block_until_ready(copies)
        for i, array in zip(self._moved, copies):
            leaves[i] = array
        self._leaves, self._how = leaves, how

    def to_write(self) -> ocp.args.PyTreeSave:
        """What Orbax writes: with one process whole numpy arrays, else each process's shards as jax.Arrays."""
        leaves = list(self._leaves)
        moved = [leaves[i] for i in self._moved]
        if self._how == "device":
            on_device, moved = moved, jax.block_until_ready(_pinned(moved))
            for array in on_device:
                array.delete()  # the device memory the copy held, free as soon as it is on the host
        if jax.process_count() == 1 and self._how != "numpy":
            moved = jax.device_get(moved)
        for i, array in zip(self._moved, moved):
            leaves[i] = array
        return ocp.args.PyTreeSave(jax.tree.unflatten(self._treedef, leaves),
                                   save_args=jax.tree.unflatten(self._treedef, self._save_args))

    def release(self) -> None:
        """Frees what the snapshot holds on the devices (a device copy not yet transferred)."""
        if self._how == "device":
            for i in self._moved:
                if isinstance(self._leaves[i], jax.Array) and not self._leaves[i].is_deleted():
                    self._leaves[i].delete()


class _Writer:
    """One background thread that runs a store's writes in order. A daemon: a write stuck in the
    file system (a lost mount) must never keep the process from exiting."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxdist-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((task, future))
        return future

    def _run(self) -> None:
        while True:
            task, future = self._tasks.get()
            if task is None:
                return
            future.set_running_or_notify_cancel()
            try:
                future.set_result(task())
            except BaseException as err:  # noqa: BLE001  (handed to whoever waits for the future)
                future.set_exception(err)

    def close(self, wait: bool = True) -> None:
        """Ends the thread once the tasks queued before are done (`wait`: and waits for that)."""
        self._tasks.put((None, None))
        if wait:
            self._thread.join()


def _chunked(array: jax.Array) -> ocp.SaveArgs:
    """Writes `array` in chunks no larger than one device's shard (or 1 MiB: Orbax warns below
    that), so that restoring onto many devices does not read a large array whole on each."""
    shard_bytes = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    chunk_bytes = max(shard_bytes, _MIN_CHUNK_BYTES)
    return ocp.SaveArgs(chunk_byte_size=chunk_bytes) if array.nbytes > chunk_bytes else ocp.SaveArgs()


def _registry() -> ocp.handlers.CheckpointHandlerRegistry:
    """Which Orbax handler reads and writes each item (also needed to read metadata before restoring)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    # Uncompressed: zstd took most of a write's CPU for 15% fewer bytes (float weights barely compress).
    state_handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers(), use_compression=False)
    meta_handler = ocp.JsonCheckpointHandler()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add(STATE, args, state_handler)
    digests_handler = ocp.JsonCheckpointHandler()
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(META, args, meta_handler)
        registry.add(DIGESTS, args, digests_handler)
    return registry


def _after_writes(read: Callable) -> Callable:
    """`CheckpointReader`'s method `read` as the store's: it waits for the write in progress first
    (Orbax lists a step before its write is done)."""

    @functools.wraps(read)
    def waiting(self: Checkpoints, *args, **kwargs):
        self.wait_for_write()
        return read(self._reader, *args, **kwargs)

    return waiting


class Checkpoints:
    """The checkpoints in one directory: async sharded saves, and restores with fallback.

    Every process must make the same calls in the same order (saving and restoring are collective).
    With `create=False` nothing is written to disk until `save`. `keep`: how many of the newest
    checkpoints Orbax keeps as it saves; None keeps every one (the caller deletes with `prune`).
    `host_copy`: how a save copies the state off the devices (`HOST_COPIES`; default: chosen at the
    first save by `default_host_copy`).
    `write_timeout`: seconds a write may take before a wait for it gives up (a stuck file system).
    """

    def __init__(self, directory: str | Path, keep: int | None = 3, create: bool = True,
                 host_copy: HostCopy | None = None, write_timeout: float | None = None):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(keep),
            # One process: each save runs whole on this store's writer thread. Several: Orbax's own
            # saves agree across processes with collectives, which must run on the thread that runs
            # the steps, in the same order everywhere; its background thread does the rest.
            enable_async_checkpointing=jax.process_count() > 1,
            cleanup_tmp_directories=create,
            create=create,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry())
        self._reader = CheckpointReader(self._manager, self.directory)
        self.last_saved: int | None = self._manager.latest_step()  # the newest complete checkpoint
        self.host_copy = host_copy
        self.write_timeout = write_timeout
        self.writing: int | None = None  # the step being written, until `poll` or `wait` sees it done
        self._pending: concurrent.futures.Future | None = None
        self.last_write_s: float | None = None  # how long the last complete write took, from its save
        self._writer: _Writer | None = None
        self._warming: concurrent.futures.Future | None = None
        self._write_failed = False
        # Old checkpoints a prune could not delete, with why (a prune tries them again).
        self.undeletable: dict[int, str] = {}
        self._prunes = itertools.count()  # each prune's barrier needs a name of its own

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (partial writes are never listed; a write
        in progress is waited for)."""
        self.wait_for_write()
        return list(self._manager.all_steps())

    def path(self, step: int) -> Path:
        """The directory of checkpoint `step` (it may not exist)."""
        return self._reader.path(step)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Starts writing checkpoint `step`; returns once its copy off the devices is under way.

        A previous write still in progress is waited for first, as by every read. Saving the last
        saved step again does nothing. The digests of the arrays are written with them, in the
        same step directory. `poll` or `wait` says when the checkpoint is complete.
        """
        if step == self.last_saved:
            return
        self.wait_for_write()
        how = self.host_copy = self.host_copy or default_host_copy(state)
        digests = start_digests(named_arrays(state))
        snapshot = _Snapshot(state, how)
        self.writing = step
        if jax.process_count() == 1:
            self._pending = self._writer_thread().submit(functools.partial(self._write, step, snapshot, digests, meta))
            return
        try:
            with self._reporting_write_failure(step):
                self._manager.save(step, args=self._args(snapshot, digests, meta), force=True)
        except BaseException:
            snapshot.release()
            raise
        self._pending = self._writer_thread().submit(functools.partial(self._committed, step, snapshot))

    def _args(self, snapshot: _Snapshot, digests: PendingDigests, meta: dict[str, Any]) -> ocp.args.Composite:
        return ocp.args.Composite(**{
            STATE: snapshot.to_write(), META: ocp.args.JsonSave(meta), DIGESTS: ocp.args.JsonSave(digests.result()),
        })

    def _write(self, step: int, snapshot: _Snapshot, digests: PendingDigests, meta: dict[str, Any]) -> float:
        """On the writer thread, with one process: finishes the copy to host, writes and commits
        checkpoint `step`; returns the seconds it took (from the save's call)."""
        try:
            with self._reporting_write_failure(step):
                self._manager.save(step, args=self._args(snapshot, digests, meta), force=True)
        finally:
            snapshot.release()
        return time.perf_counter() - snapshot.started

    def _committed(self, step: int, snapshot: _Snapshot) -> float:
        """On the writer thread, with several processes: waits for Orbax to commit checkpoint `step`."""
        try:
            with self._reporting_write_failure(step):
                self._manager.wait_until_finished()
        finally:
            snapshot.release()
        return time.perf_counter() - snapshot.started

    def start_warm_up(self, state: Any) -> None:
        """Starts, on the writer thread, what the first save would otherwise pay for: the pinned host
        buffers a GPU's save copies into (their allocation runs at about 1 GB/s and holds up the
        GPU; the allocator keeps them for every save after). Call it while the GPU idles (before
        compiling the step), and `warm_up` before the next step."""
        if _platform(state) != "cpu" and self.host_copy != "numpy" and (arrays := _arrays(state)):
            self._warming = self._writer_thread().submit(functools.partial(_allocate_pinned, arrays))

    def warm_up(self, state: Any) -> None:
        """Compiles what a save of `state` runs on the devices (its digests, a device copy) and waits
        for `start_warm_up`, so that the first save costs the loop no more than the others."""
        start_digests(named_arrays(state)).result()
        if _platform(state) != "cpu" and self.host_copy in (None, "device"):
            _device_copies.lower(_arrays(state)).compile()
        if self._warming is not None:
            self._warming.result(self.write_timeout)
            self._warming = None

    def poll(self) -> int | None:
        """The step of a save that completed since the last call, else None; raises
        `CheckpointWriteError` (the ones before it are intact) if it failed."""
        if self._pending is None or not self._pending.done():
            return None
        return self._finish()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the last save is complete on disk (at most `timeout` seconds: False if it
        is still being written by then).

        Raises `CheckpointWriteError` if it could not be written: its partial directory is never
        listed, and the checkpoints before it are untouched.
        """
        if self._pending is None:
            return True
        try:
            self._pending.exception(timeout)
        except concurrent.futures.TimeoutError:
            return False
        self._finish()
        return True

    def wait_for_write(self) -> None:
        """`wait`, at most `write_timeout` seconds: a write that takes longer raises
        `CheckpointWriteError` (its step is never listed; the ones before it are intact)."""
        if not self.wait(self.write_timeout):
            raise CheckpointWriteError(
                f"checkpoint {self.path(self.writing)} was not written within checkpoint.write_timeout="
                f"{self.write_timeout:g} s (is the file system of {self.directory} stuck?); the newest complete "
                f"checkpoint is step {self.last_saved}; fix the file system (or raise the timeout) and run again "
                f"to resume from it")

    def _finish(self) -> int:
        future, step = self._pending, self.writing
        self._pending, self.writing = None, None
        try:
            self.last_write_s = future.result()
        except CheckpointWriteError:
            self._write_failed = True
            self.last_saved = self._manager.latest_step()
            raise
        self.last_saved = step
        return step

    def prune(self, keep: int, keep_every: int | None = None, through: int | None = None) -> None:
        """Deletes, on the writer thread after the writes before it, the checkpoints up to step
        `through` (default: all) but the newest `keep` of them and those at multiples of `keep_every`.

        A checkpoint that cannot be deleted (the file system refuses, or it is a symbolic link) is
        kept and passed over, and listed in `undeletable` with why; the next prune tries it again."""
        def delete_old() -> None:
            upto = [step for step in self._manager.all_steps() if through is None or step <= through]
            doomed = [step for step in sorted(upto)[:-keep] if not (keep_every and step % keep_every == 0)]
            failed = {}
            if jax.process_index() == 0:  # process 0 deletes; the others wait for it
                failed = {step: why for step in doomed if (why := _delete_tree(self.path(step))) is not None}
            if jax.process_count() > 1:
                ocp.multihost.sync_global_processes(f"jaxdist_prune_{next(self._prunes)}")
            self._manager.reload()
            self.undeletable = {**{step: why for step, why in self.undeletable.items() if step not in doomed},
                                **failed}

        if jax.process_count() > 1:  # every process deletes together, as it saves (see `save`)
            if self.writing is not None:
                raise RuntimeError("prune with several processes runs between writes: wait for the last one first")
            delete_old()
        else:
            self._writer_thread().submit(delete_old)

    def _writer_thread(self) -> _Writer:
        if self._writer is None:
            self._writer = _Writer()
        return self._writer

    def close(self, wait: bool = True) -> None:
        """Waits for pending writes (and deletions) and releases Orbax's threads (raises like
        `wait_for_write`). `wait` False leaves a write in progress to the writer thread, which
        does not keep the process alive: its checkpoint is never listed."""
        try:
            if wait:
                self.wait_for_write()
                if self._writer is not None:
                    self._writer.submit(lambda: None).result(self.write_timeout)  # deletions after the last write
        finally:
            if self._writer is not None:
                self._writer.close(wait and self._pending is None)
                self._writer = None
            try:
                self._manager.close()
            except (OSError, ValueError):
                if not self._write_failed:
                    raise  # else Orbax raises the failed write's error again: already reported

    @contextlib.contextmanager
    def _reporting_write_failure(self, step: int) -> Iterator[None]:
        """Turns a failed write of `step` (a full disk, a lost mount) into one line."""
        try:
            yield
        except (OSError, ValueError) as err:
            if isinstance(err, ValueError) and not str(err).startswith(_TENSORSTORE_CODES):
                raise
            self._manager.reload()
            raise CheckpointWriteError(
                f"could not write checkpoint {self.path(step)} ({type(err).__name__}: {first_line(err)}); "
                f"the newest complete checkpoint is step {self._manager.latest_step()}; free space there (or "
                f"fix the directory) and run again to resume from it"
            ) from err

    # Reading back (jaxdist.checkpoint.restore), each read once the write in progress is done.
    saved_shapes = _after_writes(CheckpointReader.saved_shapes)
    meta = _after_writes(CheckpointReader.meta)
    read_metadata = _after_writes(CheckpointReader.read_metadata)
    read_parts = _after_writes(CheckpointReader.read_parts)
    read_placed = _after_writes(CheckpointReader.read_placed)
    check_fits = _after_writes(CheckpointReader.check_fits)
    restore = _after_writes(CheckpointReader.restore)
    verify = _after_writes(CheckpointReader.verify)

    def restore_latest(self, target: Any, newest: int | None = None,
                       meta_check: Callable[[dict[str, Any]], None] | None = None,
                       unread: tuple[str, ...] = ()) -> Restored | None:
        """The newest checkpoint (up to step `newest`) that reads back; None if there is none.
        `unread`: as `restore`'s.

        One that is damaged (files missing, cut short or corrupt, metadata that fails to parse or
        fails `meta_check`, or arrays that differ from their digests) is set aside (see
        `set_aside`) and the one before it is tried. Any other error (out of memory, a transient
        I/O error) is raised, and nothing is set aside. One whose shapes differ from the target
        raises `CheckpointMismatch`: that is the wrong model, not a damaged file.
        """
        for step in reversed(self.steps()):
            if newest is not None and step > newest:
                continue
            try:
                return self.restore(step, target, meta_check=meta_check, unread=unread)
            except Exception as err:
                if not is_damage(err):
                    raise
                self.set_aside(step, err)
        return None

    def set_aside(self, step: int, err: Exception | None = None, prefix: str = UNREADABLE_PREFIX,
                  reason: str | None = None) -> Path:
        """Renames checkpoint `step` to `<prefix><step>` (`<prefix><step>-2`, ... if that is taken:
        kept for a look, never listed again, and its step can be saved anew). An unreadable one
        (`err`: why) is reported in a warning; `reason` says why another is moved."""
        aside = self.directory / f"{prefix}{step}"
        # The same step can be saved anew and be set aside again: each copy keeps its own name.
        for copy in itertools.count(2):
            if not aside.exists():
                break
            aside = self.directory / f"{prefix}{step}-{copy}"
        if jax.process_index() == 0:
            self.path(step).rename(aside)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jaxdist_set_aside_{prefix}{step}")
        self._manager.reload()
        self.last_saved = self._manager.latest_step()
        if err is not None:
            warn(f"checkpoint {self.path(step)} is unreadable ({type(err).__name__}: {first_line(err)}); "
                 f"moved it to {aside}; falling back to the one before")
            if note := set_aside_summary(self.directory):
                warn(note)
        return aside


def _delete_tree(path: Path) -> str | None:
    """Deletes a checkpoint's directory; why it could not (one that is a link is not jaxdist's), or None."""
    if path.is_symlink():
        return "a symbolic link, which jaxdist does not delete through; remove it yourself"
    try:
        shutil.rmtree(path)
    except OSError as err:
        return err.strerror or str(err)
    return None


def _platform(state: Any) -> str:
    arrays = [leaf for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)]
    return next(iter(arrays[0].sharding.device_set)).platform if arrays else "cpu"


def set_aside_summary(directory: Path) -> str | None:
    """One line on the checkpoints set aside in `directory` (unreadable, diverged, superseded): how
    many and the space they hold, which nothing frees but the user; None where there are none."""
    folders = [path for path in directory.glob("*") if path.is_dir() and path.name.startswith(SET_ASIDE_PREFIXES)]
    if not folders:
        return None
    size = sum(file.stat().st_size for folder in folders for file in folder.rglob("*") if file.is_file())
    count = f"{len(folders)} set-aside checkpoint{'s' if len(folders) > 1 else ''}"
    kinds = ", ".join(f"{prefix}*" for prefix in SET_ASIDE_PREFIXES if any(f.name.startswith(prefix) for f in folders))
    return f"{directory} holds {count} ({kinds}), {size / 1e6:,.1f} MB; delete them when you no longer need them"


def first_line(err: Exception) -> str:
    """The first line of an error's message, for a one-line report."""
    text = str(err).strip()
    if not text:
        return "no message"
    line = text.splitlines()[0]
    # The end of a long line often holds the reason ("No space left on device").
    return line if len(line) <= 200 else f"{line[:80]} ... {line[-115:]}"