"""Gradient reductions over the data axes, called inside `shard_map`.

Each active CMS level is reduced as one flat buffer (one collective per level, like a DDP bucket
aligned to the level), so the compiled HLO shows exactly which level moved how many bytes.

- `flat`: one all-reduce over both data axes.
- `hierarchical` (seed 003): reduce-scatter over `intra` (fast links, full data), all-reduce over
  `inter` on the 1/intra shard each device owns (slow links, small data), all-gather over `intra`.

The sharded strategies (`nljax/engine/strategy.py`) stop before the all-gather: `shard_intra` gives the
1/intra shard ZeRO-1 updates, `shard_all` the 1/(inter*intra) shard FSDP updates.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from nljax.parallel.mesh import DATA_AXES, INTER, INTRA


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Config section `sync`: how gradients are reduced, and where the state lives."""

    # hierarchical: reduce-scatter over intra, all-reduce over inter on the 1/intra shard, all-gather
    # over intra; flat: one all-reduce over every device
    reduce: Literal["flat", "hierarchical"] = "hierarchical"
    mean: bool = True  # average gradients over devices (True) or sum them (False)
    # Where parameters and optimizer state live (nljax/engine/strategy.py): replicated | zero1 | fsdp.
    strategy: Literal["replicated", "zero1", "fsdp"] = "replicated"
    # Skip a level's update (on every device) whose synchronized gradient is not finite; the other
    # levels of the step still update.
    check_grads: bool = True
    # Per level: also skip a level's update whose synchronized gradient norm exceeds this (0: off;
    # applies whatever check_grads says).
    max_grad_norm: float = 0.0
    # Link bandwidths in GB/s (gigabytes) per device and direction, for the time projection of
    # `nljax.comm`. Defaults: NVLink 4 on H100 SXM, 900 GB/s bidirectional = 450 GB/s per
    # direction (NVIDIA H100 datasheet); InfiniBand NDR, 400 Gb/s per GPU = 50 GB/s (NVIDIA
    # ConnectX-7 / DGX H100: one 400 Gb/s NIC per GPU).
    intra_bandwidth_gbps: float = 450.0
    inter_bandwidth_gbps: float = 50.0  # across instances (mesh.inter); intra_bandwidth_gbps: inside one

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader
    # (one line naming the key and its value)
    RANGES: ClassVar[dict] = {"max_grad_norm": (0, None, True, None), "intra_bandwidth_gbps": (0, None, False, None),
                              "inter_bandwidth_gbps": (0, None, False, None)}


def pad_to(vec: jax.Array, multiple: int) -> jax.Array:
    extra = (-vec.shape[0]) % multiple
    return jnp.pad(vec, (0, extra)) if extra else vec


def reduce_scatter_intra(vec: jax.Array, intra: int) -> jax.Array:
    """Stage 1+2 of the hierarchical reduction: this device's summed 1/intra shard.  # [ceil(N/intra)]"""
    padded = pad_to(vec, intra)  # [intra * ceil(N/intra)]
    shard = jax.lax.psum_scatter(padded, INTRA, scatter_dimension=0, tiled=True)  # [ceil(N/intra)]
    return jax.lax.psum(shard, INTER)


def all_gather_intra(shard: jax.Array, n: int) -> jax.Array:
    """Stage 3: reassemble the full vector from the intra shards and drop the padding.  # [N]"""
    return jax.lax.all_gather(shard, INTRA, axis=0, tiled=True)[:n]


def reduce(vec: jax.Array, how: str, mean: bool, intra: int, n_devices: int) -> jax.Array:
    """Sum (or mean) of `vec` over every data-parallel device; identical result on all of them."""
    if how == "flat":
        out = jax.lax.psum(vec, DATA_AXES)
    elif how == "hierarchical":
        out = all_gather_intra(reduce_scatter_intra(vec, intra), vec.shape[0])
    else:
        raise ValueError(f"unknown sync.reduce '{how}'")
    return out / n_devices if mean else out


def shard_intra(vec: jax.Array, how: str, mean: bool, intra: int, n_devices: int) -> jax.Array:
    """ZeRO-1: the summed (or mean) 1/intra shard of `vec` this device's `intra` index owns, the
    same on every `inter` instance.  # [ceil(N/intra)]

    `hierarchical`: reduce-scatter over `intra`, all-reduce of the shard over `inter`.
    `flat`: one all-reduce over both axes, then this device's shard is sliced locally (the flat
    DDP reduction; only the optimizer is sharded)."""
    if how == "hierarchical":
        out = reduce_scatter_intra(vec, intra)
    elif how == "flat":
        full = pad_to(jax.lax.psum(vec, DATA_AXES), intra)
        size = full.shape[0] // intra
        out = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(INTRA) * size, size)
    else:
        raise ValueError(f"unknown sync.reduce '{how}'")
    return out / n_devices if mean else out


def shard_all(vec: jax.Array, how: str, mean: bool, inter: int, intra: int) -> jax.Array:
    """FSDP: the summed (or mean) shard of `vec` owned by this device, shard k = inter_index *
    intra + intra_index of the vector padded to a multiple of inter*intra (the order of an
    array split over `DATA_AXES`).  # [ceil(N/(inter*intra))]

    `hierarchical`: reduce-scatter over `intra` (full data, fast links), then over `inter` (1/intra
    of the data, slow links). `flat`: one reduce-scatter over both axes at once."""
    n = inter * intra
    padded = pad_to(vec, n)  # [n * S]
    if how == "hierarchical":
        s = padded.shape[0] // n
        # Reorder so that intra index j's block holds the shards (i * intra + j for every i): the
        # intra reduce-scatter then hands it exactly the shards of its column, in `inter` order.
        blocks = padded.reshape(inter, intra, s).transpose(1, 0, 2).reshape(-1)  # [intra * inter * S]
        col = jax.lax.psum_scatter(blocks, INTRA, scatter_dimension=0, tiled=True)  # [inter * S]
        out = jax.lax.psum_scatter(col, INTER, scatter_dimension=0, tiled=True)  # [S]
    elif how == "flat":
        out = jax.lax.psum_scatter(padded, DATA_AXES, scatter_dimension=0, tiled=True)  # [S]
    else:
        raise ValueError(f"unknown sync.reduce '{how}'")
    return out / n if mean else out
