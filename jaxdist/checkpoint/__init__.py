"""Checkpoints: the Orbax store and its saves (`store`), reading one back (`restore`), where a run
resumes from (`resume`), the training run's checkpoint policy (`policy`), one run per run directory
and no earlier run's files overwritten (`run_dir_guard`), and export (`export`).

See docs/checkpoints.md for what a checkpoint holds and how resuming and falling back behave.
"""

from jaxdist.checkpoint.export import export_params
from jaxdist.checkpoint.integrity import DamagedCheckpoint, array_digests, is_damage
from jaxdist.checkpoint.resume import DataPosition, ResumePlan, changed_keys, plan_resume
from jaxdist.checkpoint.policy import RunCheckpoints, library_versions, run_meta
from jaxdist.checkpoint.names import leaf_shapes, named_arrays
from jaxdist.checkpoint.restore import CheckpointMismatch, Restored, abstract_state, first_mismatch
from jaxdist.checkpoint.store import UNREADABLE_PREFIX, Checkpoints, is_intact

__all__ = [
    "UNREADABLE_PREFIX",
    "CheckpointMismatch",
    "Checkpoints",
    "DamagedCheckpoint",
    "DataPosition",
    "Restored",
    "ResumePlan",
    "RunCheckpoints",
    "abstract_state",
    "array_digests",
    "changed_keys",
    "export_params",
    "first_mismatch",
    "is_damage",
    "is_intact",
    "leaf_shapes",
    "library_versions",
    "named_arrays",
    "plan_resume",
    "run_meta",
]
