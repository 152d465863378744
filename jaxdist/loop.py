"""The training loop that `jaxdist train` runs (commands/train.py): check, build, compile, step, log,
sample.

It sits in the layer of the commands, above what it drives: the data pipeline, a `Trainer`,
checkpoints and metrics. Side effects (files, printing) live here and in the commands; the step
itself is pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist import atomic, kernels, models, runtime
from jaxdist.checkpoint import ResumePlan, RunCheckpoints, hf_folder, plan_resume, run_dir_guard
from jaxdist.checkpoint.run_dir_guard import RunDirLock
from jaxdist.config import Config, TrainConfig
from jaxdist.data import loader
from jaxdist.data.tokenizer import Tokenizer
from jaxdist.errors import NonFiniteError, check_writable, warn
from jaxdist.models import dtypes
from jaxdist.observe import console, wandb_log
from jaxdist.observe.goodput import STARTUP, RunTime
from jaxdist.observe.metrics import MetricsWriter, device_metrics, drop_after, throughput
from jaxdist.observe.profile import StepProfiler
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.train.evaluate import Evaluator, MixtureEvaluator
from jaxdist.train.generate import Sampling, compute_dtype_params, sample
from jaxdist.train.preemption import StopSignals
from jaxdist.train.state import AbstractModel, abstract_model
from jaxdist.train.trainer import Trainer, state_bytes_per_device


# A loop that waits this share of each step for its next batch is input-bound (a warning says so).
INPUT_BOUND = 0.25


def log(message: str) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def train(cfg: Config, devices: list | None = None, restart: bool = False, started: float | None = None) -> Trainer:
    """Runs `cfg.train.steps` steps, writing `config.yaml`, `metrics.jsonl` and `checkpoints/` into
    `cfg.run_dir`; resumes from the newest good checkpoint there. A SIGTERM/SIGINT saves and
    returns early (no sample). A bad step raises `NonFiniteError` as `train.on_nonfinite` says
    (`NonFiniteGuard`), with nothing saved from that step on.

    The run holds `run_dir`'s lock throughout (`RunDirLock`). A fresh start where an earlier run
    left metrics or set-aside checkpoints is refused, unless `restart` moves them aside first.
    `started`: when the run began (a `time.perf_counter()` reading; default now), for its goodput.
    """
    clock = RunTime(started)
    clock.add("process", time.perf_counter() - clock.started)
    run = prepare(cfg, devices, clock)
    mesh = run.layout.mesh
    log(console.version_line(processes=jax.process_count(), devices=mesh.devices.size,
                             platform=mesh.devices.flat[0].platform))
    run_dir = Path(cfg.run_dir)
    # Every process checks: each writes its checkpoint shards there.
    check_writable(run_dir, f"run_dir={run_dir}", directory=True)
    with RunDirLock(run_dir):
        run = prepare_start(run, restart, clock)
        try:
            return _run(run, clock)
        finally:
            # A data worker's batch lives in shared memory that grain unlinks once nothing refers to
            # it, and JAX lets go of the host arrays it was given only at a garbage collection: without
            # one the last batches outlive the process ("leaked shared_memory objects" at exit).
            gc.collect()


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run is, decided once before anything is built: the config resolved against its data and
    its checkpoints, the model, the layout, the rows this process feeds, the data and where it resumes."""

    cfg: Config
    entry: models.ModelEntry
    abstract: AbstractModel
    layout: layout_lib.Layout
    rows: feed.BatchRows
    train_source: Any
    eval_source: Any
    tokenizer: Tokenizer | None
    resume: ResumePlan = ResumePlan()


