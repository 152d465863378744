"""Per-device memory of the compiled train step across values of one config key (compile only, no run).

    JAXDIST_CPU_DEVICES=8 python benchmarks/step_memory.py jaxdist/recipes/tiny.yaml train.global_batch=64 \
        --sweep train.microbatches=1,2,4,8
    JAXDIST_CPU_DEVICES=1 python benchmarks/step_memory.py jaxdist/recipes/tiny.yaml model.vocab=16384 \
        --sweep impl.loss_chunk=0,8,32,128
    python benchmarks/step_memory.py jaxdist/recipes/gpt_406m.yaml --sweep impl.loss_chunk=0,128,256   # on a GPU

For each value, the step is compiled as `jaxdist plan` compiles it (the real step, for a described
state) and XLA's memory analysis printed: temporaries (activations, gradients, the accumulation
carry, logits), arguments (the state and the batch), and the elements fed into all-reduce and
reduce-scatter per step, counted from the HLO with loop trip counts (gradients, and under tensor
parallelism activations too).
"""

from __future__ import annotations

import argparse
import math

import jaxdist
from jaxdist import config as config_lib
from jaxdist.observe import hlo, plan


def reduced_elements(hlo_text: str) -> int:
    """Elements fed into all-reduce / reduce-scatter per step (executions x operand sizes)."""
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
    parser.add_argument("--sweep", required=True, help="KEY=V1,V2,... : the values of one config key to compare")
    args = parser.parse_args()
    key, values = args.sweep.split("=", 1)
    print(f"{key:>24} {'temp MiB/device':>16} {'args MiB/device':>16} {'reduced elements/step':>22}")
    for value in values.split(","):
        cfg = config_lib.load(args.config, [*args.overrides, f"{key}={value}"])
        trainer, _ = plan.compiled_trainer(cfg)
        memory = trainer.compiled.memory_analysis()
        print(f"{value:>24} {memory.temp_size_in_bytes / 2**20:>16.2f} {memory.argument_size_in_bytes / 2**20:>16.2f} "
              f"{reduced_elements(trainer.compiled_text()):>22,}")


if __name__ == "__main__":
    main()
