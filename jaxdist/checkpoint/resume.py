"""Where a run resumes from: the checkpoint a start restores, chosen before anything is built.

`plan_resume` reads the run directory's checkpoints (metadata and abstract shapes only: it creates
nothing and compiles nothing), sets aside those whose metadata is damaged, and checks that the
chosen one's parameters fit the model: a checkpoint of another model is an error naming the
config keys that changed. `checkpoint.resume_step` picks an older checkpoint than the newest; the
newer ones are moved aside when the run resumes (`RunCheckpoints.resume`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic

from jaxdist.checkpoint.integrity import DamagedCheckpoint, is_damage
from jaxdist.checkpoint.restore import CheckpointMismatch
from jaxdist.checkpoint.store import Checkpoints, set_aside_summary
from jaxdist.config import Config
from jaxdist.errors import UserError, warn


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where training stands: `step` optimizer steps done, having consumed the first `example`
    examples of the global data stream (see jaxdist.data.stream); the same under any process count."""

    step: int = 0
    example: int = 0

    def advanced(self, steps: int, global_batch: int) -> DataPosition:
        """The position `steps` more steps of `global_batch` examples on."""
        return dataclasses.replace(self, step=self.step + steps, example=self.example + steps * global_batch)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a start restores (`step` None: none, a fresh start) and where it stands, with
    the checkpoints newer than it that a resume from an older step moves aside."""

    position: DataPosition = DataPosition()
    step: int | None = None
    superseded: tuple[int, ...] = ()


def plan_resume(cfg: Config, params: Any, log: Callable[[str], None]) -> ResumePlan:
    """Picks the checkpoint to resume from in `cfg.run_dir` (`checkpoint.resume_step`, else the newest
    whose metadata reads back) and checks that its params fit `params` (the model's abstract
    parameters)."""
    directory = Path(cfg.run_dir) / "checkpoints"
    if directory.exists() and not directory.is_dir():
        raise UserError(f"run_dir={cfg.run_dir}: {directory} is a file, where the checkpoints go; "
                        f"move it away or use another run_dir")
    wanted = cfg.checkpoint.resume_step
    if not directory.is_dir():
        if wanted is not None:
            raise UserError(f"checkpoint.resume_step={wanted}: {directory} holds no checkpoints; drop "
                            f"checkpoint.resume_step to start from scratch")
        return ResumePlan()
    if note := set_aside_summary(directory):
        warn(note)
    with Checkpoints(directory, create=False) as store:
        for step in reversed(_candidates(store, wanted, log)):
            try:
                saved, meta = store.read_metadata(step, meta_check=check_meta)
            except Exception as err:
                if not is_damage(err):
                    raise
                store.set_aside(step, err)
                continue
            if any(name.startswith("params.") for name in saved):
                with explaining_mismatch(store, cfg):
                    store.check_fits(step, params, part="params")
            newer = tuple(later for later in store.steps() if later > step) if wanted is not None else ()
            return ResumePlan(position_of(step, meta), step, newer)
    if wanted is not None:
        raise UserError(f"checkpoint.resume_step={wanted}: that checkpoint is unreadable (set aside); pick "
                        f"another step, or drop checkpoint.resume_step")
    return ResumePlan()


def _candidates(store: Checkpoints, wanted: int | None, log: Callable[[str], None]) -> list[int]:
    """The steps to try, oldest first: all, or just `wanted`, unless a run that resumed from
    `wanted` has saved newer ones since (a requeued command goes on from those)."""
    steps = store.steps()
    if wanted is None:
        return steps
    if steps and steps[-1] > wanted and _resumed_from(store, steps[-1]) == wanted:
        log(f"checkpoint.resume_step={wanted} was taken by an earlier start: going on from its newest "
            f"checkpoint, step {steps[-1]}")
        return steps
    if wanted not in steps:
        listed = ", ".join(map(str, steps)) or "none"
        raise UserError(f"checkpoint.resume_step={wanted}: there is no checkpoint of step {wanted} in "
                        f"{store.directory} (complete checkpoints: {listed}); pick one of those")
    return [wanted]


@contextlib.contextmanager
def explaining_mismatch(store: Checkpoints, cfg: Config) -> Iterator[None]:
    """Adds to a `CheckpointMismatch` the config keys that changed since the checkpoint was saved."""
    try:
        yield
    except CheckpointMismatch as err:
        changes = changed_keys(store.meta(err.step)["config"], cfg.model_dump(mode="json"))
        hint = f"config changed since: {', '.join(changes)}" if changes else "same config"
        raise CheckpointMismatch(
            f"{err} ({hint}); resume with the config it was saved with, or use another run_dir", err.step
        ) from None


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


class _SavedData(pydantic.BaseModel):
    example: int


class _SavedTrain(pydantic.BaseModel):
    steps: int


class _SavedConfig(pydantic.BaseModel):
    train: _SavedTrain
    data: dict[str, Any] = {}  # its `workers`, compared with the new config's


class _SavedMeta(pydantic.BaseModel):
    """What resuming reads of a checkpoint's meta (see `run_meta`; other keys are not read)."""

    data: _SavedData
    config: _SavedConfig
    mesh: dict[str, int]
    process_count: int
    bad_steps_in_a_row: int = 0  # absent from checkpoints saved before it was counted


def check_meta(meta: dict[str, Any]) -> None:
    """Raises `DamagedCheckpoint` if a checkpoint's meta lacks what resuming reads from it: its
    file decodes as JSON, but it is not what `run_meta` wrote."""
    try:
        _SavedMeta.model_validate(meta)
    except pydantic.ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(map(str, problem["loc"]))
        raise DamagedCheckpoint(f"its meta is malformed ({where}: {problem['msg']})") from None


def _resumed_from(store: Checkpoints, step: int) -> int | None:
    """The `checkpoint.resume_step` of the run that saved checkpoint `step` (None: none, or its meta is damaged)."""
    try:
        meta = store.meta(step)
    except Exception as err:
        if not is_damage(err):
            raise
        return None
    config = meta.get("config") if isinstance(meta, dict) else None
    return ((config or {}).get("checkpoint") or {}).get("resume_step")


def position_of(step: int, meta: dict[str, Any]) -> DataPosition:
    """The data position a checkpoint's meta records."""
    return DataPosition(step=step, example=int(meta["data"]["example"]))
