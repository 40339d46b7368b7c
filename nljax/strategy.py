"""Where parameters and optimizer state live, and how a level's gradient reaches them.

| `sync.strategy` | params per device       | optimizer state per device | when level l fires                      |
|-----------------|-------------------------|----------------------------|-----------------------------------------|
| `replicated`    | full model pytree       | full, per-level pytree     | all-reduce (`sync.reduce`), update      |
|                 |                         |                            | everywhere                              |
| `zero1`         | full model pytree       | 1/intra of level l's flat  | reduce-scatter over `intra`, all-reduce |
|                 |                         | vector (each `inter`       | of the shard over `inter`, update the   |
|                 |                         | instance holds a copy)     | shard, all-gather params over `intra`   |
| `fsdp`          | 1/(inter*intra) of each | 1/(inter*intra), same      | params all-gathered for compute (every  |
|                 | level's flat vector     | split                      | level, every step); gradient reduce-    |
|                 |                         |                            | scattered over `intra` then `inter`;    |
|                 |                         |                            | the shard is updated                    |

`mesh.inter` is the number of optimizer instances (seed 003's
`num_distributed_optimizer_instances`), `mesh.intra` the devices in one.

The sharded strategies work on one flat float32 vector per level (the leaves of the level in
pytree order), padded with zeros to a multiple of the shard count. Padding is inert: its
gradient is zero, so an elementwise optimizer (Adam, SGD) leaves it at zero. They therefore
need an elementwise optimizer, which every optimizer in `nljax.optim` is.

Frozen levels run no collective in `replicated` and `zero1`. In `fsdp` every level's parameters
must be gathered for the forward pass, frozen or not (that is what sharding parameters costs);
a frozen level's gradient, error buffer and optimizer shard are still never communicated. The
error buffer stays the device's full-size local gradient in every strategy: reduce-scattering it
at every step would move a frozen level's bytes, so FSDP keeps N_l floats per device per
buffered level (the memory report counts them).

Each strategy is a small object with the same methods; the step calls them and contains no
strategy branches. `export_state` / `import_state` convert a state to and from the canonical
layout (the `replicated` one), which is mesh-independent: checkpoints and elastic resume use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from nljax import levels, optim, sync
from nljax.mesh import DATA_AXES, INTER, INTRA, data_size, replicated, rows_sharding
from nljax.state import TrainState, shardings

PyTree = Any


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


def padded(n: int, shards: int) -> int:
    return -(-n // shards) * shards


def _vector_slots(fn, flat_state, other):
    """Maps `fn` over the vector slots of a flat optimizer state (one [Np] array per
    parameter-shaped entry, e.g. Adam's mu and nu) paired with the matching subtree of `other`;
    scalar slots (step counts) are taken from `other` unchanged."""
    return jax.tree.map(lambda f, o: fn(o) if len(f.shape) == 1 else o, flat_state, other)


class Strategy(Protocol):
    name: str

    def shards(self, mesh) -> int:
        """Into how many pieces a level's flat vector is split (1: not split)."""

    # Layout conversions, global view (run under jit, outside shard_map).
    def from_canonical(self, eng, params: PyTree, opt_state: tuple) -> tuple[PyTree, tuple]: ...

    def to_canonical(self, eng, params: PyTree, opt_state: tuple) -> tuple[PyTree, tuple]: ...

    # Per-device pieces, inside shard_map.
    def compute_params(self, eng, stored: PyTree) -> PyTree:
        """The model's parameter pytree for the forward pass."""

    def split(self, eng, stored: PyTree) -> tuple:
        """Stored parameters, one entry per level."""

    def merge(self, eng, parts: tuple) -> PyTree: ...

    def reduce(self, eng, g: jax.Array) -> jax.Array:
        """A level's flat local gradient [N_l] -> the synchronized gradient this device updates
        with (full, or its shard)."""

    stat_axes: tuple[str, ...]  # axes over which the shards of a synchronized gradient differ

    def update(self, eng, l: int, gs: jax.Array, stored_part, opt_state, lrs, oks) -> tuple[Any, Any]:
        """Level l's new stored parameters and optimizer state from its K synchronized gradients
        `gs` [K, full or shard] (`optim.apply_steps`; K = 1 except under `cms.accumulate: updates`)."""


class Replicated:
    """Every device holds all parameters and all optimizer state (DDP)."""

    name = "replicated"
    stat_axes: tuple[str, ...] = ()

    def shards(self, mesh) -> int:
        return 1

    def from_canonical(self, eng, params, opt_state):
        return params, opt_state

    def to_canonical(self, eng, params, opt_state):
        return params, opt_state

    def compute_params(self, eng, stored):
        return stored

    def split(self, eng, stored):
        return levels.split(stored, eng.level_tree, eng.n_levels)

    def merge(self, eng, parts):
        return levels.merge(tuple(parts), eng.level_tree)

    def reduce(self, eng, g):
        c = eng.cfg.sync
        return sync.reduce(g, c.reduce, c.mean, eng.mesh.shape[INTRA], eng.n_devices)

    def update(self, eng, l, gs, stored_part, opt_state, lrs, oks):
        grads = jax.vmap(eng.flats[l].unravel)(gs)  # leaves [K, ...]
        return optim.apply_steps(eng.tx, grads, oks, opt_state, stored_part, lrs, eng.cfg.optim.weight_decay)


class _FlatOptimizer:
    """Optimizer state as optax state over each level's padded flat vector (zero1, fsdp)."""

    def _flat_opt_template(self, eng, l: int):
        n = padded(eng.flats[l].size, self.shards(eng.mesh))
        return jax.eval_shape(eng.tx.init, jax.ShapeDtypeStruct((n,), jnp.float32))

    def _opt_from_canonical(self, eng, opt_state):
        out = []
        for l, tree_state in enumerate(opt_state):
            k = self.shards(eng.mesh)
            flat = eng.flats[l]
            out.append(_vector_slots(lambda sub: sync.pad_to(flat.ravel(sub), k), self._flat_opt_template(eng, l), tree_state))
        return tuple(out)

    def _opt_to_canonical(self, eng, opt_state):
        out = []
        for l, flat_state in enumerate(opt_state):
            flat = eng.flats[l]
            out.append(_vector_slots(lambda v: flat.unravel(v[: flat.size]), flat_state, flat_state))
        return tuple(out)


class Zero1(_FlatOptimizer, Replicated):
    """Distributed optimizer (Megatron's, seed 003): optimizer state and the update split over
    `intra`; each `inter` instance holds a full copy; parameters stored as `Replicated` does."""

    name = "zero1"
    stat_axes = (INTRA,)

    def shards(self, mesh) -> int:
        return mesh.shape[INTRA]

    def from_canonical(self, eng, params, opt_state):
        return params, self._opt_from_canonical(eng, opt_state)

    def to_canonical(self, eng, params, opt_state):
        return params, self._opt_to_canonical(eng, opt_state)

    def reduce(self, eng, g):
        c = eng.cfg.sync
        return sync.shard_intra(g, c.reduce, c.mean, eng.mesh.shape[INTRA], eng.n_devices)  # [Np/intra]

    def update(self, eng, l, gs, stored_part, opt_state, lrs, oks):
        flat, intra = eng.flats[l], eng.mesh.shape[INTRA]
        size = gs.shape[1]  # Np / intra
        full = sync.pad_to(flat.ravel(stored_part), intra)  # [Np]
        shard = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(INTRA) * size, size)  # [Np/intra]
        shard, opt_state = optim.apply_steps(eng.tx, gs, oks, opt_state, shard, lrs, eng.cfg.optim.weight_decay)
        new = jax.lax.all_gather(shard, INTRA, axis=0, tiled=True)[: flat.size]  # [N]
        return flat.unravel(new), opt_state