def prepare(cfg: Config, devices: list | None = None, clock: RunTime | None = None) -> Run:
    """Resolves and checks `cfg` against its data and the devices, before anything is built, compiled
    or written: bad data and a layout the devices cannot carry stop here (`UserError`)."""
    clock = clock or RunTime()
    # Opening the data and reading a first batch report bad data before anything compiles.
    wandb_log.check_installed(cfg)
    with clock.part("data"):
        # Resolved, so config.yaml and checkpoints hold them.
        cfg = loader.resolve_workers(loader.resolve_model(hf_folder.resolve(cfg)))
        entry = models.get(cfg.model.name)
        train_source = loader.open_split(cfg, "train", entry.batch_keys)
        eval_source = None
        if cfg.eval.every:  # a mixture's sources are evaluated apart
            eval_source = (loader.mixture_splits(cfg, "eval") if cfg.data.mixture
                           else loader.open_split(cfg, "eval", entry.batch_keys))
        # Read now, so a missing or corrupt tokenizer file stops the run before it trains, not after.
        tokenizer = loader.tokenizer(cfg) if cfg.sample.tokens and entry.samples_text else None
    with clock.part("checks"):
        layout = layout_lib.from_config(cfg, devices, entry.activations)
        rows = layout.process_rows(cfg.train.global_batch)
        # Every process indexes one global stream, so all must hold the same data: the replica check
        # compares only rows that several processes hold, and most layouts have none.
        evals = eval_source if isinstance(eval_source, dict) else {"": eval_source}
        splits = {"the train split": train_source,
                  **{f"the eval split{' of ' + name if name else ''}": split for name, split in evals.items()}}
        feed.check_sources_agree({name: loader.fingerprint(source) for name, source in splits.items()
                                  if source is not None})
        abstract = abstract_model(entry.create(cfg), cfg.seed)
    return Run(cfg, entry, abstract, layout, rows, train_source, eval_source, tokenizer)


def prepare_start(run: Run, restart: bool = False, clock: RunTime | None = None) -> Run:
    """`run` with where it resumes from in its run directory, and its length resolved from there: a
    checkpoint of another model and a fresh start over an earlier run's history stop here
    (`UserError`); `restart` first moves an earlier run's files aside. Call it holding the run
    directory's lock (`RunDirLock`): it may set damaged checkpoints aside."""
    clock = clock or RunTime()
    cfg = run.cfg
    run_dir = Path(cfg.run_dir)
    with clock.part("checks"):
        if restart and jax.process_index() == 0 and (moved := run_dir_guard.set_history_aside(run_dir)):
            log(f"--restart: moved the earlier run's files to {moved}")
        if restart and jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxdist_restart")  # before anyone reads checkpoints/
        resume = plan_resume(cfg, run.abstract.params, log)
        if resume.step is None:
            run_dir_guard.check_history(run_dir)
    # data.epochs ends the run where a resumed one counts the examples left from its checkpoint.
    cfg = loader.resolve_steps(cfg, len(run.train_source), resume.position.step, resume.position.example, log)
    _warn_if_warmup_outlasts_the_run(cfg)
    return dataclasses.replace(run, cfg=cfg, resume=resume)


def _run(run: Run, clock: RunTime) -> Trainer:
    """Builds the run (its trainer, restored; its evaluator; what a save runs), compiles the step,
    runs the steps and closes with the summary and a sample."""
    cfg, layout, rows = run.cfg, run.layout, run.rows
    run_dir = Path(cfg.run_dir)
    checkpoints = RunCheckpoints(cfg, run.resume, log)
    planned = run.resume.position
    with clock.part("data"):
        batches = loader.train_iterator(cfg, rows, start_example=planned.example, source=run.train_source)
        first_local = next(batches)
    with clock.part("checks"):
        feed.check_replicas_agree(first_local, layout.batch_sharding, rows)
    with clock.part("kernels"):
        built = kernels.build_for(cfg.model)  # the model only loads them while it is traced
    if built:
        log(built)
    with clock.part("init"):
        params = model_state = None
        if getattr(cfg.model, "init_from", None) and run.resume.step is None:
            params = functools.partial(hf_folder.load_params, cfg, run.abstract.params)
            if run.abstract.state is not None:
                model_state = functools.partial(hf_folder.load_state, cfg, run.abstract.state)
            log(f"starting from the weights of {cfg.model.init_from}")
        trainer = Trainer.from_config(cfg, layout=layout, abstract=run.abstract, params=params, model_state=model_state)
    _log_setup(cfg, trainer, layout, rows)
    is_writer = jax.process_index() == 0
    with clock.part("restore"):
        start = checkpoints.resume(trainer)
    if is_writer:  # once the checkpoint has taken this config: a refused resume leaves the old file
        atomic.write_text(run_dir / "config.yaml", cfg.to_yaml())
    if start != planned:  # the planned checkpoint failed to read: an older one was restored
        with clock.part("data"):
            batches.close()
            batches = loader.train_iterator(cfg, rows, start_example=start.example, source=run.train_source)
            first_local = next(batches)
    if is_writer:  # steps after the restored one (all, without a checkpoint) run again
        drop_after(run_dir, start.step)
    if start.step >= cfg.train.steps:
        log(f"nothing to train: step {start.step} reached train.steps={cfg.train.steps}; raise train.steps "
            f"to go on, or use another run_dir")
        batches.close()
        checkpoints.close()
        return trainer

    evaluate = _evaluator(cfg, trainer, run, rows)
    first = trainer.global_batch(first_local)
    trainer.compile(first)
    clock.add("trace", trainer.trace_time_s)
    clock.add("compile", trainer.compile_time_s)
    with clock.part("warm_up"):  # what the steps run beside themselves, compiled before the first
        checkpoints.warm_up(trainer.state)
        if evaluate is not None:
            evaluate.warm_up()
        trainer.param_norm().block_until_ready()
    if runtime.interrupted():  # a Ctrl-C during start-up that Python dropped (runtime.remember_interrupts)
        raise runtime.interruption()
    log(clock.startup_line())

    wandb = wandb_log.WandbRun(cfg, run_dir) if is_writer and cfg.log.wandb else None
    writer = MetricsWriter(run_dir if is_writer else None, wandb, resumed_at=start.step if start.step else None)
    steps = _Steps(run, trainer, batches, first, evaluate, _Records(writer, checkpoints, clock), start.step)
    try:
        steps.run()
    finally:
        batches.close()  # stops the data workers, whose batches read ahead are dropped
        writer.close()
        if writer.stuck:
            warn(f"the metrics of the last logged steps could not be written to {run_dir} in time (is its file "
                 f"system stuck?)")
    if steps.stopped:
        return trainer
    log(steps.progress.summary(steps.steady_values(), checkpoints.last_saved, checkpoints.directory,
                               sorted(checkpoints.undeletable)))
    log(clock.summary())

    if run.tokenizer is not None:
        write_sample(cfg, trainer, layout.batch_shards, run.tokenizer)
    return trainer


