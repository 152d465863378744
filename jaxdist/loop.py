"""The training loop behind `jaxdist train`: check, build, compile, step, log, sample.

It sits in the command layer, above what it drives: the data pipeline, a `Trainer`, checkpoints and
metrics. Side effects (files, printing) live here and in the CLI; the step itself is pure.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxdist import kernels, models
from jaxdist.checkpoint import RunCheckpoints
from jaxdist.config import Config, TrainConfig
from jaxdist.data import loader
from jaxdist.data.tokenizer import Tokenizer
from jaxdist.errors import NonFiniteError, check_writable
from jaxdist.observe import console, wandb_log
from jaxdist.observe.metrics import MetricsWriter, device_metrics, drop_after, throughput
from jaxdist.observe.profile import StepProfiler
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.train.evaluate import Evaluator
from jaxdist.train.generate import sample
from jaxdist.train.preemption import StopSignals
from jaxdist.train.trainer import Trainer, state_bytes_per_device


def log(message: str) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def train(cfg: Config, devices: list | None = None) -> Trainer:
    """Runs `cfg.train.steps` steps, writing `config.yaml`, `metrics.jsonl` and `checkpoints/` into
    `cfg.run_dir`; resumes from the newest good checkpoint there. A SIGTERM/SIGINT saves and
    returns early (no sample). A non-finite step raises `NonFiniteError` as `train.on_nonfinite`
    says (`NonFiniteGuard`), with nothing saved from that step on."""
    # Opening the data and reading a first batch report bad data before anything compiles; so
    # does a checkpoint of another model in run_dir.
    wandb_log.check_installed(cfg)
    cfg = loader.resolve_workers(loader.resolve_model(cfg))  # resolved, so config.yaml and checkpoints hold them
    entry = models.get(cfg.model.name)
    keys = entry.batch_keys
    train_source = loader.open_split(cfg, "train", keys)
    eval_source = loader.open_split(cfg, "eval", keys) if cfg.eval.every else None
    # Read now, so a missing or corrupt tokenizer file stops the run before it trains, not after.
    tokenizer = loader.tokenizer(cfg) if cfg.sample.tokens and entry.samples_text else None
    layout = layout_lib.from_config(cfg, devices, entry.activations)
    rows = layout.process_rows(cfg.train.global_batch)
    # Every process indexes one global stream, so all must hold the same data: the replica check
    # below compares only rows that several processes hold, and most layouts have none.
    splits = {"the train split": train_source, "the eval split": eval_source}
    feed.check_sources_agree({name: loader.fingerprint(source) for name, source in splits.items() if source is not None})
    checkpoints = RunCheckpoints(cfg, log)
    planned = checkpoints.prepare()
    # data.epochs ends the run where a resumed one counts the examples left from its checkpoint.
    cfg = checkpoints.cfg = loader.resolve_steps(cfg, len(train_source), planned.step, planned.example)
    run_dir = Path(cfg.run_dir)
    # Every process checks: each writes its checkpoint shards there.
    check_writable(run_dir, f"run_dir={run_dir}", directory=True)
    batches = loader.train_iterator(cfg, rows, start_example=planned.example, source=train_source)
    first_local = next(batches)
    feed.check_replicas_agree(first_local, layout.batch_sharding, rows)
    if built := kernels.build_for(cfg.model, cfg.impl):  # the model only loads them while it is traced
        log(built)
    trainer = Trainer.from_config(cfg, layout=layout)
    is_writer = jax.process_index() == 0
    reads = "" if jax.process_count() == 1 else (
        f"; process 0 feeds rows {_ranges(rows.rows)} of each global batch of {rows.global_batch}")
    log(f"mesh {mesh_lib.describe(trainer.mesh)} on {len(trainer.mesh.devices.flat)} devices "
        f"({jax.process_count()} process(es)); rules preset {cfg.rules.preset}{reads}")
    log(loader.describe(cfg))
    log(console.banner(
        processes=jax.process_count(), devices=trainer.mesh.devices.size,
        platform=trainer.mesh.devices.flat[0].platform, params=sum(p.size for p in jax.tree.leaves(trainer.params)),
        global_batch=cfg.train.global_batch, device_batch=cfg.train.global_batch // layout.batch_shards,
        param_bytes=max(state_bytes_per_device(trainer.params).values()),
    ))
    start = checkpoints.resume(trainer)
    if is_writer:  # once the checkpoint has taken this config: a refused resume leaves the old file
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    if start != planned:  # the planned checkpoint failed to read: an older one was restored
        batches = loader.train_iterator(cfg, rows, start_example=start.example, source=train_source)
        first_local = next(batches)
    if is_writer:  # steps after the restored one (all, without a checkpoint) run again
        drop_after(run_dir, start.step)
    if start.step >= cfg.train.steps:
        log(f"nothing to train: step {start.step} reached train.steps={cfg.train.steps}; raise train.steps "
            f"to go on, or use another run_dir")
        checkpoints.close()
        return trainer

    evaluate = None if eval_source is None else Evaluator(
        trainer, entry.eval_sums, lambda: loader.eval_iterator(cfg, rows, eval_source)
    )
    flops = entry.flops_per_example(cfg)

    wandb = wandb_log.WandbRun(cfg, run_dir) if is_writer and cfg.log.wandb else None
    writer = MetricsWriter(run_dir if is_writer else None, wandb)
    first = trainer.global_batch(first_local)
    trainer.compile(first)
    # Only the XLA compile is saved by the persistent compilation cache; tracing is paid each start.
    compile_times = {"trace_s": trainer.trace_time_s, "compile_s": trainer.compile_time_s}
    log(f"compiled the train step: trace {trainer.trace_time_s:.1f} s, XLA compile {trainer.compile_time_s:.1f} s")

    batch, last_time, last_step, data_wait = first, time.perf_counter(), start.step, 0.0
    began = last_time
    progress = console.StepProgress(start.step, cfg.train.steps, show=is_writer)
    guard = NonFiniteGuard(cfg.train, lambda: checkpoints.last_saved, checkpoints.resumed_bad_steps_in_a_row)
    checkpoints.bad_steps_in_a_row = lambda: guard.in_a_row
    # The handlers stay through the last checkpoint's write: a signal then is recorded, not fatal.
    with StopSignals() as stop:
        try:
            # guard.halting() is innermost: a halt must not reach the save after an error.
            with (checkpoints.saving_on_error(trainer), StepProfiler(cfg.profile, run_dir) as profiler,
                  guard.halting()):
                for step in range(start.step + 1, cfg.train.steps + 1):
                    profiler.before(step)
                    metrics = trainer.step(batch)
                    profiler.after(step, metrics)
                    guard.record(step, metrics)
                    progress.step(step)
                    if step < cfg.train.steps:
                        asked = time.perf_counter()
                        local = next(batches)
                        data_wait += time.perf_counter() - asked
                        batch = trainer.global_batch(local)
                    eval_due = evaluate is not None and (step % cfg.eval.every == 0 or step == cfg.train.steps)
                    first_of_run = step == start.step + 1  # shows where the loss starts
                    if first_of_run or step % cfg.log.every == 0 or step == cfg.train.steps or eval_due:
                        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                        step_time = (time.perf_counter() - last_time) / (step - last_step)
                        values["param_norm"] = float(trainer.param_norm())  # after the timing: its first call compiles
                        examples_per_sec = cfg.train.global_batch / step_time
                        values.update(step_time_s=step_time,
                                      **throughput(examples_per_sec, cfg.model.tokens_per_example),
                                      data_wait_s=data_wait / (step - last_step),
                                      **device_metrics(flops, examples_per_sec, trainer.mesh))
                        if eval_due:
                            values.update(evaluate())
                        if first_of_run:
                            values.update(compile_times)
                        writer.write(step, values)
                        progress.logged(step, values)
                        last_time, last_step, data_wait = time.perf_counter(), step, 0.0
                    if checkpoints.due(step):
                        guard.check()
                    checkpoints.after_step(step, trainer.state)
                    if reason := stop.requested(step):
                        guard.check()
                        checkpoints.stop(step, trainer.state, reason)
                        return trainer
                guard.check()
        finally:
            progress.close()
            writer.close()
            checkpoints.close()  # finishes the saves of finite steps
    guard.raise_if_halted()
    saved = checkpoints.last_saved
    log(progress.summary(time.perf_counter() - began, "no checkpoint saved" if saved is None else
                         f"last checkpoint: step {saved} in {checkpoints.directory}"))

    if tokenizer is not None:
        write_sample(cfg, trainer, layout.batch_shards, tokenizer)
    return trainer


class NonFiniteGuard:
    """Stops the run at a bad step (`precision.verdict`): at once under `train.on_nonfinite=halt`,
    after more than `train.max_consecutive_skips` in a row under skip.

    `record` reads each step's `nonfinite` flag one step late, after the next step is dispatched,
    so the host does not wait for the step it just queued; call `check` before saving a step, which
    reads the newest flag at once. The step never applies a bad update, but the state after it is
    not saved either: its step count would claim training the data did not.
    """

    def __init__(self, cfg: TrainConfig, last_saved: Callable[[], int | None], in_a_row: int = 0):
        self._cfg = cfg
        self._last_saved = last_saved
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._in_a_row = in_a_row  # a resumed run's count goes on from its checkpoint's
        self.halted: NonFiniteError | None = None

    @property
    def in_a_row(self) -> int:
        """Bad steps in a row up to the newest checked step (what a checkpoint of it saves)."""
        return self._in_a_row

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Checks the step before this one, then holds on to this one's metrics."""
        self.check()
        self._pending = (step, metrics)

    def check(self) -> None:
        """Reads the newest recorded step's flag; raises `NonFiniteError` when the run must stop."""
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        if not int(metrics["nonfinite"]):
            self._in_a_row = 0
            return
        self._in_a_row += 1
        limit = self._cfg.max_consecutive_skips
        if self._cfg.on_nonfinite == "skip" and self._in_a_row <= limit:
            return
        why = "" if self._cfg.on_nonfinite == "halt" else (
            f" ({self._in_a_row} bad steps in a row, more than train.max_consecutive_skips={limit})")
        last = self._last_saved()
        kept = "there is no checkpoint" if last is None else f"the last checkpoint, step {last}, is intact"
        raise NonFiniteError(f"step {step}: {_what_is_not_finite(metrics)}{why}; stopped without saving it; {kept}")

    @contextlib.contextmanager
    def halting(self) -> Iterator[None]:
        """Leaves the block on a halt and keeps the error for `raise_if_halted`. Another error (a
        corrupt batch, say) first checks the step not yet checked: if it was bad, the run halts
        for it instead, so the save after an error never writes a state the guard would refuse."""
        try:
            yield
        except NonFiniteError as err:
            self.halted = err
        except Exception:
            try:
                self.check()
            except NonFiniteError as err:
                self.halted = err
                return
            raise

    def raise_if_halted(self) -> None:
        if self.halted is not None:
            raise self.halted


