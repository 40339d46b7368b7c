"""The device mesh: nested data axes `inter` (slow network, across optimizer instances or hosts)
and `intra` (fast interconnect inside one instance), and the tensor-parallel axis `model`
(innermost: a model's shards sit on neighbouring devices of one host). Axis names live here and
nowhere else."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nljax.errors import ConfigError

INTER = "inter"
INTRA = "intra"
MODEL = "model"
DATA_AXES = (INTER, INTRA)  # batch rows are split over both, `inter` major
AXES = (*DATA_AXES, MODEL)

# Spec of an array whose leading axis is split over every data-parallel device (batch rows,
# per-row memory state, per-device error buffers).
ROWS = P(DATA_AXES)
REPLICATED = P()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Config section `mesh`: the shape of the device mesh (`resolve_shape` fills it in). The
    mesh belongs to a launch, not to a run: `--resume` on devices a saved mesh does not fit takes
    the defaults for the keys this command does not set, with a note (nljax/run/resuming.py)."""

    # optimizer instances / hosts (slow network); -1 fills in the rest, and with intra=-1 too
    # means one instance per process (1 in a single-process run)
    inter: int = -1
    intra: int = -1  # devices inside one instance (fast interconnect); -1 fills in the rest
    # tensor-parallel shards of one model replica (attention and memory heads, MLP hidden width;
    # nljax/parallel/tp.py); inter x intra x model must equal the device count
    model: int = 1

    def check(self) -> None:
        if self.inter == 0 or self.inter < -1 or self.intra == 0 or self.intra < -1:
            raise ConfigError(f"mesh.inter and mesh.intra must be positive or -1, got {self.inter}, {self.intra}")
        if self.model < 1:
            raise ConfigError(f"mesh.model must be >= 1, got {self.model}")


def resolve_shape(inter: int, intra: int, n_devices: int, n_processes: int = 1, model: int = 1) -> tuple[int, int]:
    """Fills in -1 and checks that inter * intra * model equals the device count. Both -1: one
    `inter` slot per process, `intra` over each process's devices (1 x n in a single process)."""
    if n_devices % model:
        raise ConfigError(f"mesh.model={model} does not divide the {n_devices} available devices")
    if n_processes > 1 and (n_devices // n_processes) % model:
        raise ConfigError(f"mesh.model={model} does not divide each process's {n_devices // n_processes} devices "
                          "(a model's tensor-parallel shards stay inside one host)")
    n_devices //= model
    avail = f"{n_devices} available devices" if model == 1 else f"{n_devices} devices each holding 1/{model} of a model"
    if inter == -1 and intra == -1:
        inter = n_processes
    if inter == -1:
        if n_devices % intra:
            raise ConfigError(f"mesh.intra={intra} does not divide the {avail}")
        inter = n_devices // intra
    if intra == -1:
        if n_devices % inter:
            raise ConfigError(f"mesh.inter={inter} does not divide the {avail}")
        intra = n_devices // inter
    if inter * intra != n_devices:
        what = f" x model={model} = {inter * intra * model}" if model > 1 else f" = {inter * intra}"
        raise ConfigError(
            f"mesh inter={inter} x intra={intra}{what} devices, but {n_devices * model} are available"
        )
    return inter, intra


def make_mesh(inter: int = 1, intra: int = -1, devices=None, model: int = 1) -> Mesh:
    """A 3-D mesh (inter, intra, model) over `devices` (default: all). Devices are laid out
    process-major, `model` innermost: with one process per host a model's shards and `intra`
    stay inside a host and `inter` crosses hosts."""
    devices = list(jax.devices() if devices is None else devices)
    inter, intra = resolve_shape(inter, intra, len(devices), len({d.process_index for d in devices}), model)
    devices.sort(key=lambda d: (d.process_index, d.id))
    # Plain Mesh (not jax.make_mesh): axis types stay the classic ones that shard_map expects
    # across jax 0.10-0.12.
    return Mesh(np.array(devices, dtype=object).reshape(inter, intra, model), AXES)


def data_size(mesh: Mesh) -> int:
    return mesh.shape[INTER] * mesh.shape[INTRA]


def model_size(mesh: Mesh) -> int:
    """Tensor-parallel shards per model replica (1 on a mesh without the `model` axis)."""
    return dict(mesh.shape).get(MODEL, 1)


def check_batch(global_rows: int, mesh: Mesh) -> int:
    """Rows per device of a train.batch_size of `global_rows`, or a one-line error naming the numbers."""
    n = data_size(mesh)
    if global_rows % n:
        near = [m for m in (global_rows // n * n, (global_rows // n + 1) * n) if m]  # the multiples around it
        raise ConfigError(
            f"train.batch_size={global_rows} does not divide over {n} data-parallel devices "
            f"(mesh inter={mesh.shape[INTER]} x intra={mesh.shape[INTRA]}): give a multiple of {n} "
            f"({' or '.join(map(str, near))})"
        )
    return global_rows // n


def rows_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, ROWS)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)

