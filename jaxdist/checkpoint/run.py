"""The training run's checkpoint policy: what to resume from, when to save, and the run's meta.

`RunCheckpoints` drives the store (`jaxdist.checkpoint.store`) for `jaxdist train`: it resumes from
the newest checkpoint that reads back and holds this model, saves on schedule, at a preemption and
after an error, and records the data position, so a resumed run reads on where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from jaxdist import models
from jaxdist.checkpoint.integrity import is_damage
from jaxdist.checkpoint.store import (
    UNREADABLE_PREFIX,
    CheckpointMismatch,
    Checkpoints,
    CheckpointWriteError,
    Restored,
    abstract_state,
    first_line,
    is_intact,
    set_aside_summary,
)
from jaxdist.config import Config
from jaxdist.errors import NonFiniteError, UserError, warn
from jaxdist.train.state import abstract_model

_VERSIONED_PACKAGES = ("jaxdist", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain")


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where training stands: `step` optimizer steps done, having consumed the first `example`
    examples of the global data stream (see jaxdist.data.pipeline); the same under any process count."""

    step: int = 0
    example: int = 0

    def advanced(self, steps: int, global_batch: int) -> DataPosition:
        """The position `steps` more steps of `global_batch` examples on."""
        return dataclasses.replace(self, step=self.step + steps, example=self.example + steps * global_batch)


