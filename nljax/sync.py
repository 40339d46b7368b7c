"""Gradient reductions over the data axes, called inside `shard_map`.

Each active CMS level is reduced as one flat buffer (one collective per level, like a DDP bucket
aligned to the level), so the compiled HLO shows exactly which level moved how many bytes.

- `flat`: one all-reduce over both data axes.
- `hierarchical` (seed 003): reduce-scatter over `intra` (fast links, full data), all-reduce over
  `inter` on the 1/intra shard each device owns (slow links, small data), all-gather over `intra`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nljax.mesh import DATA_AXES, INTER, INTRA


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
