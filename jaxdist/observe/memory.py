"""A config's memory per device and compute per step, from the compiled step, run never: what
`jaxdist plan` reports.

The train state is described, not allocated (`Trainer.from_config(..., materialize=False)`), and the
real step is compiled for it ahead of time on the configured mesh; on a CPU machine `--devices N`
simulates N devices. Per device it reports the parameters, optimizer state, model state (BatchNorm's
running averages) and compute-dtype copies (from their shardings), the batch, and XLA's own count
of temporaries (activations, gradients, collective buffers) and code. Over `--device-memory` it
compiles changes that save memory (recomputation, more microbatches, a wider fsdp axis), cheapest
first, and suggests the first that fits.

Compiled for CPU (planning without the GPUs), only the state and batch are the GPU's: XLA on CPU
neither fuses nor rematerializes as on a GPU (its temporaries can be several times a GPU's), so
`--device-memory` is judged on the state and batch, with a wider fsdp as the only suggestion, and the
CPU temporaries are shown beside them, not as a verdict.

On a GPU host, `--mock-gpus N` compiles for N GPUs of its kind on one of them (runtime.mock_gpus):
each GPU's memory as XLA allocates it, and which collectives XLA's schedule leaves with nothing
beside them (`hlo.waited_collectives`), without the N GPUs.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import numpy as np

from jaxdist import models
from jaxdist.config import Config, with_overrides
from jaxdist.errors import UserError
from jaxdist.observe import hlo
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.mesh import resolve_mesh_shape
from jaxdist.train.trainer import Trainer

def _bytes_per_device(tree: Any, host: bool = False) -> int:
    """Bytes each device holds of an abstract tree (`jax.ShapeDtypeStruct`s with shardings) in its own
    memory, or with `host` in the host memory kept for it (`train.offload`)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree) if hasattr(leaf, "sharding") and leaf.sharding is not None
               and (leaf.sharding.memory_kind not in (None, "device")) == host)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of what the compiled step holds, and the model's FLOPs per step and device
    (`ModelEntry.flops_per_example`, as `jaxdist bench` counts MFU)."""

    mesh: str
    devices: int
    platform: str
    params: int
    opt_state: int
    copies: int
    batch: int
    temporaries: int
    code: int
    flops: float
    model_state: int = 0  # the model's non-parameter variables (BatchNorm's running averages)
    compression: int = 0  # the compressed gradient reduction's error feedback (train.grad_compression)
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # operand bytes per step, by opcode
    grad_compression: str = "none"
    host: int = 0  # per device, in pinned host memory: the optimizer state under train.offload (not in `total`)
    waited: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # hlo.waited_collectives, GPU only
    experts: int = 0  # of `params`: a mixture's expert weights (their `experts` axis split over mesh.expert)

    @property
    def total(self) -> int:
        """Peak bytes per device: the step's inputs (its outputs reuse their donated buffers),
        its temporaries and its code."""
        return self.held + self.temporaries + self.code

    @property
    def held(self) -> int:
        """Bytes per device of the state and the batch: their shapes and shardings, the same on any
        platform (unlike the temporaries and code, which are the compiling platform's)."""
        return self.params + self.opt_state + self.model_state + self.compression + self.copies + self.batch

    def lines(self) -> list[str]:
        parts = [("parameters", self.params), ("optimizer state", self.opt_state), ("model state", self.model_state),
                 ("gradient compression state", self.compression), ("compute copies", self.copies),
                 ("batch", self.batch), ("temporaries", self.temporaries), ("code", self.code)]
        shown = ", ".join(f"{name} {_gb(size)}" for name, size in parts if size)
        host = f"; in host memory: optimizer state {_gb(self.host)}" if self.host else ""
        lines = [f"plan: mesh {self.mesh} ({self.devices} {self.platform} devices)",
                 f"per device: {shown}; total {_gb(self.total)}{host}; {_flop(self.flops)} per step"]
        if self.experts:
            lines.append(f"of the parameters, the experts' weights: {_gb(self.experts)} per device")
        if self.collectives:
            sent = ", ".join(f"{opcode} {_gb(size)}" for opcode, size in sorted(self.collectives.items()))
            lines.append(f"collectives per step and device (train.grad_compression {self.grad_compression}): {sent}")
        if self.waited:
            counts = ", ".join(f"{opcode} {waited} of {total}"
                               for opcode, (waited, total) in sorted(self.waited.items()))
            lines.append(f"collectives XLA's schedule runs beside nothing, so that the step waits for each: {counts}")
        return lines


def _in_units(value: float, units: tuple[tuple[str, float, int], ...]) -> str:
    """`value` in the largest of `units` (name, scale, decimals) it fills; the last one below them all."""
    unit, scale, decimals = next((each for each in units if value >= each[1]), units[-1])
    return f"{value / scale:.{decimals}f} {unit}"


def _gb(size: int) -> str:
    return _in_units(size, (("GB", 1e9, 2), ("MB", 1e6, 2), ("kB", 1e3, 1)))


def _flop(count: float) -> str:
    return _in_units(count, (("TFLOP", 1e12, 2), ("GFLOP", 1e9, 2), ("MFLOP", 1e6, 2)))


def compiled_trainer(cfg: Config, devices: list | None = None) -> tuple[Trainer, dict[str, jax.ShapeDtypeStruct]]:
    """A trainer whose state is described, not allocated, with its step compiled for an abstract
    batch of `cfg`'s shapes on `devices`; and that batch."""
    trainer = Trainer.from_config(cfg, devices, materialize=False)
    example = models.get(cfg.model.name).random_batch(cfg, np.random.default_rng(0), 1)  # its shapes and dtypes
    batch = {key: jax.ShapeDtypeStruct((cfg.train.global_batch, *value.shape[1:]), value.dtype,
                                       sharding=trainer.batch_sharding) for key, value in example.items()}
    trainer.compile(batch)
    return trainer, batch


def make_plan(cfg: Config, devices: list | None = None) -> Plan:
    """Compiles `cfg`'s train step for an abstract state and batch on `devices` and measures it."""
    trainer, batch = compiled_trainer(cfg, devices)
    memory = trainer.compiled.memory_analysis()
    state = trainer.state
    mesh_devices = trainer.mesh.devices.flatten()
    text = trainer.compiled_text()
    platform = mesh_devices[0].platform
    return Plan(
        mesh=mesh_lib.describe(trainer.mesh), devices=len(mesh_devices), platform=platform,
        params=_bytes_per_device(state.params), opt_state=_bytes_per_device(state.opt_state),
        host=_bytes_per_device(state.opt_state, host=True),
        model_state=_bytes_per_device(state.model_state), compression=_bytes_per_device(state.compression),
        collectives={opcode: sum(by_dtype.values()) for opcode, by_dtype in hlo.bytes_per_call(text).items()},
        waited=hlo.waited_collectives(text) if platform == "gpu" else {},
        grad_compression=cfg.train.grad_compression,
        copies=_bytes_per_device(trainer.current_copies()), batch=_bytes_per_device(batch),
        temporaries=int(memory.temp_size_in_bytes), code=int(memory.generated_code_size_in_bytes),
        flops=models.get(cfg.model.name).flops_per_example(cfg) * cfg.train.global_batch / len(mesh_devices),
        experts=sum(layout.bytes_per_device for layout in jax.tree.leaves(
            trainer.layouts, is_leaf=lambda x: isinstance(x, rules_lib.ParamLayout))
            if rules_lib.EXPERTS in layout.names),
    )


# The preset that also splits the weights over fsdp, keeping what the preset splits over tensor.
_WITH_FSDP = {"dp": "fsdp", "tp": "fsdp_tp"}


def savings(cfg: Config, devices: list | None = None) -> list[list[str]]:
    """Overrides that need less memory per device, in the order they are tried: by what they cost a
    step as measured, cheapest first (docs/performance.md, "Fitting in memory"), then a wider fsdp."""
    remat, choices = getattr(getattr(cfg.model, "impl", None), "remat", None), _remat_choices(cfg)
    candidates = [["model.impl.remat=mlp"]] if remat == "none" and "mlp" in choices else []
    candidates += [[f"train.microbatches={cfg.train.microbatches * factor}"] for factor in (2, 4)]
    if remat != "full" and "full" in choices:
        candidates.append(["model.impl.remat=full"])
    candidates.append([f"train.microbatches={cfg.train.microbatches * 8}"])
    # The mesh as resolved on these devices: mesh.data=-1 (fill) replicates too.
    shape = resolve_mesh_shape(cfg.mesh, len(jax.devices() if devices is None else devices))
    if shape["data"] > 1:
        preset = _WITH_FSDP.get(cfg.rules.preset, cfg.rules.preset)
        # fsdp=-1 fills the devices, so it takes data's share as it is.
        fsdp = -1 if cfg.mesh.fsdp == -1 else shape["data"] * shape["fsdp"]
        candidates.append(["mesh.data=1", f"mesh.fsdp={fsdp}", f"rules.preset={preset}"])
    return candidates


def _remat_choices(cfg: Config) -> tuple[str, ...]:
    """The `model.impl.remat` values the model's config accepts (none where it has no such key)."""
    impl = getattr(cfg.model, "impl", None)
    field = type(impl).model_fields.get("remat") if impl is not None else None
    return typing.get_args(field.annotation) if field is not None else ()


def suggest(cfg: Config, limit: int, devices: list | None = None,
            held_only: bool = False) -> tuple[list[str], Plan] | None:
    """The first of `savings(cfg)` whose compiled step fits in `limit` bytes per device, with its plan.
    `held_only`: judged on the state and batch alone, so only the changes that shrink them are tried."""
    for overrides in savings(cfg, devices):
        if held_only and not overrides[0].startswith("mesh."):  # remat and microbatches shrink temporaries only
            continue
        try:
            candidate = with_overrides(cfg, overrides)
            plan = make_plan(candidate, devices)
        except UserError:  # e.g. a microbatch count that does not divide the batch
            continue
        if (plan.held if held_only else plan.total) <= limit:
            return overrides, plan
    return None


def report(cfg: Config, devices: list | None = None, device_memory: int | None = None) -> str:
    """What `jaxdist plan` prints."""
    plan = make_plan(cfg, devices)
    lines = plan.lines()
    if plan.platform == "cpu":
        lines.append(_cpu_note(cfg))
        if device_memory is not None:
            lines += _cpu_verdict(cfg, plan, device_memory, devices)
    elif device_memory is not None:
        if plan.total <= device_memory:
            lines.append(f"fits in {_gb(device_memory)} per device ({plan.total / device_memory:.0%})")
        else:
            lines.append(f"does not fit in {_gb(device_memory)} per device: needs {_gb(plan.total)}")
            found = suggest(cfg, device_memory, devices)
            if found is None:
                lines.append("no single change tried (model.impl.remat, more train.microbatches, a wider fsdp) fits; "
                             "use more devices or a smaller model")
            else:
                overrides, fitted = found
                lines.append(f"suggestion: {' '.join(overrides)} -> total {_gb(fitted.total)} per device (compiled: fits)")
    return "\n".join(lines)


def _cpu_note(cfg: Config) -> str:
    note = ("compiled for CPU: parameters, optimizer state, model state, compute copies and batch are exact on any "
            "device; temporaries and code are CPU XLA's, not a GPU's (no GPU fusion or rematerialization)")
    if cfg.precision.compute == "auto":  # float32 on CPU: no compute copies, where a GPU keeps bfloat16 ones
        note += "; precision.compute=auto computes in float32 here: set it to count a GPU's compute copies"
    return note


def _cpu_verdict(cfg: Config, plan: Plan, limit: int, devices: list | None) -> list[str]:
    """The fit a CPU compile can decide: the state and batch's; the temporaries are only CPU XLA's."""
    if plan.held > limit:
        lines = [f"does not fit in {_gb(limit)} per device: the state and batch alone need {_gb(plan.held)}"]
        found = suggest(cfg, limit, devices, held_only=True)
        if found is None:
            lines.append("no wider fsdp fits them; use more devices or a smaller model")
        else:
            overrides, fitted = found
            lines.append(f"suggestion: {' '.join(overrides)} -> state and batch {_gb(fitted.held)} per device "
                         f"(compiled; a GPU's temporaries not counted)")
        return lines
    cpu = "would fit" if plan.total <= limit else "would not fit"
    return [f"the state and batch take {_gb(plan.held)} of {_gb(limit)} per device ({plan.held / limit:.0%}), "
            f"leaving {_gb(limit - plan.held)} for temporaries and code: the CPU compile's "
            f"({_gb(plan.temporaries + plan.code)}) {cpu}; run jaxdist plan on the GPU host for the verdict"]
