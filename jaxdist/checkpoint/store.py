"""The Orbax checkpoint store: asynchronous, sharded, resumable onto any mesh and process count.

`run_dir/checkpoints/<step>/` holds three Orbax items:

- `state`: the whole train-state pytree (step, params, optimizer state, and any field added to it
  later), in OCDBT. With several processes, every process writes only the shards it holds; nobody
  gathers the model. A single process holds every shard: it copies the state to host memory in one
  batched transfer and writes each array whole (see `_state_to_write`).
- `meta`: JSON written by process 0: the step, the data position (global example index and data
  seed), the resolved config, and where it was written (mesh, process and device counts, versions).
- `digests`: JSON written by process 0: two checksums per array of the state, computed on the
  devices before the write (see `jaxdist.checkpoint.integrity`). A restore computes them again
  over what it read, in the target layout, and a checkpoint that differs is damaged.

`save` returns once the arrays are copied off the devices; the write goes on while the next steps
run. Orbax writes each step into a temporary directory and renames it when every process is done,
so a checkpoint killed mid-write is never listed (and is removed at the next start). Restoring
builds abstract targets with the *current* shardings, so a checkpoint restores under any mesh and
process count that the model fits: every process reads just the pieces its devices need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.checkpoint.integrity import DamagedCheckpoint, agree, array_digests, differences, is_damage
from jaxdist.errors import UserError, warn

STATE, META, DIGESTS = "state", "meta", "digests"
UNREADABLE_PREFIX = "unreadable-"
_MIN_CHUNK_BYTES = 2**20
# How TensorStore's errors begin (its status codes); others are not about the files.
_TENSORSTORE_CODES = ("RESOURCE_EXHAUSTED", "DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                      "PERMISSION_DENIED", "UNAVAILABLE", "INTERNAL", "UNKNOWN", "ABORTED")


class CheckpointMismatch(UserError):
    """A checkpoint that does not fit the model being restored (other parameters or shapes)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (e.g. the disk is full); the ones before it are intact."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint read back: its step, the state (in the requested shardings) and its meta."""

    step: int
    state: Any
    meta: dict[str, Any]
    path: Path


def abstract_state(state: Any) -> Any:
    """Shape, dtype and sharding of every array in `state`: a target to restore into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def is_intact(state: Any) -> bool:
    """False if any buffer of `state` was donated or deleted (e.g. by a step that failed midway)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array))


