"""`jaxdist doctor [--config CONFIG] [overrides]`: checks and times the collectives of the mesh on
every process, device and mesh axis (`jaxdist.observe.mesh_health`). Only process 0 prints; the exit
code is 0 when every check passed on every process, else 1."""

from __future__ import annotations

import argparse

from jaxdist.commands import arguments

HELP = "check devices and collectives on every mesh axis"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config whose mesh to check (default: data = process count)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.tensor=2")
    parser.add_argument("--megabytes", type=arguments.AMOUNT, default=64.0, help="buffer per device for bandwidth")


def run(args: argparse.Namespace) -> int:
    import jax

    from jaxdist import config
    from jaxdist.observe import mesh_health
    from jaxdist.parallel import mesh as mesh_lib

    # Without a file: one data slice per process, and fsdp inside.
    overrides = args.overrides if args.config is not None else [f"mesh.data={jax.process_count()}", *args.overrides]
    cfg = config.load(args.config, overrides)
    mesh = mesh_lib.build_mesh(mesh_lib.resolve_mesh_shape(cfg.mesh, jax.device_count()))
    mesh_health.check_buffer_fits(mesh, args.megabytes)
    hosts = mesh_health.hostnames()
    checks = mesh_health.run_checks(mesh)
    bandwidth = mesh_health.measure_bandwidth(mesh, args.megabytes)
    if jax.process_index() == 0:
        print("\n".join(mesh_health.report(mesh, hosts, checks, bandwidth, args.megabytes)), flush=True)
    return 0 if all(check.ok for check in checks) else 1