def changed_keys(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts, as `key=saved->current`."""
    changes = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += changed_keys(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key}={old}->{new}")
    return changes


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

    `prepare` (before building anything) picks the checkpoint to resume from and checks it holds
    this model; `resume` restores it into the trainer's shardings. Saves: every `checkpoint.every`
    steps and at the last step, at a preemption, and (one process) after an error if the state is
    intact. `checkpoint.every=0` turns saving off; existing checkpoints are still resumed from.
    """

    def __init__(self, cfg: Config, log: Callable[[str], None]):
        self.cfg = cfg
        self.log = log
        self.enabled = cfg.checkpoint.every > 0
        self.directory = Path(cfg.run_dir) / "checkpoints"
        self.start = DataPosition()
        # The guard's count of bad steps in a row: read at each save, restored by `resume`.
        self.bad_steps_in_a_row: Callable[[], int] = lambda: 0
        self.resumed_bad_steps_in_a_row = 0
        self._planned: int | None = None
        self._store: Checkpoints | None = None
        self._mesh: Mesh | None = None

    def prepare(self) -> DataPosition:
        """Picks the newest checkpoint whose metadata reads back and checks that its params fit
        this model. Reads metadata and abstract shapes only: creates nothing, compiles nothing.
        Returns its data position (step 0 without checkpoints)."""
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"run_dir={self.cfg.run_dir}: {self.directory} is a file, where the checkpoints go; "
                            f"move it away or use another run_dir")
        if not self.directory.is_dir():
            return self.start
        if note := set_aside_summary(self.directory):
            warn(note)
        with Checkpoints(self.directory, create=False) as store:
            for step in reversed(store.steps()):
                try:
                    saved, meta = store.saved_shapes(step), store.meta(step)
                except Exception as err:
                    if not is_damage(err):
                        raise
                    store.set_aside(step, err)
                    continue
                if any(name.startswith("params.") for name in saved):
                    params = abstract_model(models.get(self.cfg.model.name).create(self.cfg), self.cfg.seed).params
                    with self._explaining_mismatch(store):
                        store.check_fits(step, params, part="params")
                self._planned = step
                return _position(step, meta)
        return self.start

    def resume(self, trainer) -> DataPosition:
        """Restores the prepared checkpoint (or, if its arrays fail to read, the newest one before
        it that reads) into `trainer.state`, in the trainer's shardings. Returns the position to
        continue from (step 0 when there is no checkpoint)."""
        self._mesh = trainer.mesh
        if self._planned is None and not self.enabled:
            return self.start  # nothing to read and nothing to write: no checkpoints/ is made
        self._store = Checkpoints(self.directory, self.cfg.checkpoint.keep)
        if self._planned is None:
            return self.start
        target = abstract_state(trainer.state)
        # Free the freshly initialized state first (once its init has run), so the state is never
        # held twice.
        for leaf in jax.tree.leaves(jax.block_until_ready(trainer.state)):
            leaf.delete()
        with self._explaining_mismatch(self._store):
            restored = self._store.restore_latest(target, newest=self._planned)
        if restored is None:
            self._store.close()
            raise UserError(
                f"run_dir={self.cfg.run_dir}: no checkpoint in {self.directory} could be read (they were "
                f"renamed {UNREADABLE_PREFIX}<step>); fix them, or start over with another run_dir"
            )
        trainer.state = restored.state
        self.start = _position(restored.step, restored.meta)
        # Checkpoints written before the count was saved hold none: their runs start from 0.
        self.resumed_bad_steps_in_a_row = int(restored.meta.get("bad_steps_in_a_row", 0))
        self.log(self._resume_line(restored))
        return self.start

    @contextlib.contextmanager
    def _explaining_mismatch(self, store: Checkpoints) -> Iterator[None]:
        """Adds to a `CheckpointMismatch` the config keys that changed since the checkpoint was saved."""
        try:
            yield
        except CheckpointMismatch as err:
            changes = changed_keys(store.meta(err.step)["config"], self.cfg.model_dump(mode="json"))
            hint = f"config changed since: {', '.join(changes)}" if changes else "same config"
            raise CheckpointMismatch(
                f"{err} ({hint}); resume with the config it was saved with, or use another run_dir", err.step
            ) from None

    def _resume_line(self, restored: Restored) -> str:
        meta = restored.meta
        saved_on = " x ".join(f"{axis}={size}" for axis, size in meta["mesh"].items())
        line = (f"resuming from step {restored.step} (checkpoint {restored.path}, saved on mesh {saved_on} "
                f"by {meta['process_count']} process(es))")
        changes = changed_keys(meta["config"], self.cfg.model_dump(mode="json"))
        line += f"; config changed: {', '.join(changes)}" if changes else ""
        saved_steps = meta["config"]["train"]["steps"]
        if saved_steps != self.cfg.train.steps and self.cfg.optim.schedule != "constant":
            # The schedule is a function of train.steps: resumed, it is the new length's at this step.
            line += (f"; optim.schedule={self.cfg.optim.schedule} now decays over train.steps="
                     f"{self.cfg.train.steps}, not {saved_steps}, so the learning rate changes where the run resumes")
        return line

    def position(self, step: int) -> DataPosition:
        """The data position after `step` steps (global examples consumed so far)."""
        return self.start.advanced(step - self.start.step, self.cfg.train.global_batch)

    def save(self, step: int, state: Any) -> None:
        """Starts writing `step`; raises `NonFiniteError` instead if the parameters are not finite.

        The step's own check reads only the loss and gradient norm: from finite gradients an
        update can still overflow (a learning rate far too large), and that must never be saved.
        """
        if not bool(_all_finite(state.params, NamedSharding(self._mesh, PartitionSpec()))):
            last = self._store.last_saved
            kept = "there is no checkpoint" if last is None else f"the last checkpoint, step {last}, is intact"
            raise NonFiniteError(
                f"step {step}: the parameters are not finite, though no step's loss or gradients were (an "
                f"update overflowed: is optim.lr too large?); stopped without saving it; {kept}")
        meta = run_meta(self.cfg, self._mesh, self.position(step), self.bad_steps_in_a_row())
        self._store.save(step, state, meta)

    def due(self, step: int) -> bool:
        """Whether `after_step` saves `step` (every `checkpoint.every` steps, and the last)."""
        return self.enabled and (step % self.cfg.checkpoint.every == 0 or step == self.cfg.train.steps)

    def after_step(self, step: int, state: Any) -> None:
        """Starts an async save if `step` is due."""
        if self.due(step):
            self.save(step, state)
            self.log(f"saved checkpoint step {step} in {self._store.path(step)}")

    @property
    def last_saved(self) -> int | None:
        """The newest checkpoint's step (saved by this run or before it), None without one."""
        return None if self._store is None else self._store.last_saved

    def stop(self, step: int, state: Any, reason: str) -> None:
        """Saves `step` (unless saving is off), waits for the write, and says how to resume."""
        if not self.enabled:
            self.log(f"stopped by {reason} after step {step}; nothing saved (checkpoint.every=0), "
                     f"so a rerun starts from scratch")
            return
        self.save(step, state)
        self._store.wait()
        self.log(f"stopped by {reason} after step {step}; checkpoint saved in {self._store.path(step)}; "
                 f"run the same `jaxdist train` command (run_dir={self.cfg.run_dir}) to resume from step {step}")

    @contextlib.contextmanager
    def saving_on_error(self, trainer) -> Iterator[None]:
        """On an exception: save the state if it is intact (not donated to a failed step), then re-raise.

        Only with one process: after an error on some processes, a collective save could hang.
        """
        try:
            yield
        except CheckpointWriteError:
            raise  # saving again would fail the same way
        except Exception:
            if self.enabled and jax.process_count() == 1:
                self._save_last_good(trainer.state)
            raise

    def _save_last_good(self, state: Any) -> None:
        if not is_intact(state):
            self.log(f"the train state was lost in the failed step; last checkpoint: step {self._store.last_saved}")
            return
        step = int(jax.device_get(state.step))
        if step == self._store.last_saved:
            self.log(f"error after step {step}, whose checkpoint is saved in {self._store.path(step)}")
            return
        try:
            self.save(step, state)
            self._store.wait()
        except Exception as err:  # noqa: BLE001  (the original error is the one to raise)
            warn(f"could not save the last good state at step {step}: {first_line(err)}")
            return
        self.log(f"error after step {step}: saved the last good state in {self._store.path(step)}")

    def close(self) -> None:
        """Waits for pending writes."""
        if self._store is not None:
            self._store.close()


@functools.partial(jax.jit, static_argnums=1)
def _all_finite(params: Any, replicated: NamedSharding) -> jax.Array:
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)
                                if jnp.issubdtype(leaf.dtype, jnp.inexact)] or [jnp.bool_(True)]))
    return jax.lax.with_sharding_constraint(finite, replicated)  # every process reads the answer


def _position(step: int, meta: dict[str, Any]) -> DataPosition:
    return DataPosition(step=step, example=int(meta["data"]["example"]))
