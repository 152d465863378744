"""Per-device memory of the compiled train step against the microbatch count (compile only, no run).

    JAXDIST_CPU_DEVICES=8 python benchmarks/accumulation_memory.py configs/tiny.yaml train.global_batch=64

For each microbatch count and gradient-reduction mode, prints XLA's memory analysis of the step:
temporaries (activations, gradients, the accumulation carry) and the gradient elements reduced per
step, counted from the HLO (trip counts included). Activations shrink with more microbatches;
`per_step` holds one unreduced float32 gradient per device during the scan, `per_microbatch` reduces
k times instead.
"""

from __future__ import annotations

import argparse
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

import jaxdist
from jaxdist import config as config_lib
from jaxdist import models
from jaxdist.observe import hlo
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.optim import build_optimizer
from jaxdist.train.state import TrainState, abstract_model, opt_state_shardings
from jaxdist.train.step import make_train_step


def compiled_step(cfg: config_lib.Config):
    """The step compiled for abstract inputs of this config's shapes and shardings."""
    mesh = layout_lib.from_config(cfg).mesh
    rules = rules_lib.from_config(cfg.rules)
    entry = models.get(cfg.model.name)
    graphdef, abstract_params, names = abstract_model(entry.create(cfg), cfg.seed)
    layouts = rules_lib.param_layouts(abstract_params, names, rules, mesh)
    param_shardings = rules_lib.layout_shardings(layouts, mesh)
    tx, schedule = build_optimizer(cfg.optim, cfg.train, names)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=opt_state_shardings(tx, abstract_params, param_shardings, mesh), skipped_steps=replicated,
    )
    state = TrainState(
        step=jax.ShapeDtypeStruct((), "int32"), params=abstract_params,
        opt_state=jax.eval_shape(tx.init, abstract_params), skipped_steps=jax.ShapeDtypeStruct((), "int32"),
    )
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len), "int32")
    step = make_train_step(
        graphdef, entry.loss, tx, schedule, mesh, rules, shardings,
        cfg.train.microbatches, cfg.train.grad_reduction,
    )
    return step.lower(state, None, {"inputs": tokens, "targets": tokens}).compile()


def reduced_elements(hlo_text: str) -> int:
    """Elements fed into all-reduce / reduce-scatter per step (executions x operand sizes): gradients,
    and under tensor parallelism activations too."""
    return sum(
        op.executions * sum(math.prod(shape) for shape in op.operand_shapes)
        for op in hlo.collectives(hlo_text, hlo.REDUCTIONS)
    )


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--microbatches", default="1,2,4,8")
    args = parser.parse_args()
    print(f"{'reduction':>15} {'k':>3} {'temp MiB/device':>16} {'args MiB/device':>16} {'reduced elements/step':>22}")
    for reduction in ("per_step", "per_microbatch"):
        for k in map(int, args.microbatches.split(",")):
            cfg = config_lib.load(args.config, [*args.overrides, f"train.microbatches={k}",
                                                f"train.grad_reduction={reduction}"])
            compiled = compiled_step(cfg)
            memory = compiled.memory_analysis()
            print(f"{reduction:>15} {k:>3} {memory.temp_size_in_bytes / 2**20:>16.2f} "
                  f"{memory.argument_size_in_bytes / 2**20:>16.2f} {reduced_elements(compiled.as_text()):>22,}")


if __name__ == "__main__":
    main()