def named_arrays(tree: Any) -> dict[str, Any]:
    """`{dotted.path: leaf}` of every array-like leaf of `tree`, in tree order."""
    return {dotted_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def leaf_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{dotted.path: (shape, dtype)}` of every array-like leaf, in tree order.

    Works on live states, abstract states and Orbax's saved metadata alike, and names leaves the
    way Orbax does (`opt_state.1.0.mu.blocks.attn.qkv`).
    """
    shapes = {}
    for name, leaf in named_arrays(tree).items():
        if _is_key(leaf):
            # A typed PRNG key array is saved as its key data (uint32, one more axis or more).
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        shapes[name] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return shapes


def dotted_name(path) -> str:
    """A pytree key path as Orbax names it: `opt_state.1.0.mu.blocks.attn.qkv`."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def first_mismatch(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """The first difference between saved and wanted leaf shapes, in the wanted order, as words.

    Dtypes may differ (Orbax casts on restore, e.g. float32 params into bfloat16 ones).
    """
    for name, (shape, _) in wanted.items():
        if name not in saved:
            return f"{name} {shape} is in this model but not in the checkpoint"
        if saved[name][0] != shape:
            return f"{name} has shape {saved[name][0]} in the checkpoint but {shape} in this model"
    for name, (shape, _) in saved.items():
        if name not in wanted:
            return f"{name} {shape} is in the checkpoint but not in this model"
    return None


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard leaf handlers, tuned for saving often (see `_state_to_write`).

    - jax.Array, written shard by shard as held: Orbax's default on CPU ("replica-parallel":
      replicated shards split among their replicas) compiles a slice program per shard shape at
      the first save and makes every save's blocking part several times longer; on GPU Orbax
      already turns it off. No `_sharding` file: restores always pass the target shardings, and
      writing it costs a TensorStore open per array (docs/checkpoints.md, "Cost").
    - numpy arrays, not copied again: every one handed to Orbax is a fresh host copy made by
      `_state_to_write` (Orbax's own copy was most of what a save blocked).
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


def _state_to_write(state: Any) -> ocp.args.PyTreeSave:
    """What Orbax is given to write `state`; numpy leaves are copied (the caller may change them).

    With one process, every jax.Array is copied to host memory by one batched `jax.device_get`
    and written whole, as a numpy array. Orbax writes a jax.Array shard by shard, with Python
    bookkeeping for each one (231 device shards for the tiny GPT on 8 devices): that took twice
    the CPU, and on a CPU-bound step the save's CPU is step time. The files hold the same arrays,
    so the checkpoint restores onto any mesh and process count alike. With several processes,
    each process holds only some shards and writes those. PRNG key arrays stay jax.Arrays (Orbax
    stores their key data and implementation).
    """
    leaves, treedef = jax.tree.flatten(state)
    save_args = [ocp.SaveArgs() for _ in leaves]
    one_process = jax.process_count() == 1
    whole = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, np.ndarray):
            leaves[i] = leaf.copy()
        elif (one_process and isinstance(leaf, jax.Array)
              and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)):
            save_args[i] = _chunked(leaf)
            whole.append(i)
    for i, host in zip(whole, jax.device_get([leaves[i] for i in whole])):
        leaves[i] = host
    return ocp.args.PyTreeSave(jax.tree.unflatten(treedef, leaves), save_args=jax.tree.unflatten(treedef, save_args))


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _in_saved_dtype(wanted: Any, saved: tuple[tuple[int, ...], str]) -> Any:
    """The target to read one array into: `wanted`, but in the dtype it was saved in, so that
    its digest can be checked before it is cast."""
    if _is_key(wanted) or np.dtype(wanted.dtype) == np.dtype(saved[1]):
        return wanted
    return jax.ShapeDtypeStruct(wanted.shape, saved[1], sharding=wanted.sharding)


def _as_target(wanted: Any, restored: Any) -> Any:
    """`restored` as `wanted` says: cast to its dtype, or a typed key array where it is one
    (Orbax gives back the key data)."""
    if not _is_key(wanted):
        if restored.dtype == wanted.dtype:
            return restored
        return jax.jit(lambda x: x.astype(wanted.dtype), out_shardings=wanted.sharding)(restored)
    if _is_key(restored):
        return restored
    impls = []
    # The implementation is known from the key type alone; key_impl reads it from a traced key.
    jax.eval_shape(lambda key: impls.append(jax.random.key_impl(key)), jax.ShapeDtypeStruct(wanted.shape, wanted.dtype))
    return jax.random.wrap_key_data(restored, impl=impls[0])


def _chunked(array: jax.Array) -> ocp.SaveArgs:
    """Writes `array` in chunks no larger than one device's shard (or 1 MiB: Orbax warns below
    that), so that restoring onto many devices does not read a large array whole on each."""
    shard_bytes = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    chunk_bytes = max(shard_bytes, _MIN_CHUNK_BYTES)
    return ocp.SaveArgs(chunk_byte_size=chunk_bytes) if array.nbytes > chunk_bytes else ocp.SaveArgs()


def _registry() -> ocp.handlers.CheckpointHandlerRegistry:
    """Which Orbax handler reads and writes each item (also needed to read metadata before restoring)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state_handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers())
    meta_handler = ocp.JsonCheckpointHandler()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add(STATE, args, state_handler)
    digests_handler = ocp.JsonCheckpointHandler()
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(META, args, meta_handler)
        registry.add(DIGESTS, args, digests_handler)
    return registry


def _after_writes(read):
    """Makes a read wait for the write in progress: Orbax lists a step before its write is done."""

    @functools.wraps(read)
    def waiting(self, *args, **kwargs):
        self.wait()
        return read(self, *args, **kwargs)

    return waiting


class Checkpoints:
    """The checkpoints in one directory: async sharded saves, and restores with fallback.

    Every process must make the same calls in the same order (saving and restoring are collective).
    With `create=False` nothing is written to disk until `save`.
    """

    def __init__(self, directory: str | Path, keep: int = 3, create: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=create,
            create=create,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry())
        self.last_saved: int | None = self._manager.latest_step()
        self._writing: int | None = None
        self._write_failed = False

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @_after_writes
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (partial writes are never listed; a write
        in progress is waited for)."""
        return list(self._manager.all_steps())

    def path(self, step: int) -> Path:
        """The directory of checkpoint `step` (it may not exist)."""
        return self.directory / str(step)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Starts writing checkpoint `step`; returns once the arrays are copied off the devices.

        A previous write still in progress is waited for first, as by every read. Saving the last
        saved step again does nothing.
        The digests of the arrays are written with them, in the same step directory.
        """
        if step == self.last_saved:
            return
        self.wait()  # Orbax would wait too; here a failed write is told apart from this one
        digests = array_digests(named_arrays(state))
        args = ocp.args.Composite(**{
            STATE: _state_to_write(state), META: ocp.args.JsonSave(meta), DIGESTS: ocp.args.JsonSave(digests),
        })
        self._writing = step
        with self._reporting_write_failure():
            self._manager.save(step, args=args, force=True)
        self.last_saved = step

    def wait(self) -> None:
        """Blocks until the last save is complete on disk.

        Raises `CheckpointWriteError` if it could not be written: its partial directory is never
        listed, and the checkpoints before it are untouched.
        """
        with self._reporting_write_failure():
            self._manager.wait_until_finished()
        self._writing = None

    def close(self) -> None:
        """Waits for pending writes and releases Orbax's threads (raises like `wait`)."""
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            except (OSError, ValueError):
                if not self._write_failed:
                    raise  # else Orbax raises the failed write's error again: already reported

    @contextlib.contextmanager
    def _reporting_write_failure(self) -> Iterator[None]:
        """Turns a failed write of step `self._writing` (a full disk, a lost mount) into one line."""
        try:
            yield
        except (OSError, ValueError) as err:
            if isinstance(err, ValueError) and not str(err).startswith(_TENSORSTORE_CODES):
                raise
            step, self._writing, self._write_failed = self._writing, None, True
            self._manager.reload()
            self.last_saved = self._manager.latest_step()
            raise CheckpointWriteError(
                f"could not write checkpoint {self.path(step)} ({type(err).__name__}: {first_line(err)}); "
                f"the newest complete checkpoint is step {self.last_saved}; free space there (or fix the "
                f"directory) and run again to resume from it"
            ) from err

    @_after_writes
    def saved_shapes(self, step: int) -> dict[str, tuple]:
        """`{dotted.path: (shape, dtype)}` of the state saved at `step`, from its metadata alone."""
        return leaf_shapes(self._state_metadata(step).tree)

    def _state_metadata(self, step: int) -> Any:
        saved = self._manager.item_metadata(step).get(STATE)  # None, or absent from a step's stray files
        if saved is None:
            raise DamagedCheckpoint(f"checkpoint {self.path(step)} has no readable metadata of its state")
        return saved

    @_after_writes
    def meta(self, step: int) -> dict[str, Any]:
        """The JSON meta of checkpoint `step` (see `jaxdist.checkpoint.run.run_meta`)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return dict(restored[META])

    @_after_writes
    def read_parts(self, step: int, parts: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts of checkpoint `step`'s state named in `parts` that it holds (e.g. params and
        model_state) as numpy arrays on this host (nothing else of the state is read), and its meta."""
        tree = self._state_metadata(step).tree
        saved = {part: tree[part] for part in parts if tree.get(part) is not None}
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
        state = ocp.args.PyTreeRestore(item=saved, restore_args=as_numpy, partial_restore=True)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: state, META: ocp.args.JsonRestore()}))
        found = {part: restored[STATE][part] for part in saved}
        self.verify(step, found)
        return found, dict(restored[META])

    def check_fits(self, step: int, target: Any, part: str | None = None) -> None:
        """Raises `CheckpointMismatch` naming the first leaf whose shape differs from `target`'s.

        With `part` (e.g. "params"), `target` is compared with that part of the saved state only.
        """
        saved = self.saved_shapes(step)
        if part is not None:
            saved = {name: shape for name, shape in saved.items() if name.split(".")[0] == part}
            target = {part: target}
        problem = first_mismatch(saved, leaf_shapes(target))
        if problem:
            raise CheckpointMismatch(f"checkpoint {self.path(step)} does not fit this model: {problem}", step)
        return saved

    @_after_writes
    def restore(self, step: int, target: Any, verify: bool = True) -> Restored:
        """Checkpoint `step` read into `target`'s shapes, dtypes and shardings (any mesh).

        Typed PRNG key arrays in `target` come back typed, with their implementation. Arrays are
        read in their saved dtype, checked against their digests (unless `verify` is False) and
        then cast. Collective: if reading fails on any process, it raises on every one (see
        `integrity.agree`); a damaged checkpoint raises an error for which `is_damage` holds.
        """
        try:
            state, meta, err = *self._read(step, target), None
        except Exception as caught:  # noqa: BLE001  (every process must learn how the others fared)
            state, meta, err = None, None, caught
        agree(err)
        if verify:
            self.verify(step, state)
        state = jax.tree.map(_as_target, target, state)
        return Restored(step, state, meta, self.path(step))

    def _read(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        saved = self.check_fits(step, target)
        leaves, treedef = jax.tree.flatten(target)
        read_target = jax.tree.unflatten(
            treedef, [_in_saved_dtype(leaf, saved[name]) for name, leaf in zip(named_arrays(target), leaves)])
        restore_args = ocp.checkpoint_utils.construct_restore_args(read_target)
        args = ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(read_target, restore_args), META: ocp.args.JsonRestore(),
        })
        restored = self._manager.restore(step, args=args)
        return restored[STATE], dict(restored[META])

    @_after_writes
    def verify(self, step: int, state: Any) -> None:
        """Raises `DamagedCheckpoint` if any array of `state`, read from checkpoint `step`, differs
        from the digest saved with it. A checkpoint written before digests were saved is used as
        it is, with a warning. Collective, like `restore`."""
        if not (self.path(step) / DIGESTS).is_dir():
            warn(f"checkpoint {self.path(step)} has no digests (saved by an older jaxdist): not verified")
            return
        saved = self._manager.restore(step, args=ocp.args.Composite(**{DIGESTS: ocp.args.JsonRestore()}))[DIGESTS]
        wrong = differences(dict(saved), array_digests(named_arrays(state)))
        if wrong:
            more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
            raise DamagedCheckpoint(f"{wrong[0]}{more} differ from the digests saved with them")

    def restore_latest(self, target: Any, newest: int | None = None) -> Restored | None:
        """The newest checkpoint (up to step `newest`) that reads back; None if there is none.

        One that is damaged (files missing, cut short or corrupt, or arrays that differ from
        their digests) is set aside (see `set_aside`) and the one before it is tried. Any other
        error (out of memory, a transient I/O error) is raised, and nothing is set aside. One
        whose shapes differ from the target raises `CheckpointMismatch`: that is the wrong
        model, not a damaged file.
        """
        for step in reversed(self.steps()):
            if newest is not None and step > newest:
                continue
            try:
                return self.restore(step, target)
            except Exception as err:
                if not is_damage(err):
                    raise
                self.set_aside(step, err)
        return None

    def set_aside(self, step: int, err: Exception) -> Path:
        """Renames unreadable checkpoint `step` to `unreadable-<step>` (`unreadable-<step>-2`, ... if
        that is taken: kept for a look, never listed again, and its step can be saved anew), with a
        warning."""
        aside = self.directory / f"{UNREADABLE_PREFIX}{step}"
        # The same step can be saved anew and be found unreadable again: each copy keeps its own name.
        for copy in itertools.count(2):
            if not aside.exists():
                break
            aside = self.directory / f"{UNREADABLE_PREFIX}{step}-{copy}"
        if jax.process_index() == 0:
            self.path(step).rename(aside)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jaxdist_set_aside_{step}")
        self._manager.reload()
        self.last_saved = self._manager.latest_step()
        warn(f"checkpoint {self.path(step)} is unreadable ({type(err).__name__}: {first_line(err)}); "
             f"moved it to {aside}; falling back to the one before")
        if note := set_aside_summary(self.directory):
            warn(note)
        return aside


def set_aside_summary(directory: Path) -> str | None:
    """One line on the checkpoints set aside in `directory` (`unreadable-*`): how many and the space
    they hold, which nothing frees but the user; None where there are none."""
    folders = [path for path in directory.glob(f"{UNREADABLE_PREFIX}*") if path.is_dir()]
    if not folders:
        return None
    size = sum(file.stat().st_size for folder in folders for file in folder.rglob("*") if file.is_file())
    count = f"{len(folders)} set-aside checkpoint{'s' if len(folders) > 1 else ''}"
    return (f"{directory} holds {count} ({UNREADABLE_PREFIX}*), {size / 1e6:,.1f} MB; delete them when you no "
            f"longer need them")


def first_line(err: Exception) -> str:
    """The first line of an error's message, for a one-line report."""
    text = str(err).strip()
    if not text:
        return "no message"
    line = text.splitlines()[0]
    # The end of a long line often holds the reason ("No space left on device").
    return line if len(line) <= 200 else f"{line[:80]} ... {line[-115:]}"