def _what_is_not_finite(metrics: dict[str, Any]) -> str:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(values["loss"]):
        return f"the loss is {values['loss']}"
    at_scale = f" at loss scale {values['loss_scale']:g}" if "loss_scale" in values else ""
    return f"the gradient norm is {values['grad_norm']}{at_scale} (loss {values['loss']:.4g})"


def _ranges(rows: tuple[int, ...]) -> str:
    """Row indices as compact ranges: (0, 1, 2, 5) -> '0-2, 5'."""
    parts, start = [], rows[0]
    for previous, row in zip(rows, rows[1:] + (None,)):
        if row != previous + 1:
            parts.append(f"{start}-{previous}" if previous > start else str(start))
            start = row
    return ", ".join(parts)


def write_sample(cfg: Config, trainer: Trainer, rows: int, tokenizer: Tokenizer) -> None:
    """Prints a continuation of `sample.prompt` in `tokenizer`'s tokens; `rows` continuations are
    drawn, one per batch shard."""
    tokens = sample(
        trainer.graphdef, trainer.params, tokenizer.encode(cfg.sample.prompt), cfg.sample.tokens,
        cfg.model.seq_len, cfg.sample.temperature, cfg.seed, trainer.mesh, trainer.rules, rows=rows,
    )
    text = tokenizer.decode(np.asarray(tokens[0]))
    log("--- sample ---\n" + text + "\n--------------")
