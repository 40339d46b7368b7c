"""Tensor parallelism over the mesh axis `model` (Megatron-style, inside `shard_map`).

A model run with `mesh.model = m` is built twice (`Model.tensor_parallel`): its global form,
whose `init` gives the parameters every mesh shares (what checkpoints store), and its local form,
whose `apply` runs on one device's shards: 1/m of the attention heads, of the memory heads and of
every MLP's hidden width (and of the DiT's adaLN outputs). The local form marks the edges of its
split regions with Megatron's two operators, f and g, and a third:

- `enter(x)` where a replicated activation enters a split region (before a column-parallel
  layer): identity forward; the backward pass sums the cotangent over `model`, so that
  everything upstream (norms, the residual stream, the embedding) gets its full gradient,
  identical on every shard.
- `leave(y)` where a split region ends (after a row-parallel layer): all-reduce over `model`
  forward; identity backward.
- `gather(y)` where a column-parallel output is needed whole (the DiT's adaLN modulation, which
  acts on the replicated residual stream): all-gather over `model` forward; backward each shard
  keeps its own block of the cotangent.

One `leave` per attention, memory and MLP sub-block forward, one `enter` sum backward: Megatron's
count (the DiT adds one small `enter` and `gather` per block for its modulation). A replicated
parameter used inside a split region (a norm scale shared by all memory heads) goes through
`enter` too, so its gradient is also summed over the shards.

The operators are linear maps with a stated transpose (`jax.custom_derivatives.linear_call`),
not `custom_vjp` functions: forward-mode AD pushes tangents through them as through any linear
map (identity, sum, gather: what the forward pass does), so MeanFlow's `jax.jvp` runs on a split
DiT, and reverse mode, also of a `jvp`, uses the transposes above (remat and scan too; `vmap`
over them is not supported: `linear_call` has no batching rule). The step's `shard_map` runs
with `check_vma=False`, where JAX's own transpose of `psum` is another `psum` (every shard's
cotangent taken as its own); Megatron's f and g instead take the cotangent of a replicated
value as one value held by every shard, which is what these transposes say.

Which axis of a parameter is split is not listed anywhere: `split_specs` compares the global
shapes with the local ones (the dimension that shrank by m is split over `model`). Parameters
are split in contiguous blocks, so the global array is the same whatever m is; that is what lets
an elastic resume change `mesh.model`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import linear_call
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nljax.parallel.levels import LevelFlat
from nljax.parallel.mesh import MODEL

PyTree = Any


def _enter(x, axis):
    return linear_call(lambda _, t: t, lambda _, ct: jax.lax.psum(ct, axis), (), x)


def _leave(x, axis):
    return linear_call(lambda _, t: jax.lax.psum(t, axis), lambda _, ct: ct, (), x)


def _gather(x, axis):
    def own(_, ct):  # this shard's block of the whole
        n = x.shape[-1]
        return jax.lax.dynamic_slice_in_dim(ct, jax.lax.axis_index(axis) * n, n, axis=-1)

    return linear_call(lambda _, t: jax.lax.all_gather(t, axis, axis=t.ndim - 1, tiled=True), own, (), x)


def enter(x: jax.Array, axis: str | None) -> jax.Array:
    """Megatron's f: identity forward, sum over `axis` backward (no-op without an axis)."""
    return x if axis is None else _enter(x, axis)


def leave(x: jax.Array, axis: str | None) -> jax.Array:
    """Megatron's g: sum over `axis` forward, identity backward (no-op without an axis)."""
    return x if axis is None else _leave(x, axis)


def gather(x: jax.Array, axis: str | None, m: int) -> jax.Array:
    """The `m` shards' blocks of a column-parallel output, laid end to end on the last dimension,
    whole on every shard (all-gather forward; backward each shard keeps its own block of the
    cotangent, which is the same on every shard). Without an axis (a shard model traced for its
    shapes, or run without collectives to time one device's compute), `m` copies of the block:
    the whole's shape."""
    if axis is None:
        return x if m == 1 else jnp.concatenate([x] * m, axis=-1)
    return _gather(x, axis)


def split_dim(global_shape, local_shape, m: int) -> int | None:
    """The one dimension split over `model` (global = m x local there), or None."""
    diff = [i for i, (g, l) in enumerate(zip(global_shape, local_shape)) if g != l]
    if not diff:
        return None
    if len(diff) > 1 or len(global_shape) != len(local_shape) or global_shape[diff[0]] != m * local_shape[diff[0]]:
        raise ValueError(f"a tensor-parallel shard {tuple(local_shape)} is not 1/{m} of {tuple(global_shape)} "
                         "along one dimension")
    return diff[0]


def split_specs(global_tree: PyTree, local_tree: PyTree, m: int, lead: tuple = ()) -> PyTree:
    """PartitionSpecs (same structure): `model` on the dimension where a local shard is 1/m of
    the global array, `lead` on the leading dimensions (e.g. the rows of a memory state)."""

    def one(g, l):
        entries = [None] * len(g.shape)
        entries[: len(lead)] = lead
        d = split_dim(g.shape, l.shape, m)
        if d is not None:
            entries[d] = MODEL
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return jax.tree.map(one, global_tree, local_tree)


def is_split(spec: P) -> bool:
    return MODEL in tuple(spec)