class FSDP(_FlatOptimizer):
    """Parameters, gradients and optimizer state split over both data axes; parameters are
    all-gathered for compute, gradients reduce-scattered."""

    name = "fsdp"
    stat_axes = DATA_AXES

    def shards(self, mesh) -> int:
        return data_size(mesh)

    def from_canonical(self, eng, params, opt_state):
        k = self.shards(eng.mesh)
        parts = levels.split(params, eng.level_tree, eng.n_levels)
        flat = tuple(sync.pad_to(eng.flats[l].ravel(p), k) for l, p in enumerate(parts))  # [Np_l] each
        return flat, self._opt_from_canonical(eng, opt_state)

    def to_canonical(self, eng, params, opt_state):
        parts = tuple(f.unravel(v[: f.size]) for f, v in zip(eng.flats, params))
        return levels.merge(parts, eng.level_tree), self._opt_to_canonical(eng, opt_state)

    def compute_params(self, eng, stored):
        # One all-gather per level (XLA may combine them). Not differentiated: the step
        # reduce-scatters the flat gradient itself, so only active levels' gradients move.
        parts = tuple(
            f.unravel(jax.lax.all_gather(v, DATA_AXES, axis=0, tiled=True)[: f.size])  # [N_l]
            for f, v in zip(eng.flats, stored)
        )
        return levels.merge(parts, eng.level_tree)

    def split(self, eng, stored):
        return tuple(stored)

    def merge(self, eng, parts):
        return tuple(parts)

    def reduce(self, eng, g):
        c, m = eng.cfg.sync, eng.mesh.shape
        return sync.shard_all(g, c.reduce, c.mean, m[INTER], m[INTRA])  # [Np/(inter*intra)]

    def update(self, eng, l, gs, stored_part, opt_state, lrs, oks):
        return optim.apply_steps(eng.tx, gs, oks, opt_state, stored_part, lrs, eng.cfg.optim.weight_decay)


