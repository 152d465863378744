"""jaxdist: one JAX program over many accelerators and hosts.

A device mesh with named axes (data, stage, fsdp, tensor) and logical-axis rules decide where
every parameter and activation lives; XLA's SPMD partitioner inserts the collectives.

    import jaxdist
    from jaxdist.parallel import rules
    mesh = jaxdist.make_mesh(fsdp=4, tensor=2)
    trainer = jaxdist.Trainer(make_model, loss_fn, optax.adamw(1e-3), mesh, rules.preset("fsdp_tp"))
"""

from jaxdist import _platform

_platform.apply_cpu_device_count()
_platform.apply_xla_flags()

from jaxdist.config import Config, load as load_config  # noqa: E402
from jaxdist.errors import UserError  # noqa: E402
from jaxdist.parallel import distributed  # noqa: E402  (jaxdist.distributed.initialize())
from jaxdist.parallel.mesh import make_mesh  # noqa: E402
from jaxdist.train.trainer import Trainer  # noqa: E402

__all__ = ["Config", "Trainer", "UserError", "distributed", "load_config", "make_mesh"]