@dataclasses.dataclass(frozen=True, eq=False)
class Shards:
    """One CMS level's leaves as `m` flat vectors, one per `model` shard, laid end to end
    (shard-major; each padded to a multiple of `multiple`): the global form of the per-device
    flat vectors the sharded strategies keep, built from and back to the global pytree.

    With m = 1 it is the level's flat vector padded (what `LevelFlat` gives)."""

    flat: LevelFlat  # of one shard's leaves (local shapes)
    specs: tuple  # each leaf's PartitionSpec, in pytree order
    m: int

    @classmethod
    def of(cls, flat: LevelFlat, specs_part: PyTree, m: int) -> "Shards":
        specs = tuple(jax.tree.leaves(specs_part, is_leaf=lambda x: isinstance(x, P)))
        return cls(flat, specs, m)

    def _dims(self):
        return [tuple(s).index(MODEL) if is_split(s) else None for s in self.specs]

    def padded(self, multiple: int) -> int:
        """Length of one shard's padded vector."""
        return -(-self.flat.size // multiple) * multiple

    def ravel(self, part: PyTree, multiple: int) -> jax.Array:  # [m * padded(N_local)]
        # each leaf as m shard pieces (a replicated leaf: the same array in every shard)
        pieces = [[x] * self.m if d is None else jnp.split(x, self.m, axis=d)
                  for x, d in zip(jax.tree.leaves(part), self._dims())]
        out = []
        for k in range(self.m):
            vec = self.flat.ravel([p[k] for p in pieces])
            out.append(jnp.pad(vec, (0, self.padded(multiple) - vec.shape[0])))
        return jnp.concatenate(out) if out else jnp.zeros((0,), jnp.float32)

    def unravel(self, vec: jax.Array, mesh=None) -> PyTree:
        """Inverse of `ravel` (any padding): the level's global subtree. Under jit, `mesh` first
        gathers each shard's vector whole on its `model` devices (without it, XLA's partitioner
        may replicate the vector everywhere to reshape it, and warns)."""
        if mesh is not None and vec.shape[0] % mesh.shape[MODEL] == 0:
            vec = jax.lax.with_sharding_constraint(vec, NamedSharding(mesh, P(MODEL)))
        per = vec.reshape(self.m, -1)[:, : self.flat.size]  # [m, N_local]
        shards = [jax.tree.leaves(self.flat.unravel(per[k])) for k in range(self.m)]  # [m][leaf]
        leaves = []
        for i, d in enumerate(self._dims()):
            pieces = [s[i] for s in shards]
            leaves.append(pieces[0] if d is None else jnp.concatenate(pieces, axis=d))
        return jax.tree.unflatten(self.flat.treedef, leaves)

    def replicated_ranges(self) -> list[tuple[int, int]]:
        """[start, end) of the flat vector's runs of replicated leaves (adjacent ones merged)."""
        out, at = [], 0
        for s, p in zip(self.flat.shapes, self.specs):
            n = math.prod(s)
            if not is_split(p):
                if out and out[-1][1] == at:
                    out[-1] = (out[-1][0], at + n)
                else:
                    out.append((at, at + n))
            at += n
        return out

    def weights(self, idx: jax.Array) -> jax.Array:
        """Per position `idx` of the flat vector: 1 for an entry of a split leaf, 1/m for one of a
        replicated leaf (every shard holds a copy), so Σ weights·x² over the shards counts every
        parameter once. Built from the positions (not a stored [N] constant, which would sit in
        every compiled step)."""
        rep = jnp.zeros(idx.shape, bool)
        for lo, hi in self.replicated_ranges():
            rep = rep | ((idx >= lo) & (idx < hi))
        return jnp.where(rep, 1.0 / self.m, 1.0)


def local_shape(shape, spec: P, m: int) -> tuple[int, ...]:
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    return tuple(n // m if e == MODEL else n for n, e in zip(shape, entries))


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """How a run's model splits over `m` tensor-parallel shards."""

    m: int
    shapes: PyTree  # the global parameter pytree, ShapeDtypeStructs
    params: PyTree  # a PartitionSpec per parameter (`model` on its split dimension, if any)
    memory: PyTree  # a PartitionSpec per inner-loop state leaf (rows over the data axes, heads over `model`)

    @property
    def local_shapes(self) -> PyTree:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(local_shape(x.shape, s, self.m), x.dtype),
                            self.shapes, self.params)

    def shards(self, levels) -> tuple[Shards, ...]:
        """Per level: its leaves as m flat shard vectors and back (`Shards`)."""
        return tuple(Shards.of(f, p, self.m) for f, p in zip(levels.flats, levels.split(self.params)))


def regroup(vec: jax.Array, old: Shards, new: Shards, slots: int) -> jax.Array:
    """A per-device error buffer's content laid out for `old` shards, `slots` vectors per shard
    ([old.m * slots * N_old], shard-major), laid out for `new` ones ([new.m * slots * N_new]):
    each slot goes through the global pytree, so its meaning is unchanged."""
    per = vec.reshape(old.m, slots, -1)  # [m, slots, N]
    out = [new.ravel(old.unravel(per[:, s].reshape(-1)), 1).reshape(new.m, -1) for s in range(slots)]
    return jnp.stack(out, axis=1).reshape(-1)