def _log_setup(cfg: Config, trainer: Trainer, layout: layout_lib.Layout, rows: feed.BatchRows) -> None:
    """The start-up lines on the precision, the mesh, the data and the sizes."""
    no_fp8 = dtypes.fp8_unavailable(cfg.precision, trainer.mesh.devices.flat[0].platform)
    if no_fp8:
        log(no_fp8)
    reads = "" if jax.process_count() == 1 else (
        f"; process 0 feeds rows {_ranges(rows.rows)} of each global batch of {rows.global_batch}")
    log(f"mesh {mesh_lib.describe(trainer.mesh)} on {len(trainer.mesh.devices.flat)} devices "
        f"({jax.process_count()} process(es)); rules preset {cfg.rules.preset}{reads}")
    log(loader.describe(cfg))
    log(console.size_line(
        params=sum(p.size for p in jax.tree.leaves(trainer.params)), global_batch=cfg.train.global_batch,
        device_batch=cfg.train.global_batch // layout.batch_shards,
        param_bytes=max(state_bytes_per_device(trainer.params).values()),
    ))


@dataclasses.dataclass(frozen=True)
class _Records:
    """Where the steps record what they did: the metrics, the checkpoints and the run's time by part."""

    writer: MetricsWriter
    checkpoints: RunCheckpoints
    clock: RunTime


