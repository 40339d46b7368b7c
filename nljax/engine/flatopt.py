"""Optimizer state over each level's flat vector, split over devices: what `zero1` and `fsdp`
keep (`nljax.engine.strategy`).

A level's leaves in pytree order form one float32 vector, padded with zeros to a multiple of the
shard count. Padding is inert: its gradient is zero, so an elementwise optimizer (Adam, SGD, Lion)
leaves it at zero; every optimizer in `nljax.engine.optim` is elementwise. `FlatOptState` converts the
per-level optax state that `replicated` keeps (the canonical layout) to and from this one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nljax.engine.optim import Optimizer
from nljax.parallel.mesh import MODEL, REPLICATED
from nljax.parallel.tp import Shards


def padded(n: int, shards: int) -> int:
    """`n` rounded up to a multiple of `shards`."""
    return -(-n // shards) * shards


def _vector_slots(fn, flat_state, other):
    """Maps `fn` over the vector slots of a flat optimizer state (one [Np] array per
    parameter-shaped entry, e.g. Adam's mu and nu) paired with the matching subtree of `other`;
    scalar slots (step counts) are taken from `other` unchanged."""
    return jax.tree.map(lambda f, o: fn(o) if len(f.shape) == 1 else o, flat_state, other)


class FlatOptState:
    """Optimizer state as optax state over each level's flat vector, padded to a multiple of the
    devices on `axes` and split over them (zero1: `intra`; fsdp: both data axes). Held by the
    sharded strategies; converts to and from the per-level pytree state `Replicated` keeps.
    Under tensor parallelism each `model` shard has its own vector (`tp.Shards`): globally they
    lie end to end, split over (`model`, *axes)."""

    def __init__(self, mesh: Mesh, levels: tuple[Shards, ...], opt: Optimizer, axes: tuple[str, ...]):
        self.mesh, self.levels, self.opt, self.axes = mesh, levels, opt, axes
        self.shards = math.prod(mesh.shape[a] for a in axes)
        self.spec = P((MODEL, *axes))

    def leaf_spec(self, x) -> P:
        """Vector leaves (a level's flat parameters or moments) are split; scalars (step counts)
        stay replicated."""
        return self.spec if len(x.shape) == 1 else REPLICATED

    def template(self, l: int):
        n = self.levels[l].padded(self.shards)
        return jax.eval_shape(self.opt.init, jax.ShapeDtypeStruct((n,), jnp.float32))

    def from_canonical(self, opt_state: tuple) -> tuple:
        out = []
        for l, tree_state in enumerate(opt_state):
            ravel = lambda sub, sh=self.levels[l]: sh.ravel(sub, self.shards)
            out.append(_vector_slots(ravel, self.template(l), tree_state))
        return tuple(out)

    def to_canonical(self, opt_state: tuple) -> tuple:
        return tuple(_vector_slots(lambda v, sh=sh: sh.unravel(v, self.mesh), flat_state, flat_state)
                     for sh, flat_state in zip(self.levels, opt_state))