STRATEGIES: dict[str, Strategy] = {"replicated": Replicated(), "zero1": Zero1(), "fsdp": FSDP()}


def _canonical_opt_state(eng, params):
    return tuple(eng.tx.init(p) for p in levels.split(params, eng.level_tree, eng.n_levels))


def _fresh_layout(eng, key: jax.Array) -> tuple[PyTree, tuple]:
    params = eng.model.init(key)
    return eng.strategy.from_canonical(eng, params, _canonical_opt_state(eng, params))


def layout_shapes(eng) -> tuple[PyTree, tuple]:
    """The structure and shapes of (params, opt_state) in `eng`'s strategy, as ShapeDtypeStructs."""
    return jax.eval_shape(lambda key: _fresh_layout(eng, key), jax.random.key(0))


def init_layout(eng, key: jax.Array) -> tuple[PyTree, tuple]:
    """Fresh (params, opt_state) in `eng`'s strategy, created directly in their shardings."""
    out = _layout_shardings(eng, *layout_shapes(eng))
    return jax.jit(lambda key: _fresh_layout(eng, key), out_shardings=out)(key)


def _layout_shardings(eng, params, opt_state):
    dummy = TrainState(None, params, opt_state, (), {})
    sh = shardings(dummy, eng.mesh, eng.strategy.name)
    return sh.params, sh.opt_state


def gather_params(eng, stored: PyTree) -> PyTree:
    """The model's parameter pytree, replicated, from the stored layout (e.g. for sampling)."""
    if eng.strategy.name != "fsdp":
        return stored
    rep = replicated(eng.mesh)
    fn = lambda p: eng.strategy.to_canonical(eng, p, ())[0]
    return jax.jit(fn, out_shardings=rep)(stored)


def export_state(eng, state: TrainState) -> TrainState:
    """The state in the canonical layout: params as the model's pytree and optimizer state as
    `replicated` keeps it (one optax state per level over the level's subtree), both replicated;
    step, error buffers and memory unchanged. Independent of strategy and mesh shape."""
    rep = replicated(eng.mesh)
    fn = lambda p, o: eng.strategy.to_canonical(eng, p, o)
    params, opt_state = jax.jit(fn, out_shardings=rep)(state.params, state.opt_state)
    return state.replace(params=params, opt_state=opt_state)


def import_state(eng, canonical: TrainState) -> TrainState:
    """Inverse of `export_state` for `eng`'s strategy and mesh: pads, flattens and shards."""
    rep = replicated(eng.mesh)
    params, opt_state = jax.device_put((canonical.params, canonical.opt_state), rep)
    fn = lambda p, o: eng.strategy.from_canonical(eng, p, o)
    shapes = jax.eval_shape(fn, params, opt_state)
    params, opt_state = jax.jit(fn, out_shardings=_layout_shardings(eng, *shapes))(params, opt_state)
    step = jax.device_put(canonical.step, rep)
    err_buf, memory = jax.device_put((canonical.err_buf, canonical.memory), rows_sharding(eng.mesh))
    return TrainState(step, params, opt_state, err_buf, memory)