class _Steps:
    """The loop over the steps from `start`: step, check, log, evaluate, save; stops on a signal or a
    bad step. `batches` yields the local rows of the batches after `first`, the global first batch."""

    def __init__(self, run: Run, trainer: Trainer, batches: Iterator, first: dict, evaluate, records: _Records,
                 start: int):
        cfg = run.cfg
        self.cfg, self.trainer, self.batches, self.batch, self.evaluate = cfg, trainer, batches, first, evaluate
        self.flops = run.entry.flops_per_example(cfg)
        self.writer, self.checkpoints, self.clock = records.writer, records.checkpoints, records.clock
        self.start = start
        self.progress = console.StepProgress(start, cfg.train.steps, show=jax.process_index() == 0)
        self.guard = NonFiniteGuard(cfg.train, self.checkpoints.resumed_bad_steps_in_a_row)
        self.stopped = False
        self._warned_input = False
        self._last_time, self._last_step = time.perf_counter(), start
        self._data_wait = self._saves = 0.0

    def run(self) -> None:
        cfg, checkpoints, guard = self.cfg, self.checkpoints, self.guard
        # The handlers stay through the last checkpoint's write: a signal then is recorded, not fatal.
        interrupted = False
        with StopSignals() as stop:
            try:
                # guard.halting() is innermost: a halt must not reach the save after an error.
                with (checkpoints.saving_on_error(self.trainer, lambda: guard.in_a_row),
                      StepProfiler(cfg.profile, Path(cfg.run_dir)) as profiler, guard.halting()):
                    for step in range(self.start + 1, cfg.train.steps + 1):
                        profiler.before(step)
                        metrics = self.trainer.step(self.batch)
                        profiler.after(step, metrics)
                        guard.record(step, metrics)
                        self.progress.step(step)
                        if step < cfg.train.steps:
                            asked = time.perf_counter()
                            local = next(self.batches)
                            self._data_wait += time.perf_counter() - asked
                            self.batch = self.trainer.global_batch(local)
                        self._log(step, metrics)
                        checkpoints.poll()
                        self.writer.check()
                        if checkpoints.due(step):
                            guard.check()
                            saving = time.perf_counter()
                            checkpoints.after_step(step, self.trainer.state, guard.in_a_row)
                            self._saves += self._spent("saves", saving)
                        checkpoints.confirm(guard.sane_through)
                        if reason := stop.requested(step):
                            guard.check()
                            with self.clock.part("saves"):
                                checkpoints.stop(step, self.trainer.state, reason, guard.in_a_row)
                            self.stopped = True
                            return
                    guard.check()
                    checkpoints.confirm(guard.sane_through)
            except BaseException as err:
                interrupted = not isinstance(err, Exception)  # a second Ctrl-C: leave at once
                raise
            finally:
                self.progress.close()
                with self.clock.part("last_write"):
                    # Finishes the saves of finite steps; after an interrupt, waits for nothing.
                    checkpoints.close(wait=not interrupted)
            if guard.halted is not None:
                halted = guard.halted
                raise NonFiniteError(f"{halted}; stopped without saving it; "
                                     f"{checkpoints.diverged(halted.first_bad_step)}") from None

    def _spent(self, part: str, since: float) -> float:
        seconds = time.perf_counter() - since
        self.clock.add(part, seconds)
        return seconds

    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        cfg = self.cfg
        eval_due = self.evaluate is not None and (step % cfg.eval.every == 0 or step == cfg.train.steps)
        first_of_run = step == self.start + 1  # shows where the loss starts
        if not (first_of_run or step % cfg.log.every == 0 or step == cfg.train.steps or eval_due):
            return
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        steps = step - self._last_step
        # The steps' own time: saves (the loop's part of them) are counted apart; evaluation and
        # logging come after the clock is read.
        step_time = (time.perf_counter() - self._last_time - self._saves) / steps
        self.clock.interval(steps, step_time, self._data_wait, first=step == self.start + 1)
        logging = time.perf_counter()
        values["param_norm"] = float(self.trainer.param_norm())
        examples_per_sec = cfg.train.global_batch / step_time
        data_wait = self._data_wait / steps
        values.update(step_time_s=step_time, **throughput(examples_per_sec, cfg.model.tokens_per_example),
                      data_wait_s=data_wait, **device_metrics(self.flops, examples_per_sec, self.trainer.mesh))
        if self._saves:
            values["save_blocked_s"] = self._saves
        if first_of_run:
            values.update({f"startup_{name}_s": seconds for name, seconds in self.clock.parts.items()
                           if name in STARTUP})
        self._spent("logging", logging)
        if eval_due:
            evaluating = time.perf_counter()
            values.update(self.evaluate())
            values["eval_time_s"] = self._spent("eval", evaluating)
        if (goodput := self.clock.goodput()) is not None:
            values["goodput"] = goodput
        self._warn_if_input_bound(step, steps, data_wait, step_time)
        logging = time.perf_counter()
        self.writer.write(step, values)
        self.progress.logged(step, values)
        self._spent("logging", logging)
        self._last_time, self._last_step, self._data_wait, self._saves = time.perf_counter(), step, 0.0, 0.0

    def _warn_if_input_bound(self, step: int, steps: int, data_wait: float, step_time: float) -> None:
        if self._warned_input or steps < 2 or data_wait < INPUT_BOUND * step_time:
            return
        self._warned_input = True
        warn(f"input is the bottleneck: up to step {step} the loop waited {data_wait * 1e3:.1f} ms of each "
             f"{step_time * 1e3:.1f} ms step for data; raise data.workers (now {self.cfg.data.workers}), or read "
             f"prepared data (jaxdist data prepare)")

    def steady_values(self) -> dict[str, float]:
        """The steady step time and its throughput and MFU (observe/goodput.py)."""
        steady = self.clock.steady_step_s()
        if steady is None:
            return {}
        examples_per_sec = self.cfg.train.global_batch / steady
        return {"step_time_s": steady, **throughput(examples_per_sec, self.cfg.model.tokens_per_example),
                **device_metrics(self.flops, examples_per_sec, self.trainer.mesh)}


