"""Training state and where each part of it lives on the mesh.

| field     | lifetime                          | sharding                                        |
|-----------|-----------------------------------|-------------------------------------------------|
| step      | global                            | replicated                                      |
| params    | outer loop, synchronized          | replicated; fsdp: per-level flat vectors split   |
|           |                                   | over both data axes                             |
| opt_state | per level, touched when it fires  | replicated; zero1: flat vectors split over      |
|           |                                   | `intra`; fsdp: split over both data axes        |
| err_buf   | per level, rank-local             | [n_devices, N_l] split over data axes           |
|           |                                   | (`cms.accumulate=updates`: [n_devices,          |
|           |                                   | (C_l - 1) N_l], one slot per frozen step)       |
| memory    | inner loop, per stream row        | [G, ...] split over data axes by row            |

`err_buf[l]` is None for levels that never freeze (period 1) and in `skip` mode. With
`optim.ema_decay`, `opt_state[l]` is the pair (the update rule's state, level l's moving average
of its parameters), laid out as that state is (`nljax.engine.optim.Optimizer`). The layouts of
`params` and `opt_state` per strategy, and the PartitionSpecs of every field
(`Strategy.state_specs`), are in `nljax/engine/strategy.py`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct

PyTree = Any


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: PyTree
    opt_state: tuple  # one optimizer state per level
    err_buf: tuple  # one float32 [n_devices, frozen.width] buffer per level, or None
    memory: PyTree  # inner-loop state, leading axis = stream rows


def bytes_per_device(state: TrainState) -> dict[str, int]:
    """Bytes one device holds of each field, from the arrays' shardings (the largest shard where
    shards differ, i.e. padding included)."""

    def per_device(tree) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape
            total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
        return total

    return {
        "params": per_device(state.params),
        "opt_state": per_device(state.opt_state),
        "err_buf": per_device(state.err_buf),
        "memory": per_device(state.memory),
    }


def describe_memory(report: dict[str, int], strategy: str) -> str:
    """The line printed at start."""
    mib = lambda b: f"{b / 2**20:,.2f} MiB"
    return (
        f"memory per device ({strategy}): params {mib(report['params'])}, optimizer state "
        f"{mib(report['opt_state'])}, error buffers {mib(report['err_buf'])}, inner-loop memory {mib(report['memory'])}"
    )
