"""Weights & Biases for `log.wandb=true` (the `wandb` extra): the resolved config, and every logged
step's values under TensorBoard's tags (`train/loss`, `eval/loss`, ...). Only process 0 logs.

The run's files go to `run_dir/wandb`; `log.wandb_mode=offline` writes only there (`wandb sync`
uploads them later). The mode is passed to `wandb.init`, not through the environment. A run that
resumes in the same run_dir continues the same W&B run (its id is kept in `run_dir/wandb/run_id`);
steps it trains again after the restored checkpoint are not logged twice.
"""

from __future__ import annotations

import importlib.util
import secrets
from pathlib import Path

from jaxdist import atomic
from jaxdist.config import Config
from jaxdist.errors import UserError, warn
from jaxdist.observe.metrics import tensorboard_tag

RUN_ID = "run_id"


def check_installed(cfg: Config) -> None:
    """Raises a `UserError` where `log.wandb` is on and wandb cannot be imported."""
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("log.wandb=true needs Weights & Biases: pip install 'jaxdist[wandb]', or set log.wandb=false")


class WandbRun:
    """One W&B run for a run_dir: `log` each logged step, `close` at the end."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        files = run_dir / "wandb"
        files.mkdir(parents=True, exist_ok=True)
        id_file = files / RUN_ID
        if not id_file.is_file():
            atomic.write_text(id_file, secrets.token_hex(6))
        try:
            self._run = wandb.init(
                project=cfg.log.wandb_project, entity=cfg.log.wandb_entity,
                name=cfg.log.wandb_name or run_dir.resolve().name, dir=run_dir, id=id_file.read_text().strip(),
                resume="allow", config=cfg.model_dump(mode="json"),
                # console off: jaxdist's own output (progress bar, lines) stays as it is.
                settings=wandb.Settings(mode=cfg.log.wandb_mode, console="off"),
            )
        except wandb.errors.Error as err:  # not logged in, no network, an unknown entity
            raise UserError(f"log.wandb=true: Weights & Biases did not start: {_first_line(err)} Or set "
                            f"log.wandb_mode=offline to keep the run in run_dir/wandb only") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Logs one step's values; a W&B that fails is one warning, and is not asked again (the run
        goes on: metrics.jsonl and tb/ hold every step)."""
        if self._run is None or step < self._run.step:  # W&B keeps the first values of a step trained again
            return
        try:
            self._run.log({tensorboard_tag(key): value for key, value in metrics.items()}, step=step)
        except Exception as err:  # noqa: BLE001  (any failure of W&B's; the run's own files have the values)
            warn(f"log.wandb: Weights & Biases failed at step {step} ({_first_line(err)}); it gets no more of this "
                 f"run's steps, which metrics.jsonl and tb/ hold")
            self._run = None

    def close(self) -> None:
        """Finishes the W&B run; a failure there is one warning."""
        if self._run is None:
            return
        try:
            self._run.finish()
        except Exception as err:  # noqa: BLE001  (as in `log`)
            warn(f"log.wandb: Weights & Biases failed to finish the run ({_first_line(err)}); metrics.jsonl and tb/ "
                 f"hold every step")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
