"""jaxdist: one JAX program over many accelerators and hosts.

A device mesh with named axes (data, stage, fsdp, tensor) and logical-axis rules decide where
every parameter and activation lives; XLA's SPMD partitioner inserts the collectives.

    import jaxdist
    from jaxdist.parallel import rules
    jaxdist.use_cpu_devices()  # JAXDIST_CPU_DEVICES=8 simulates 8 devices on a CPU-only machine
    mesh = jaxdist.make_mesh(fsdp=4, tensor=2)
    trainer = jaxdist.Trainer(make_model, loss_fn, optax.adamw(1e-3), mesh, rules.preset("fsdp_tp"))

Importing jaxdist changes nothing outside it (environment, JAX config, absl flags):
`use_cpu_devices()` and `gpu_defaults()` apply its process-wide settings when called. Nor does it
import JAX: each public name (`__all__`) imports its module, and with it JAX, on first use, so the
`jaxdist` command starts fast and a Ctrl-C while it imports JAX is its one-line exit 130.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports each on first use
    from jaxdist.config import Config, load as load_config
    from jaxdist.errors import UserError
    from jaxdist.models.loss import Loss
    from jaxdist.parallel import distributed  # jaxdist.distributed.initialize()
    from jaxdist.parallel.mesh import make_mesh
    from jaxdist.runtime import gpu_defaults, use_cpu_devices
    from jaxdist.train.options import InitOptions, StepOptions
    from jaxdist.train.trainer import Trainer

# Each public name: (module, attribute); attribute None: the name is the module itself.
_PUBLIC = {
    "Config": ("jaxdist.config", "Config"),
    "InitOptions": ("jaxdist.train.options", "InitOptions"),
    "Loss": ("jaxdist.models.loss", "Loss"),
    "StepOptions": ("jaxdist.train.options", "StepOptions"),
    "Trainer": ("jaxdist.train.trainer", "Trainer"),
    "UserError": ("jaxdist.errors", "UserError"),
    "distributed": ("jaxdist.parallel.distributed", None),
    "gpu_defaults": ("jaxdist.runtime", "gpu_defaults"),
    "load_config": ("jaxdist.config", "load"),
    "make_mesh": ("jaxdist.parallel.mesh", "make_mesh"),
    "use_cpu_devices": ("jaxdist.runtime", "use_cpu_devices"),
}
__all__ = [
    "Config", "InitOptions", "Loss", "StepOptions", "Trainer", "UserError", "distributed", "gpu_defaults",
    "load_config", "make_mesh", "use_cpu_devices",
]


def __getattr__(name: str):
    """Imports a public name on first use (PEP 562) and keeps it, so later uses are plain lookups."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
