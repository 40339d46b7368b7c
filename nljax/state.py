"""Training state and where each part of it lives on the mesh.

| field     | lifetime                          | sharding                                  |
|-----------|-----------------------------------|-------------------------------------------|
| step      | global                            | replicated                                |
| params    | outer loop, synchronized          | replicated                                |
| opt_state | per level, touched when it fires  | replicated                                |
| err_buf   | per level, rank-local             | [n_devices, N_l] split over data axes     |
| memory    | inner loop, per stream row        | [G, ...] split over data axes by row      |

`err_buf[l]` is None for levels that never freeze (period 1) and in `skip` mode.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from nljax.mesh import REPLICATED, ROWS

PyTree = Any


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: PyTree
    opt_state: tuple  # one optimizer state per level
    err_buf: tuple  # one float32 [n_devices, N_l] buffer per level, or None
    memory: PyTree  # inner-loop state, leading axis = stream rows


def specs(state: TrainState) -> TrainState:
    """PartitionSpecs for every leaf of `state` (same structure)."""
    rep = lambda tree: jax.tree.map(lambda _: REPLICATED, tree)
    rows = lambda tree: jax.tree.map(lambda _: ROWS, tree)
    return TrainState(
        step=REPLICATED,
        params=rep(state.params),
        opt_state=rep(state.opt_state),
        err_buf=rows(state.err_buf),
        memory=rows(state.memory),
    )


def shardings(state: TrainState, mesh) -> TrainState:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs(state), is_leaf=lambda x: isinstance(x, P))


def place(state: TrainState, mesh) -> TrainState:
    """Put host or single-device arrays where `specs` says they live."""
    return jax.device_put(state, shardings(state, mesh))
