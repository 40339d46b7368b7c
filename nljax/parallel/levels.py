"""Assignment of parameters to CMS levels, and the pytree plumbing around it.

A model declares a level for each parameter path; everything that is not part of a CMS MLP
level (embeddings, attention, memory projections, norms, head) is level 0. The step splits the
parameter tree into one subtree per level (leaves of other levels become None, which JAX treats
as an empty subtree) so that gradients, error buffers, optimizer states and collectives are all
handled per level. Splitting and merging happen at trace time and cost nothing at run time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def path_str(path) -> str:
    """'block0/cms1/up/kernel': a dict's keys, a sequence's indices and an attribute's name (a
    NamedTuple's or a dataclass pytree's fields: '.embed' before), as checkpoints name them."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def assign(params: PyTree, level_of: Callable[[str], int], n_levels: int) -> PyTree:
    """A tree of ints (same structure as params) giving each leaf's level."""

    def one(path, _):
        level = int(level_of(path_str(path)))  # a numpy integer too (nljax.models.registry.check_model)
        if not 0 <= level < n_levels:
            raise ValueError(f"parameter {path_str(path)} assigned to level {level}, but only {n_levels} exist")
        return level

    return jax.tree_util.tree_map_with_path(one, params)


def split(tree: PyTree, level_tree: PyTree, n_levels: int) -> tuple[PyTree, ...]:
    """One subtree per level; leaves belonging to other levels are None."""
    return tuple(
        jax.tree.map(lambda lv, x, l=l: x if lv == l else None, level_tree, tree) for l in range(n_levels)
    )


def merge(parts: tuple[PyTree, ...], level_tree: PyTree) -> PyTree:
    """Inverse of `split`."""
    flat_levels, treedef = jax.tree.flatten(level_tree)
    leaves_per_level = [iter(jax.tree.leaves(p)) for p in parts]
    return jax.tree.unflatten(treedef, [next(leaves_per_level[lv]) for lv in flat_levels])


@dataclasses.dataclass(frozen=True)
class LevelFlat:
    """One level's leaves as one flat float32 vector and back (pytree order, like ravel_pytree)."""

    treedef: Any  # of the level's subtree (other levels' leaves are None)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @classmethod
    def of(cls, part: PyTree) -> "LevelFlat":
        leaves, treedef = jax.tree.flatten(part)
        return cls(treedef, tuple(tuple(x.shape) for x in leaves), tuple(np.dtype(x.dtype) for x in leaves))

    @property
    def size(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    def ravel(self, part: PyTree) -> jax.Array:  # [N]
        leaves = jax.tree.leaves(part)
        if not leaves:
            return jnp.zeros((0,), jnp.float32)
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])

    def unravel(self, vec: jax.Array) -> PyTree:
        out, offset = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = math.prod(shape)
            out.append(vec[offset : offset + n].reshape(shape).astype(dtype))
            offset += n
        return jax.tree.unflatten(self.treedef, out)


@dataclasses.dataclass(frozen=True, eq=False)
class LevelLayout:
    """How a model's parameter pytree splits into CMS levels, and each level into one flat vector:
    everything a strategy needs to know about the parameters, fixed for a run."""

    shapes: PyTree  # the model's parameter pytree as ShapeDtypeStructs
    level_tree: PyTree  # same structure, an int level per leaf
    flats: tuple[LevelFlat, ...]  # per level: its leaves as one flat vector and back
    decay_tree: PyTree = None  # same structure, a bool per leaf: optim.weight_decay applies (None: to every one)

    @classmethod
    def of(cls, shapes: PyTree, level_of: Callable[[str], int], n_levels: int,
           decays: Callable[[str], bool] | None = None) -> "LevelLayout":
        """`decays(path)`: whether weight decay applies to a parameter (None: to every one)."""
        level_tree = assign(shapes, level_of, n_levels)
        decay_tree = None if decays is None else jax.tree_util.tree_map_with_path(
            lambda path, _: bool(decays(path_str(path))), shapes)
        if decay_tree is not None and all(jax.tree.leaves(decay_tree)):
            decay_tree = None  # nothing to mask
        return cls(shapes, level_tree, tuple(LevelFlat.of(p) for p in split(shapes, level_tree, n_levels)),
                   decay_tree)

    @property
    def n_levels(self) -> int:
        return len(self.flats)

    def split(self, tree: PyTree) -> tuple[PyTree, ...]:
        return split(tree, self.level_tree, self.n_levels)

    def merge(self, parts) -> PyTree:
        return merge(tuple(parts), self.level_tree)

    def decays(self, l: int) -> PyTree | None:
        """Level l's subtree of weight-decay multipliers (1.0 or 0.0 per leaf), as the replicated
        parameters are laid out; None where every parameter decays (nothing to mask)."""
        if self.decay_tree is None:
            return None
        return jax.tree.map(lambda d: 1.0 if d else 0.0, self.split(self.decay_tree)[l])

    def decay_mask(self, l: int, idx: jax.Array) -> jax.Array | None:
        """Per position `idx` of level l's flat vector (`LevelFlat`, as the sharded strategies lay
        it out): 1.0 where the parameter decays, else 0.0; None where every parameter decays.
        Built from the positions, a few comparisons per entry (not a stored [N] constant, which
        would sit in every compiled step)."""
        if self.decay_tree is None:
            return None
        ranges, offset = [], 0  # [lo, hi) of the decaying leaves, neighbours joined
        for shape, d in zip(self.flats[l].shapes, jax.tree.leaves(self.split(self.decay_tree)[l])):
            n = math.prod(shape)
            if d and ranges and ranges[-1][1] == offset:
                ranges[-1][1] = offset + n
            elif d:
                ranges.append([offset, offset + n])
            offset += n
        mask = jnp.zeros(idx.shape, bool)
        for lo, hi in ranges:
            mask = mask | ((idx >= lo) & (idx < hi))
        return mask.astype(jnp.float32)


def level_sizes(params: PyTree, level_tree: PyTree, n_levels: int) -> list[tuple[int, int]]:
    """(number of parameters, bytes) per level."""
    out = []
    for part in split(params, level_tree, n_levels):
        leaves = jax.tree.leaves(part)
        out.append(
            (
                int(sum(np.prod(x.shape) for x in leaves)),
                int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)),
            )
        )
    return out


def describe(params: PyTree, level_tree: PyTree, periods: tuple[int, ...]) -> str:
    """The table printed at start: parameters and bytes per level."""
    lines = ["level  period      params        bytes"]
    sizes = level_sizes(params, level_tree, len(periods))
    for l, (n, b) in enumerate(sizes):
        lines.append(f"{l:5d}  {periods[l]:6d}  {n:10,d}  {b:11,d}")
    empty = [str(l) for l, (n, _) in enumerate(sizes) if n == 0]
    if empty:  # a model without CMS levels under the default periods: they cost compiled variants
        one = len(empty) == 1
        line = (f"level{'' if one else 's'} {', '.join(empty)} hold{'s' if one else ''} no parameters (the model's "
                f"level_of puts none there): {'its period changes' if one else 'their periods change'} nothing")
        kept = len(periods) - len(empty)
        if empty == [str(l) for l in range(kept, len(periods))]:  # the last ones: fewer periods say the same
            line += f"; a new run with cms.periods={list(periods[:kept])} would do the same in fewer compiled step variants"
        lines.append(line)
    return "\n".join(lines)
