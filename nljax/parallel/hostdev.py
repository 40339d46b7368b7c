"""Host <-> device: global arrays built from host rows, and device arrays brought back to the host.

A global batch is split over rows (`mesh.rows_sharding`). `rows_batch` asks its caller only for
the rows of this process's devices, so no process builds the whole batch; `put_batch` splits
host arrays that every process holds whole. Back on the host, per-device metrics arrive as one
value per device ([n_devices], split over rows) and are reduced here, gathered across processes
where they span several.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, Sharding

from nljax.parallel.mesh import rows_sharding


def put(x: np.ndarray, sharding: Sharding) -> jax.Array:
    """A host array every process holds whole, placed with `sharding` (each device takes its part)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host arrays [G, ...] -> global arrays split over rows (each device gets only its rows)."""
    sharding = rows_sharding(mesh)
    return {k: put(v, sharding) for k, v in batch.items()}


def rows_batch(shapes: dict[str, tuple[int, ...]], sharding: Sharding,
               rows_of: Callable[[np.ndarray], dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Global arrays of `shapes` (all [G, ...]) split over rows, each device's part built by
    `rows_of(which)`: the host arrays (every key) of global rows `which` [R]. It runs once per
    distinct span of rows, on the process that holds them."""
    n = next(iter(shapes.values()))[0]
    built: dict = {}

    def fetch(key, index):
        span = index[0]
        if (span.start, span.stop) not in built:
            built[span.start, span.stop] = rows_of(np.arange(n)[span])
        return built[span.start, span.stop][key]

    make = jax.make_array_from_callback
    return {k: make(shape, sharding, functools.partial(fetch, k)) for k, shape in shapes.items()}


def reset_all_rows(batch: dict) -> dict:
    """The batch with every row marked to start from a fresh memory (`reset`), when it has one."""
    if "reset" not in batch:
        return batch
    r = batch["reset"]
    return {**batch, "reset": put(np.ones(r.shape, np.bool_), r.sharding)}


def to_host(x: jax.Array) -> np.ndarray:
    """The whole global array on the host of every process (gathered when it spans processes)."""
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def gather_rows(x: jax.Array, n: int) -> np.ndarray:
    """The first `n` rows of an array split over rows, on the host of every process.

    Devices may hold different numbers of real rows (the array is padded to a multiple of the
    device count and the padding is at the end), so gathering the whole array and dropping the
    tail is the variable-size all-gather."""
    return to_host(x)[:n]


def replica(x: jax.Array) -> np.ndarray:
    """This process's copy of an array replicated over the devices (no communication)."""
    return np.asarray(x.addressable_data(0))


def host_sum(x: jax.Array) -> float:
    """Sum of a per-device metric array on the host (works across processes)."""
    return float(to_host(x).astype(np.float64).sum())


def mean_loss(metrics: dict) -> float:
    """The mean loss of a step over every device, from its per-device `loss_sum` and `count`; 0
    where no target counted (a weighted batch with none, whose gradient is 0 as well: the engine's
    `local_grads`), as evaluation's means are, not a ZeroDivisionError that ends the run."""
    return host_sum(metrics["loss_sum"]) / max(host_sum(metrics["count"]), 1.0)