class NonFiniteGuard:
    """Stops the run at a bad step (`precision.verdict`, and a loss spike: train/spikes.py): at once
    under `train.on_nonfinite=halt`, after more than `train.max_consecutive_skips` in a row under skip.

    `record` reads each step's `nonfinite` flag one step late, after the next step is dispatched,
    so the host does not wait for the step it just queued; call `check` before saving a step, which
    reads the newest flag at once. The step never applies a bad update, but the state after it is
    not saved either: its step count would claim training the data did not.
    """

    def __init__(self, cfg: TrainConfig, in_a_row: int = 0):
        self._cfg = cfg
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._in_a_row = in_a_row  # a resumed run's count goes on from its checkpoint's
        self.halted: NonFiniteError | None = None
        self.sane_through: int | None = None  # the newest checked step that was sane

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
            self.sane_through = step
            return
        self._in_a_row += 1
        limit = self._cfg.max_consecutive_skips
        if self._cfg.on_nonfinite == "skip" and self._in_a_row <= limit:
            return
        why = "" if self._cfg.on_nonfinite == "halt" else (
            f" ({self._in_a_row} bad steps in a row, more than train.max_consecutive_skips={limit})")
        raise NonFiniteError(f"step {step}: {_what_is_bad(metrics, self._cfg)}{why}",
                             first_bad_step=step - self._in_a_row + 1)

    @contextlib.contextmanager
    def halting(self) -> Iterator[None]:
        """Leaves the block on a halt and keeps the error in `halted`. Another error (a corrupt
        batch, say) first checks the step not yet checked: if it was bad, the run halts for it
        instead, so the save after an error never writes a state the guard would refuse."""
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


def _warn_if_warmup_outlasts_the_run(cfg: Config) -> None:
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if warmup >= steps:
        decay = "" if cfg.optim.schedule == "constant" else f" and optim.schedule={cfg.optim.schedule} never decays"
        warn(f"optim.warmup_steps={warmup} is not shorter than train.steps={steps}: the learning rate only ramps "
             f"up, to {steps / warmup:.0%} of optim.lr at the last step{decay}; lower optim.warmup_steps")


def _what_is_bad(metrics: dict[str, Any], cfg: TrainConfig) -> str:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(values["loss"]):
        return f"the loss is {values['loss']}"
    if values.get("loss_spike"):
        return (f"the loss {values['loss']:.4g} is {values['loss'] / values['loss_average']:.3g} times its running "
                f"average {values['loss_average']:.4g} (more than train.loss_spike={cfg.loss_spike:g}: diverging)")
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


def _evaluator(cfg: Config, trainer: Trainer, run: Run, rows: feed.BatchRows):
    """What evaluates the run (None without eval): its eval split, or each source of a mixture apart."""
    if run.eval_source is None:
        return None
    if not isinstance(run.eval_source, dict):
        return Evaluator(trainer, run.entry.loss, lambda: loader.eval_iterator(cfg, rows, run.eval_source))
    batches = {name: functools.partial(loader.eval_iterator, cfg, rows, split) for name, split in run.eval_source.items()}
    first = next(iter(batches.values()))
    weights = {source.name: source.weight for source in cfg.data.mixture}
    return MixtureEvaluator(Evaluator(trainer, run.entry.loss, first), batches, weights)


def write_sample(cfg: Config, trainer: Trainer, rows: int, tokenizer: Tokenizer) -> None:
    """Prints a continuation of `sample.prompt` in `tokenizer`'s tokens; `rows` continuations are
    drawn, one per batch shard."""
    picks = models.get(cfg.model.name).read_in_compute_dtype
    cast = None if picks is None else compute_dtype_params(picks, dtypes.policy(cfg.precision).compute_dtype)
    sampling = Sampling(cfg.sample.tokens, cfg.sample.temperature, cfg.sample.top_p, rows=rows, seed=cfg.seed)
    tokens = sample(trainer.graphdef, trainer.params, tokenizer.encode(cfg.sample.prompt), cfg.model.seq_len, sampling,
                    trainer.mesh, trainer.rules, cast, trainer.state.model_state)
    text = tokenizer.decode(np.asarray(tokens[0]))
    log("--- sample ---\n" + text + "\n--------------")
