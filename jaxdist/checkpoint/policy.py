"""The training run's checkpoint policy: restoring, when to save, rotation, and the run's meta.

`RunCheckpoints` drives the store (`jaxdist.checkpoint.store`) for `jaxdist train`: it restores the
checkpoint `checkpoint.resume.plan_resume` chose, saves on schedule, at a preemption and after an
error, and records the data position, so a resumed run reads on where it stopped.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.checkpoint.resume import (DataPosition, ResumePlan, changed_keys, check_meta, explaining_mismatch,
                                       position_of)
from jaxdist.checkpoint.names import leaf_shapes
from jaxdist.checkpoint.restore import Restored, abstract_state
from jaxdist.checkpoint.store import (
    DIVERGED_PREFIX,
    SUPERSEDED_PREFIX,
    UNREADABLE_PREFIX,
    Checkpoints,
    CheckpointWriteError,
    first_line,
    is_intact,
)
from jaxdist.config import Config
from jaxdist.errors import NonFiniteError, UserError, warn

_VERSIONED_PACKAGES = ("jaxdist", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")


@functools.cache
def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries a checkpoint depends on (looked up once: it is slow)."""
    versions = {"python": sys.version.split()[0]}
    for package in _VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def run_meta(cfg: Config, mesh: Mesh, position: DataPosition, bad_steps_in_a_row: int = 0) -> dict[str, Any]:
    """What a checkpoint says about itself besides the arrays (JSON-serializable).

    `bad_steps_in_a_row`: the non-finite steps that end at this one, skipped under
    `train.on_nonfinite=skip`; a resumed run goes on counting from it."""
    return {
        "step": position.step,
        "data": {"example": position.example, "seed": cfg.seed},
        "bad_steps_in_a_row": bad_steps_in_a_row,
        "config": cfg.model_dump(mode="json"),
        "mesh": dict(mesh.shape),
        "process_count": jax.process_count(),
        "device_count": mesh.devices.size,
        "platform": mesh.devices.flat[0].platform,
        "versions": dict(library_versions()),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class RunCheckpoints:
    """The training loop's checkpoint policy for one run directory.

    `resume` restores the checkpoint `plan` names (`checkpoint.resume.plan_resume`) into the
    trainer's shardings. Saves: every `checkpoint.every`
    steps and at the last step, at a preemption, and (one process) after an error if the state is
    intact. `checkpoint.every=0` turns saving off; existing checkpoints are still resumed from.

    Rotation waits for the step after a checkpoint: checkpoint s is confirmed once step s + 1,
    which starts from its parameters, was judged sane (`confirm`); only confirmed checkpoints beyond
    the newest `checkpoint.keep` (and not at a multiple of `checkpoint.keep_every`) are deleted. So a
    run that diverges never rotates out its sane checkpoints for diverged ones, and `diverged` sets
    aside those of the diverging steps.
    """

    def __init__(self, cfg: Config, plan: ResumePlan, log: Callable[[str], None]):
        self.cfg = cfg
        self.log = log
        self.enabled = cfg.checkpoint.every > 0
        self.directory = Path(cfg.run_dir) / "checkpoints"
        self.start = DataPosition()
        # The guard's count of bad steps in a row where the restored checkpoint was saved.
        self.resumed_bad_steps_in_a_row = 0
        self._planned = plan.step
        self._newer_than_planned = plan.superseded  # set aside at `resume`: a resume from an older step
        self._store: Checkpoints | None = None
        self._mesh: Mesh | None = None
        self._unconfirmed: list[int] = []  # checkpoints whose next step is not judged yet
        self._prune_through: int | None = None  # rotation due through this step
        self._said_undeletable: set[int] = set()  # old checkpoints a warning said could not be deleted

    def resume(self, trainer) -> DataPosition:
        """Restores the prepared checkpoint (or, if its arrays fail to read, the newest one before
        it that reads) into `trainer.state`, in the trainer's shardings. Returns the position to
        continue from (step 0 when there is no checkpoint)."""
        self._mesh = trainer.mesh
        if self._planned is None and not self.enabled:
            return self.start  # nothing to read and nothing to write: no checkpoints/ is made
        # Rotation is this policy's (`confirm`), not Orbax's: a checkpoint is kept until confirmed.
        self._store = Checkpoints(self.directory, keep=None, write_timeout=self.cfg.checkpoint.write_timeout)
        if self._planned is None:
            if self.enabled:
                self._store.start_warm_up(trainer.state)
            return self.start
        for newer in self._newer_than_planned:
            aside = self._store.set_aside(newer, reason=f"checkpoint.resume_step={self._planned} resumes before it",
                                          prefix=SUPERSEDED_PREFIX)
            self.log(f"moved checkpoint {newer} to {aside} (newer than checkpoint.resume_step={self._planned})")
        target, complete = self._restore_target(trainer.state)
        # Free the freshly initialized state first (once its init has run), so the state is never
        # held twice; what the checkpoint lacks is kept, to start fresh.
        kept = complete.fresh_leaves(trainer.state)
        for leaf in jax.tree.leaves(jax.block_until_ready(trainer.state)):
            if not any(leaf is fresh for fresh in kept):
                leaf.delete()
        with explaining_mismatch(self._store, self.cfg):
            restored = self._store.restore_latest(target, newest=self._planned, meta_check=check_meta,
                                                  unread=complete.fields)
        if restored is None:
            self._store.close()
            raise UserError(
                f"run_dir={self.cfg.run_dir}: no checkpoint in {self.directory} could be read (they were "
                f"renamed {UNREADABLE_PREFIX}<step>); fix them, or start over with another run_dir"
            )
        trainer.state = complete.state(restored.state, trainer.state)
        self._store.start_warm_up(trainer.state)
        self.start = position_of(restored.step, restored.meta)
        self._unconfirmed = [restored.step]
        # Checkpoints written before the count was saved hold none: their runs start from 0.
        self.resumed_bad_steps_in_a_row = int(restored.meta.get("bad_steps_in_a_row", 0))
        self.log(self._resume_line(restored, complete.note))
        return self.start

    def _restore_target(self, state: Any) -> tuple[Any, _Completion]:
        """The abstract state to read the planned checkpoint into, and how to complete what was
        read: checkpoints saved before the train state had loss statistics lack them, and the
        gradient compression's error feedback fits only the same compression over as many batch
        shards (else both start fresh)."""
        target = abstract_state(state)
        saved = self._store.saved_shapes(self._planned)
        fields, notes = [], []
        if state.loss_stats is not None and not any(name.startswith("loss_stats.") for name in saved):
            fields.append("loss_stats")
            notes.append("the loss statistics of the loss-spike guard start fresh (the checkpoint has none)")
        saved_compression = {name: shape[0] for name, shape in saved.items() if name.startswith("compression.")}
        wanted = {name: shape[0] for name, shape in leaf_shapes(target).items() if name.startswith("compression.")}
        if saved_compression != wanted:
            fields.append("compression")
            if wanted:
                notes.append("the gradient compression's error feedback starts fresh (the checkpoint holds none for "
                             "this compression and batch shard count)")
        for field in fields:
            target = target.replace(**{field: None})
        return target, _Completion(tuple(fields), "; ".join(notes) or None)

    def _resume_line(self, restored: Restored, note: str | None) -> str:
        meta = restored.meta
        saved_on = " x ".join(f"{axis}={size}" for axis, size in meta["mesh"].items() if axis != "expert" or size > 1)
        line = (f"resuming from step {restored.step} (checkpoint {restored.path}, saved on mesh {saved_on} "
                f"by {meta['process_count']} process(es))")
        changes = changed_keys(meta["config"], self.cfg.model_dump(mode="json"))
        line += f"; config changed: {', '.join(changes)}" if changes else ""
        if meta["config"].get("data", {}).get("workers") != self.cfg.data.workers:
            # data.workers: auto resolves per host; a resume elsewhere may resolve another count.
            line += "; data.workers only spreads the reading over processes: the batches stay the same"
        saved_steps = meta["config"]["train"]["steps"]
        if saved_steps != self.cfg.train.steps and self.cfg.optim.schedule != "constant":
            # The schedule is a function of train.steps: resumed, it is the new length's at this step.
            line += (f"; optim.schedule={self.cfg.optim.schedule} now decays over train.steps="
                     f"{self.cfg.train.steps}, not {saved_steps}, so the learning rate changes where the run resumes")
        return line + (f"; {note}" if note else "")

    def warm_up(self, state: Any) -> None:
        """Compiles what a save runs on the devices, so that the first save costs no more than the others."""
        if self.enabled:
            _all_finite(state.params, NamedSharding(self._mesh, PartitionSpec())).block_until_ready()
            self._store.warm_up(state)

    def position(self, step: int) -> DataPosition:
        """The data position after `step` steps (global examples consumed so far)."""
        return self.start.advanced(step - self.start.step, self.cfg.train.global_batch)

    def save(self, step: int, state: Any, bad_steps_in_a_row: int = 0) -> None:
        """Starts writing `step`; raises `NonFiniteError` instead if the parameters are not finite.

        The step's own check reads only the loss and gradient norm: from finite gradients an
        update can still overflow (a learning rate far too large), and that must never be saved.
        `bad_steps_in_a_row`: the non-finite steps that end at this one (saved in its meta).
        """
        if not bool(_all_finite(state.params, NamedSharding(self._mesh, PartitionSpec()))):
            raise NonFiniteError(
                f"step {step}: the parameters are not finite, though no step's loss or gradients were (an "
                f"update overflowed: is optim.lr too large?)")
        self._finish_write()
        self._store.save(step, state, run_meta(self.cfg, self._mesh, self.position(step), bad_steps_in_a_row))
        self._unconfirmed.append(step)

    def due(self, step: int) -> bool:
        """Whether `after_step` saves `step` (every `checkpoint.every` steps, and the last)."""
        return self.enabled and (step % self.cfg.checkpoint.every == 0 or step == self.cfg.train.steps)

    def after_step(self, step: int, state: Any, bad_steps_in_a_row: int = 0) -> None:
        """Starts an async save if `step` is due."""
        if self.due(step):
            self.save(step, state, bad_steps_in_a_row)

    def poll(self) -> None:
        """Says which save completed since the last call, and which old checkpoint rotation could not
        delete (once each); raises if a save failed (a full disk)."""
        if self._store is not None and (step := self._store.poll()) is not None:
            self._saved(step)
        self._warn_undeletable()

    def _warn_undeletable(self) -> None:
        for step, why in sorted(self.undeletable.items()):
            if step not in self._said_undeletable:
                self._said_undeletable.add(step)
                warn(f"could not delete old checkpoint {self._store.path(step)} ({why}); it is kept, and deleting it "
                     f"is tried again at the next save")

    @property
    def undeletable(self) -> dict[int, str]:
        """The old checkpoints rotation could not delete (step: why), as of the last rotation done."""
        return {} if self._store is None else dict(self._store.undeletable)

    def _finish_write(self) -> None:
        """Waits for the write in progress (at most `checkpoint.write_timeout`) and says it is done."""
        if self._store is not None and (step := self._store.writing) is not None:
            self._store.wait_for_write()
            self._saved(step)

    def _saved(self, step: int) -> None:
        self.log(f"saved checkpoint step {step} in {self._store.path(step)}")

    def confirm(self, step: int | None) -> None:
        """Step `step` was judged sane (None: none yet): the checkpoints before it are confirmed,
        and rotated (with several processes, once no write is in progress: see `Checkpoints.prune`)."""
        confirmed = [saved for saved in self._unconfirmed if step is not None and saved < step]
        if confirmed:
            self._unconfirmed = [saved for saved in self._unconfirmed if saved >= step]
            self._prune_through = confirmed[-1]
        if self._prune_through is not None and (jax.process_count() == 1 or self._store.writing is None):
            self._store.prune(self.cfg.checkpoint.keep, self.cfg.checkpoint.keep_every, through=self._prune_through)
            self._prune_through = None

    def diverged(self, first_bad_step: int | None) -> str:
        """Sets aside the checkpoints of a diverging run (from the step before `first_bad_step` on:
        their next steps were bad) and says which checkpoint is the last sane one."""
        if self._store is None:
            return "there is no checkpoint"
        self._finish_write()
        moved = []
        if first_bad_step is not None:
            for step in self._store.steps():
                if step >= first_bad_step - 1:
                    moved.append(self._store.set_aside(step, reason=f"step {first_bad_step} after it was bad",
                                                       prefix=DIVERGED_PREFIX))
        last = self._store.last_saved
        kept = "there is no sane checkpoint" if last is None else f"the last sane checkpoint, step {last}, is intact"
        if moved:
            names = ", ".join(path.name for path in moved)
            kept = (f"{kept}; the checkpoints of the diverging steps were moved to {names} in {self.directory} "
                    f"(rename one back to resume from it)")
        return kept

    @property
    def last_saved(self) -> int | None:
        """The newest complete checkpoint's step (saved by this run or before it), None without one."""
        return None if self._store is None else self._store.last_saved

    def stop(self, step: int, state: Any, reason: str, bad_steps_in_a_row: int = 0) -> None:
        """Saves `step` (unless saving is off), waits for the write, and says how to resume."""
        if not self.enabled:
            self.log(f"stopped by {reason} after step {step}; nothing saved (checkpoint.every=0), "
                     f"so a rerun starts from scratch")
            return
        self.save(step, state, bad_steps_in_a_row)
        self._finish_write()
        self.log(f"stopped by {reason} after step {step}; checkpoint saved in {self._store.path(step)}; "
                 f"run the same `jaxdist train` command (run_dir={self.cfg.run_dir}) to resume from step {step}")

    @contextlib.contextmanager
    def saving_on_error(self, trainer, bad_steps_in_a_row: Callable[[], int]) -> Iterator[None]:
        """On an exception: save the state if it is intact (not donated to a failed step), then re-raise.

        Only with one process: after an error on some processes, a collective save could hang.
        """
        try:
            yield
        except (CheckpointWriteError, NonFiniteError):
            raise  # saving again would fail the same way, or save what must not be saved
        except Exception:
            if self.enabled and jax.process_count() == 1:
                self._save_last_good(trainer.state, bad_steps_in_a_row())
            raise

    def _save_last_good(self, state: Any, bad_steps_in_a_row: int) -> None:
        if not is_intact(state):
            self.log(f"the train state was lost in the failed step; last checkpoint: step {self._store.last_saved}")
            return
        step = int(jax.device_get(state.step))
        try:
            self._finish_write()
            if step == self._store.last_saved:
                self.log(f"error after step {step}, whose checkpoint is saved in {self._store.path(step)}")
                return
            self.save(step, state, bad_steps_in_a_row)
            self._store.wait_for_write()
        except Exception as err:  # noqa: BLE001  (the original error is the one to raise)
            warn(f"could not save the last good state at step {step}: {first_line(err)}")
            return
        self.log(f"error after step {step}: saved the last good state in {self._store.path(step)}")

    def close(self, wait: bool = True) -> None:
        """Waits for pending writes (`wait` False: leaves them, after an interrupt)."""
        if self._store is None:
            return
        if wait:
            self._finish_write()
            self.confirm(None)  # a rotation that waited for the write
        self._store.close(wait)
        if wait:
            self._warn_undeletable()


class _Completion:
    """What a restore does not read from the checkpoint (fields of the train state), started fresh
    from the new state."""

    def __init__(self, fields: tuple[str, ...] = (), note: str | None = None):
        self.fields, self.note = fields, note

    def fresh_leaves(self, state: Any) -> list[Any]:
        return [leaf for field in self.fields for leaf in jax.tree.leaves(getattr(state, field))]

    def state(self, restored: Any, fresh: Any) -> Any:
        return restored.replace(**{field: getattr(fresh, field) for field in self.fields})


@functools.partial(jax.jit, static_argnums=1)
def _all_finite(params: Any, replicated: NamedSharding) -> jax.Array:
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)
                                if jnp.issubdtype(leaf.dtype, jnp.inexact)] or [jnp.bool_(True)]))
    return jax.lax.with_sharding_constraint(finite, replicated)  # every process reads the answer
