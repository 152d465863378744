"""The device mesh: named axes (data, stage, fsdp, expert, tensor), slowest links outermost.

On several hosts the host factor is given to the outermost axes first (data, then stage, ...),
so data parallelism crosses the slow network and fsdp/tensor stay on a host's fast links.
Within a host, `mesh_utils.create_device_mesh` orders devices by the physical topology.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxdist.config import MESH_AXES, MeshConfig
from jaxdist.errors import UserError


def resolve_mesh_shape(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Mesh axis sizes with the -1 filled in; a `UserError` if they cannot cover the devices."""
    sizes = {axis: getattr(mesh, axis) for axis in MESH_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    fill = [axis for axis, size in sizes.items() if size == -1]
    if fill:
        if device_count % fixed:
            shown = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items() if size != -1)
            raise UserError(
                f"mesh: the fixed axes {shown} multiply to {fixed}, which does not divide the "
                f"{device_count} devices; change them or mesh.{fill[0]}"
            )
        sizes[fill[0]] = device_count // fixed
    elif fixed != device_count:
        shown = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())
        raise UserError(
            f"mesh: {shown} = {fixed} devices, but {device_count} are present; make the product "
            f"{device_count} or set one axis to -1"
        )
    return sizes


def split_across_hosts(shape: dict[str, int], hosts: int) -> tuple[dict[str, int], dict[str, int]]:
    """Splits each axis size into (across hosts, within a host), outermost axes taking hosts first
    (an axis `shape` leaves out has size 1)."""
    shape = {axis: shape.get(axis, 1) for axis in MESH_AXES}
    across, remaining = {}, hosts
    for axis in MESH_AXES:
        across[axis] = math.gcd(remaining, shape[axis])
        remaining //= across[axis]
    if remaining != 1:
        raise UserError(
            f"mesh: {hosts} processes cannot split the mesh {shape} evenly; make mesh.data "
            f"(or the product of the outer axes) a multiple of the process count"
        )
    within = {axis: shape[axis] // across[axis] for axis in MESH_AXES}
    return across, within


def build_mesh(shape: dict[str, int], devices: list | None = None) -> Mesh:
    """A `Mesh` of the given axis sizes over `devices` (default: all), with Auto axis types (an axis
    `shape` leaves out has size 1)."""
    shape = {axis: shape.get(axis, 1) for axis in MESH_AXES}
    devices = list(jax.devices() if devices is None else devices)
    by_host: dict[int, list] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        by_host.setdefault(device.process_index, []).append(device)
    across, within = split_across_hosts(shape, len(by_host))
    within_shape = [within[axis] for axis in MESH_AXES]
    host_meshes = np.stack([_host_mesh(within_shape, host) for host in by_host.values()])
    # (hosts, *within) -> (*across, *within) -> interleave so each axis is (across, within).
    grid = host_meshes.reshape([across[a] for a in MESH_AXES] + within_shape)
    n = len(MESH_AXES)
    grid = grid.transpose([i for axis in range(n) for i in (axis, axis + n)])
    grid = grid.reshape([shape[axis] for axis in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * n)


def _host_mesh(shape: list[int], devices: list) -> np.ndarray:
    try:
        return mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        # Topologies mesh_utils does not model (CPU, some GPU hosts): device-id order.
        return np.asarray(devices, dtype=object).reshape(shape)


def describe(mesh: Mesh) -> str:
    """The axes and their sizes, `data=2 x stage=1 x fsdp=4 x tensor=1`; `expert` where it splits anything."""
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items() if name != "expert" or size > 1)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, stage: int = 1, expert: int = 1,
              devices: list | None = None) -> Mesh:
    """A mesh from axis sizes (-1 fills the remaining devices), for use from Python."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = MeshConfig(data=data, stage=stage, fsdp=fsdp, expert=expert, tensor=tensor)
    return build_mesh(resolve_mesh_shape(sizes, len(devices)), devices)
