"""jaxdist: one JAX program over many accelerators and hosts.

A device mesh with named axes (data, stage, fsdp, tensor) and logical-axis rules decide where
every parameter and activation lives; XLA's SPMD partitioner inserts the collectives.

    import jaxdist
    from jaxdist.parallel import rules
    jaxdist.use_cpu_devices()  # JAXDIST_CPU_DEVICES=8 simulates 8 devices on a CPU-only machine
    mesh = jaxdist.make_mesh(fsdp=4, tensor=2)
    trainer = jaxdist.Trainer(make_model, loss_fn, optax.adamw(1e-3), mesh, rules.preset("fsdp_tp"))

Importing jaxdist changes nothing outside it (environment, JAX config, absl flags):
`use_cpu_devices()` and `gpu_defaults()` apply its process-wide settings when called.
"""

from jaxdist.config import Config, load as load_config
from jaxdist.errors import UserError
from jaxdist.parallel import distributed  # jaxdist.distributed.initialize()
from jaxdist.parallel.mesh import make_mesh
from jaxdist.runtime import gpu_defaults, use_cpu_devices
from jaxdist.train.trainer import Trainer

__all__ = [
    "Config", "Trainer", "UserError", "distributed", "gpu_defaults", "load_config", "make_mesh", "use_cpu_devices",
]
