"""The device mesh: nested data axes `inter` (slow network, across optimizer instances or hosts)
and `intra` (fast interconnect inside one instance). Axis names live here and nowhere else."""

from __future__ import annotations

import dataclasses

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nljax.errors import ConfigError

INTER = "inter"
INTRA = "intra"
DATA_AXES = (INTER, INTRA)  # batch rows are split over both, `inter` major

# Spec of an array whose leading axis is split over every data-parallel device (batch rows,
# per-row memory state, per-device error buffers).
ROWS = P(DATA_AXES)
REPLICATED = P()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Config section `mesh`: the shape of the device mesh (`resolve_shape` fills it in)."""

    # optimizer instances / hosts (slow network); -1 fills in the rest, and with intra=-1 too
    # means one instance per process (1 in a single-process run)
    inter: int = -1
    intra: int = -1  # devices inside one instance (fast interconnect); -1 fills in the rest

    def check(self) -> None:
        if self.inter == 0 or self.inter < -1 or self.intra == 0 or self.intra < -1:
            raise ConfigError(f"mesh.inter and mesh.intra must be positive or -1, got {self.inter}, {self.intra}")


def resolve_shape(inter: int, intra: int, n_devices: int, n_processes: int = 1) -> tuple[int, int]:
    """Fills in -1 and checks that inter * intra equals the device count. Both -1: one `inter`
    slot per process, `intra` over each process's devices (1 x n in a single process)."""
    if inter == -1 and intra == -1:
        inter = n_processes
    if inter == -1:
        if n_devices % intra:
            raise ConfigError(f"mesh.intra={intra} does not divide the {n_devices} available devices")
        inter = n_devices // intra
    if intra == -1:
        if n_devices % inter:
            raise ConfigError(f"mesh.inter={inter} does not divide the {n_devices} available devices")
        intra = n_devices // inter
    if inter * intra != n_devices:
        raise ConfigError(
            f"mesh inter={inter} x intra={intra} = {inter * intra} devices, but {n_devices} are available"
        )
    return inter, intra


def make_mesh(inter: int = 1, intra: int = -1, devices=None) -> Mesh:
    """A 2-D mesh over `devices` (default: all). Devices are laid out process-major, so with one
    process per host `intra` stays inside a host and `inter` crosses hosts."""
    devices = list(jax.devices() if devices is None else devices)
    inter, intra = resolve_shape(inter, intra, len(devices), len({d.process_index for d in devices}))
    devices.sort(key=lambda d: (d.process_index, d.id))
    # Plain Mesh (not jax.make_mesh): axis types stay the classic ones that shard_map expects
    # across jax 0.10-0.12.
    return Mesh(np.array(devices, dtype=object).reshape(inter, intra), DATA_AXES)


def data_size(mesh: Mesh) -> int:
    return mesh.shape[INTER] * mesh.shape[INTRA]


def check_batch(global_rows: int, mesh: Mesh, what: str = "train.batch_size") -> int:
    """Rows per device, or a one-line error naming the numbers."""
    n = data_size(mesh)
    if global_rows % n:
        raise ConfigError(
            f"{what}={global_rows} does not divide over {n} data-parallel devices "
            f"(mesh inter={mesh.shape[INTER]} x intra={mesh.shape[INTRA]})"
        )
    return global_rows // n


def rows_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, ROWS)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)

