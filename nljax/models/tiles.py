"""The 2-D building blocks both Pallas kernels (memory_kernel, attention_kernel) compute with:
matrix products with float32 accumulation in the three orientations a kernel needs without a
transpose (Triton lowers `dot_general` with these contractions directly), and a tile's rows
marked aligned for Triton."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def dot(a, b):  # [m, k] @ [k, n]
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_t(a, b):  # [m, k] @ [n, k]^T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def t_dot(a, b):  # [k, m]^T @ [k, n]
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def tile(i, size: int):
    """Rows i * size .. (i + 1) * size - 1 of a block: tile (or chunk) i, its start marked a
    multiple of `size` for Triton."""
    return pl.ds(pl.multiple_of(i * size, size), size)
