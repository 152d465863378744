"""Reading a checkpoint back: onto any mesh and process count, checked against its digests.

A restore builds abstract targets with the *current* shardings, so a checkpoint restores under any
mesh and process count that the model fits: every process reads just the pieces its devices need.
Each array is read in the dtype it was saved in, its digests are computed again over what was read,
in the target layout (see `jaxdist.checkpoint.integrity`), and only then is it cast: a checkpoint
whose arrays differ from the digests saved with them is damaged. One whose shapes differ from the
target's is another model's (`CheckpointMismatch`), not a damaged one.

`CheckpointReader` reads one directory's checkpoints through the Orbax manager of its store
(`jaxdist.checkpoint.store.Checkpoints`, which offers every read once the write in progress is done).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.checkpoint.integrity import DamagedCheckpoint, agree, array_digests, differences, parsing
from jaxdist.checkpoint.names import DIGESTS, META, STATE, is_prng_key, leaf_shapes, named_arrays
from jaxdist.errors import UserError, warn


class CheckpointMismatch(UserError):
    """A checkpoint that does not fit the model being restored (other parameters or shapes)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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


class CheckpointReader:
    """Reads back the checkpoints of one directory through its store's Orbax manager.

    Every process must make the same calls in the same order (reads are collective)."""

    def __init__(self, manager: ocp.CheckpointManager, directory: Path):
        self._manager = manager
        self.directory = directory

    def path(self, step: int) -> Path:
        """The directory of checkpoint `step` (it may not exist)."""
        return self.directory / str(step)

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        """`{dotted.path: (shape, dtype)}` of the state saved at `step`, from its metadata alone."""
        return leaf_shapes(self._state_tree(step))

    def _state_tree(self, step: int) -> Any:
        """The metadata of the state saved at `step`: its pytree of array metadata."""
        with parsing(f"the metadata of {self.path(step) / STATE}"):
            saved = self._manager.item_metadata(step).get(STATE)  # None, or absent from a step's stray files
        if saved is None:
            raise DamagedCheckpoint(f"checkpoint {self.path(step)} has no readable metadata of its state")
        return saved.tree

    def _json_object(self, step: int, item: str, value: Any) -> dict[str, Any]:
        """`value`, JSON item `item` of checkpoint `step` as read, if it is the object that was written."""
        if not isinstance(value, dict):
            raise DamagedCheckpoint(f"{self.path(step) / item} is malformed (a JSON {type(value).__name__}, not an object)")
        return value

    def meta(self, step: int) -> dict[str, Any]:
        """The JSON meta of checkpoint `step` (see `jaxdist.checkpoint.policy.run_meta`)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return self._json_object(step, META, restored[META])

    def read_metadata(self, step: int, meta_check: Callable[[dict[str, Any]], None] | None = None,
                      ) -> tuple[dict[str, tuple], dict[str, Any]]:
        """`saved_shapes(step)` and `meta(step)`, the meta checked by `meta_check` (which raises
        `DamagedCheckpoint` if it lacks what the caller reads from it). Collective, like `restore`:
        if reading fails on any process, it raises on every one, an error for which `is_damage`
        holds if the checkpoint is damaged."""
        try:
            saved, meta, err = self.saved_shapes(step), self.meta(step), None
            if meta_check is not None:
                meta_check(meta)
        except Exception as caught:  # noqa: BLE001  (every process must learn how the others fared)
            saved, meta, err = None, None, caught
        agree(err)
        return saved, meta

    def read_parts(self, step: int, parts: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts of checkpoint `step`'s state named in `parts` that it holds (e.g. params and
        model_state) as numpy arrays on this host (nothing else of the state is read), and its meta."""
        tree = self._state_tree(step)
        with parsing(f"the metadata of {self.path(step) / STATE}"):  # a run's state has named fields
            saved = {part: tree[part] for part in parts if tree.get(part) is not None}
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
        state = ocp.args.PyTreeRestore(item=saved, restore_args=as_numpy, partial_restore=True)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: state, META: ocp.args.JsonRestore()}))
        meta = self._json_object(step, META, restored[META])
        found = {part: restored[STATE][part] for part in saved}
        self.verify(step, found)
        return found, meta

    def read_placed(self, step: int, part: str, target: Any) -> Any:
        """Part `part` (e.g. params) of checkpoint `step`'s state read into `target`'s shapes, dtypes
        and shardings (`jax.ShapeDtypeStruct`s, any mesh): each process reads only the shards its
        devices hold. Checked against the saved digests. Collective."""
        self.check_fits(step, target, part)
        restore_args = ocp.checkpoint_utils.construct_restore_args({part: target})
        state = ocp.args.PyTreeRestore(item={part: target}, restore_args=restore_args, partial_restore=True)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE: state}))
        found = {part: restored[STATE][part]}
        self.verify(step, found)
        return found[part]

    def check_fits(self, step: int, target: Any, part: str | None = None,
                   unread: tuple[str, ...] = ()) -> dict[str, tuple]:
        """The saved shapes compared with `target`'s; raises `CheckpointMismatch` naming the first
        leaf whose shape differs.

        With `part` (e.g. "params"), `target` is compared with that part of the saved state only;
        the saved parts named in `unread` are left out.
        """
        saved = self.saved_shapes(step)
        saved = {name: shape for name, shape in saved.items() if name.split(".")[0] not in unread}
        if part is not None:
            saved = {name: shape for name, shape in saved.items() if name.split(".")[0] == part}
            target = {part: target}
        problem = first_mismatch(saved, leaf_shapes(target))
        if problem:
            raise CheckpointMismatch(f"checkpoint {self.path(step)} does not fit this model: {problem}", step)
        return saved

    def restore(self, step: int, target: Any, verify: bool = True,
                meta_check: Callable[[dict[str, Any]], None] | None = None, unread: tuple[str, ...] = ()) -> Restored:
        """Checkpoint `step` read into `target`'s shapes, dtypes and shardings (any mesh); the saved
        state's parts named in `unread` (fields of the train state) are not read.

        Typed PRNG key arrays in `target` come back typed, with their implementation. Arrays are
        read in their saved dtype, checked against their digests (unless `verify` is False) and
        then cast. The meta is checked by `meta_check`, as in `read_metadata`. Collective: if
        reading fails on any process, it raises on every one (see `integrity.agree`); a damaged
        checkpoint raises an error for which `is_damage` holds.
        """
        try:
            state, meta = self._read(step, target, unread)
            if meta_check is not None:
                meta_check(meta)
            digests, err = self._saved_digests(step) if verify else None, None
        except Exception as caught:  # noqa: BLE001  (every process must learn how the others fared)
            state, meta, digests, err = None, None, None, caught
        agree(err)
        self._check_digests(digests, state)  # on replicated sums: every process reaches the same verdict
        state = jax.tree.map(_as_target, target, state)
        return Restored(step, state, meta, self.path(step))

    def _read(self, step: int, target: Any, unread: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:
        saved = self.check_fits(step, target, unread=unread)
        leaves, treedef = jax.tree.flatten(target)
        read_target = jax.tree.unflatten(
            treedef, [_in_saved_dtype(leaf, saved[name]) for name, leaf in zip(named_arrays(target), leaves)])
        restore_args = ocp.checkpoint_utils.construct_restore_args(read_target)
        args = ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(read_target, restore_args, partial_restore=bool(unread)),
            META: ocp.args.JsonRestore(),
        })
        restored = self._manager.restore(step, args=args)
        return restored[STATE], self._json_object(step, META, restored[META])

    def verify(self, step: int, state: Any) -> None:
        """Raises `DamagedCheckpoint` if any array of `state`, read from checkpoint `step`, differs
        from the digest saved with it. A checkpoint written before digests were saved is used as
        it is, with a warning. Collective in its digest computation, not in its read of the saved
        digests (`restore` reads those before its processes agree)."""
        self._check_digests(self._saved_digests(step), state)

    def _saved_digests(self, step: int) -> dict[str, Any] | None:
        """The digests saved with checkpoint `step`; None, with a warning, if it has none."""
        if not (self.path(step) / DIGESTS).is_dir():
            warn(f"checkpoint {self.path(step)} has no digests (saved by an older jaxdist): not verified")
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(**{DIGESTS: ocp.args.JsonRestore()}))
        return self._json_object(step, DIGESTS, restored[DIGESTS])

    @staticmethod
    def _check_digests(saved: dict[str, Any] | None, state: Any) -> None:
        """Raises `DamagedCheckpoint` if any array of `state` differs from its digest in `saved`
        (None: nothing to check). Collective: every process computes the digests of the arrays."""
        if saved is None:
            return
        wrong = differences(saved, array_digests(named_arrays(state)))
        if wrong:
            more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
            raise DamagedCheckpoint(f"{wrong[0]}{more} differ from the digests saved with them")


def _in_saved_dtype(wanted: Any, saved: tuple[tuple[int, ...], str]) -> Any:
    """The target to read one array into: `wanted`, but in the dtype it was saved in, so that
    its digest can be checked before it is cast."""
    if is_prng_key(wanted) or np.dtype(wanted.dtype) == np.dtype(saved[1]):
        return wanted
    return jax.ShapeDtypeStruct(wanted.shape, saved[1], sharding=wanted.sharding)


def _as_target(wanted: Any, restored: Any) -> Any:
    """`restored` as `wanted` says: cast to its dtype, or a typed key array where it is one
    (Orbax gives back the key data)."""
    if not is_prng_key(wanted):
        if restored.dtype == wanted.dtype:
            return restored
        return jax.jit(lambda x: x.astype(wanted.dtype), out_shardings=wanted.sharding)(restored)
    if is_prng_key(restored):
        return restored
    impls = []
    # The implementation is known from the key type alone; key_impl reads it from a traced key.
    jax.eval_shape(lambda key: impls.append(jax.random.key_impl(key)), jax.ShapeDtypeStruct(wanted.shape, wanted.dtype))
    return jax.random.wrap_key_data(restored, impl=impls[0])

