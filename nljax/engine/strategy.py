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

The sharded strategies work on one flat float32 vector per level, padded to a multiple of the
shard count; their optimizer state is a `FlatOptState` (`nljax/engine/flatopt.py`).

Frozen levels run no collective in `replicated` and `zero1`. In `fsdp` every level's parameters
must be gathered for the forward pass, frozen or not (that is what sharding parameters costs);
a frozen level's gradient, error buffer and optimizer shard are still never communicated. The
error buffer stays the device's full-size local gradient in every strategy: reduce-scattering it
at every step would move a frozen level's bytes, so FSDP keeps N_l floats per device per
buffered level (the memory report counts them).

Each strategy is an object built once per run (`make_strategy`) with what it needs: the mesh,
the run's `LevelLayout`, `sync` and the optimizer. Its methods take only the data they work on;
the step calls them and contains no strategy branches. A strategy also owns its layout: the
PartitionSpecs of the stored parameters and optimizer state, `gather_params`, and
`export_state` / `import_state`, which convert a state to and from the canonical layout (the
`replicated` one, mesh-independent): checkpoints and elastic resume use it.

Under tensor parallelism (`mesh.model` = m > 1, `nljax/parallel/tp.py`) each device holds a model shard:
its level vectors are built from its own shards (the `Shards` of a level), so everything above
applies per shard over the data axes only: a level's gradient is reduced over `inter` x `intra`
among the devices holding the same shard, and a frozen level still moves zero bytes. Globally a
sharded strategy's vector is the m shard vectors end to end, split over (`model`, data axes).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nljax.config import Config
from nljax.engine import sync
from nljax.engine.flatopt import FlatOptState
from nljax.engine.optim import Optimizer, average_of
from nljax.engine.state import TrainState
from nljax.engine.sync import SyncConfig
from nljax.parallel.levels import LevelLayout
from nljax.parallel.mesh import DATA_AXES, INTER, INTRA, MODEL, REPLICATED, data_size, replicated
from nljax.parallel.tp import Split, split_specs

# Per-device error buffers: rows over the data axes, one block per model shard.
PER_DEVICE = P(DATA_AXES, MODEL)

PyTree = Any


def _named(mesh: Mesh, specs: PyTree) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


class Strategy:
    """Where parameters and optimizer state live (`sync.strategy`), built for one run: the
    per-device pieces the step calls inside `shard_map`, and the layout of the stored state.

    Subclasses define `reduce`, `update` and the conversions to and from the canonical layout,
    and override the defaults (parameters stored as the model's pytree, everything replicated)
    where they store otherwise; the layout methods below are built on those."""

    name: ClassVar[str]
    stat_axes: ClassVar[tuple[str, ...]] = ()  # axes over which the shards of a synchronized gradient differ

    def __init__(self, mesh: Mesh, levels: LevelLayout, sync_cfg: SyncConfig, opt: Optimizer, split: Split):
        self.mesh, self.levels, self.sync_cfg, self.opt, self.tp = mesh, levels, sync_cfg, opt, split
        self.shards = split.shards(levels)  # per level: global pytree <-> m shard vectors
        # The canonical optimizer state (one optax state per level over its global subtree) is
        # split like the parameters it mirrors: compare its global and per-shard shapes.
        init = lambda parts: tuple(jax.eval_shape(opt.init, p) for p in parts)
        self.canonical_opt_specs = split_specs(init(levels.split(split.shapes)), init(levels.split(levels.shapes)),
                                               split.m)
        self._average = None  # `average_params`' compiled function

    # Layout conversions, global view (run under jit, outside shard_map).
    def from_canonical(self, params: PyTree, opt_state: tuple) -> tuple[PyTree, tuple]:
        raise NotImplementedError

    def to_canonical(self, params: PyTree, opt_state: tuple) -> tuple[PyTree, tuple]:
        raise NotImplementedError

    # Per-device pieces, inside shard_map. By default parameters are stored as the model's pytree.
    def compute_params(self, stored: PyTree) -> PyTree:
        """The model's parameter pytree for the forward pass."""
        return stored

    def split(self, stored: PyTree) -> tuple:
        """Stored parameters, one entry per level."""
        return self.levels.split(stored)

    def merge(self, parts: tuple) -> PyTree:
        return self.levels.merge(parts)

    def reduce(self, g: jax.Array) -> jax.Array:
        """A level's flat local gradient [N_l] -> the synchronized gradient this device updates
        with (full, or its shard)."""
        raise NotImplementedError

    def update(self, l: int, gs: jax.Array, stored_part, opt_state, lrs, oks) -> tuple[Any, Any]:
        """Level l's new stored parameters and optimizer state from its K synchronized gradients
        `gs` [K, full or shard] (`optim.apply_steps`; K = 1 except under `cms.accumulate: updates`)."""
        raise NotImplementedError

    def sync_level(self, g: jax.Array) -> jax.Array:
        """A level's K local gradients [K, N_l] -> synchronized [K, N_l or shard], as one
        collective (one reduce-scatter / all-reduce / all-gather chain) whatever K is."""
        if g.shape[0] == 1:
            return self.reduce(g[0])[None]
        return jax.vmap(self.reduce)(g)

    def own(self, vec: jax.Array) -> jax.Array:
        """This device's part of a level's full local vector [N_l]: the part its synchronized
        gradient covers (all of it, or its shard of the padded vector)."""
        return vec

    def decay_mask(self, l: int) -> jax.Array | None:
        """Weight decay's 0/1 multiplier over this device's part of level l's flat vector (`own`);
        None where every parameter decays."""
        return self.levels.decay_mask(l, self.own(jnp.arange(self.levels.flats[l].size)))

    def level_norms(self, synced: dict) -> dict:
        """Per active level, the norm of each of its synchronized gradients ([K_l]), identical on
        every device. Where each device holds a shard, the squared sums of all levels cross
        `stat_axes` together as one small vector (one all-reduce); `replicated` needs no
        collective. Under tensor parallelism the sums also cross `model`, each replicated
        parameter weighted 1/m (every shard holds a copy), so the norm is the global one."""
        m = self.tp.m
        weight = lambda l: self.shards[l].weights(self.own(jnp.arange(self.levels.flats[l].size))) if m > 1 else 1.0
        sq = {l: jnp.sum(jnp.square(g) * weight(l), axis=1) for l, g in synced.items()}  # [K_l] each
        axes = self.stat_axes + ((MODEL,) if m > 1 else ())
        if sq and axes:
            total = jax.lax.psum(jnp.concatenate(list(sq.values())), axes)  # [Σ K_l]
            offsets = np.cumsum([0] + [v.shape[0] for v in sq.values()])
            sq = {l: total[offsets[i] : offsets[i + 1]] for i, l in enumerate(sq)}
        return {l: jnp.sqrt(v) for l, v in sq.items()}

    # Specs of the stored parameters and optimizer state; by default the model's pytree (split
    # over `model` where tensor parallelism splits it, replicated otherwise) and the canonical
    # optimizer state.
    def param_specs(self, params: PyTree) -> PyTree:
        return self.tp.params

    def opt_specs(self, opt_state: tuple) -> tuple:
        return self.canonical_opt_specs

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs for every leaf of `state` (same structure)."""
        return TrainState(
            step=REPLICATED,
            params=self.param_specs(state.params),
            opt_state=self.opt_specs(state.opt_state),
            err_buf=jax.tree.map(lambda _: PER_DEVICE, state.err_buf),
            memory=self.memory_specs(state.memory),
        )

    def memory_specs(self, memory: PyTree) -> PyTree:
        """Specs of an inner-loop memory: rows over the data axes, heads over `model`."""
        return self.tp.memory if jax.tree.leaves(memory) else memory

    def put_memory(self, memory: PyTree) -> PyTree:
        """A memory (host or single-device arrays) placed where `memory_specs` says."""
        return jax.device_put(memory, _named(self.mesh, self.memory_specs(memory)))

    def state_shardings(self, state: TrainState) -> TrainState:
        return _named(self.mesh, self.state_specs(state))

    def put_state(self, state: TrainState) -> TrainState:
        """Put host or single-device arrays where `state_specs` says they live."""
        return jax.device_put(state, self.state_shardings(state))

    def _layout_shardings(self, params: PyTree, opt_state: tuple) -> tuple[PyTree, tuple]:
        sh = self.state_shardings(TrainState(None, params, opt_state, (), {}))
        return sh.params, sh.opt_state

    def _fresh(self, params: PyTree) -> tuple[PyTree, tuple]:
        canonical_opt = tuple(self.opt.init(p) for p in self.levels.split(params))
        return self.from_canonical(params, canonical_opt)

    def layout_shapes(self) -> tuple[PyTree, tuple]:
        """The structure and shapes of (params, opt_state) in this layout, as ShapeDtypeStructs."""
        return jax.eval_shape(self._fresh, self.tp.shapes)

    def state_layout(self) -> tuple[PyTree, tuple]:
        """The stored (params, opt_state) as ShapeDtypeStructs with their shardings: what a
        restore reads into, allocating nothing (`init_layout`'s, unmade)."""
        shapes = self.layout_shapes()
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                            self._layout_shardings(*shapes))

    def init_layout(self, init: Callable[[jax.Array], PyTree], key: jax.Array) -> tuple[PyTree, tuple]:
        """Fresh (params, opt_state) from the model's `init(key)`, created directly in their
        shardings."""
        out = self._layout_shardings(*self.layout_shapes())
        return jax.jit(lambda key: self._fresh(init(key)), out_shardings=out)(key)

    def averaged(self, opt_state: tuple) -> PyTree:
        """The parameters' moving average (optim.ema_decay, `optim.Optimizer`) from the optimizer
        state, in the stored parameters' layout; global view (under jit). By default the stored
        parameters are the model's pytree, as each level's average is."""
        return self.levels.merge(average_of(opt_state))

    def as_average(self, params: PyTree) -> tuple:
        """`averaged`'s inverse: the stored parameters as each level's average (global view)."""
        return self.levels.split(params)

    def restart_average(self, params: PyTree, opt_state: tuple) -> tuple:
        """`opt_state` with each level's moving average set to `params` (the stored parameters a
        run starts from: checkpoint.init_params' rather than the fresh ones), placed as it was."""
        out = self._layout_shardings(params, opt_state)[1]
        fn = lambda p, o: tuple((s[0], a) for s, a in zip(o, self.as_average(p)))
        return jax.jit(fn, out_shardings=out)(params, opt_state)

    def average_params(self, params: PyTree, opt_state: tuple) -> PyTree:
        """`averaged`, placed as the stored `params` are: what evaluation and sampling read in
        their place (one compilation per run: the layout is the run's)."""
        if self._average is None:
            self._average = jax.jit(self.averaged, out_shardings=self._layout_shardings(params, opt_state)[0])
        return self._average(opt_state)

    def gather_params(self, stored: PyTree) -> PyTree:
        """The model's parameter pytree from the stored layout (e.g. for sampling): whole over the
        data axes, split over `model` as tensor parallelism splits it (`canonical_shardings`)."""
        return stored

    def canonical_shardings(self) -> tuple[PyTree, tuple]:
        """Where the canonical (params, opt_state) live: split over `model` as tensor
        parallelism splits them, replicated over the data axes."""
        return _named(self.mesh, (self.tp.params, self.canonical_opt_specs))

    def export_state(self, state: TrainState) -> TrainState:
        """The state in the canonical layout: params as the model's pytree and optimizer state as
        `replicated` keeps it (one optax state per level over the level's subtree), global arrays
        (split over `model` only); step, error buffers and memory unchanged. Independent of
        strategy and of the data axes."""
        fn = jax.jit(self.to_canonical, out_shardings=self.canonical_shardings())
        params, opt_state = fn(state.params, state.opt_state)
        return state.replace(params=params, opt_state=opt_state)

    def import_state(self, canonical: TrainState) -> TrainState:
        """Inverse of `export_state` for this strategy and mesh: pads, flattens and shards."""
        params, opt_state = jax.device_put((canonical.params, canonical.opt_state), self.canonical_shardings())
        shapes = jax.eval_shape(self.from_canonical, params, opt_state)
        fn = jax.jit(self.from_canonical, out_shardings=self._layout_shardings(*shapes))
        params, opt_state = fn(params, opt_state)
        step = jax.device_put(canonical.step, replicated(self.mesh))
        err_buf = jax.device_put(canonical.err_buf, _named(self.mesh, jax.tree.map(lambda _: PER_DEVICE,
                                                                                      canonical.err_buf)))
        memory = self.put_memory(canonical.memory)
        return TrainState(step, params, opt_state, err_buf, memory)

    def import_params(self, canonical: PyTree) -> PyTree:
        """`import_state` of the parameters alone (the model's pytree, as `gather_params` or
        `export_state` give it): a restore that reads no optimizer state converts only them."""
        params = jax.device_put(canonical, self.canonical_shardings()[0])
        stored = lambda p: self.from_canonical(p, ())[0]
        fn = jax.jit(stored, out_shardings=_named(self.mesh, self.param_specs(jax.eval_shape(stored, params))))
        return fn(params)

    def same_layout(self, saved_strategy: str, saved: Mapping[str, Mapping], here: Mapping[str, jax.Array],
                    by_rows: Callable[[str], bool]) -> bool:
        """Whether arrays saved under `saved_strategy` (name -> {"shape", "dtype"}, as checkpoint
        metadata lists them) are stored as this strategy stores `here` (name -> array): then each
        is read straight into place. Arrays split by rows (`by_rows`: error buffers, memory) may
        differ in their leading length, which follows the mesh and the batch, not the layout."""
        if saved_strategy != self.name or set(saved) != set(here):
            return False
        for name, x in here.items():
            lead = 1 if by_rows(name) else 0
            if tuple(saved[name]["shape"])[lead:] != x.shape[lead:] or saved[name]["dtype"] != str(x.dtype):
                return False
        return True


class Replicated(Strategy):
    """Every device holds all parameters and all optimizer state (DDP)."""

    name = "replicated"

    def from_canonical(self, params, opt_state):
        return params, opt_state

    def to_canonical(self, params, opt_state):
        return params, opt_state

    def reduce(self, g):
        c = self.sync_cfg
        return sync.reduce(g, c.reduce, c.mean, self.mesh.shape[INTRA], data_size(self.mesh))

    def update(self, l, gs, stored_part, opt_state, lrs, oks):
        grads = jax.vmap(self.levels.flats[l].unravel)(gs)  # leaves [K, ...]
        return self.opt.apply(grads, oks, opt_state, stored_part, lrs, self.levels.decays(l), level=l)


class Zero1(Strategy):
    """Distributed optimizer (Megatron's, seed 003): optimizer state and the update split over
    `intra`; each `inter` instance holds a full copy; parameters stored as `Replicated` does."""

    name = "zero1"
    stat_axes = (INTRA,)

    def __init__(self, mesh, levels, sync_cfg, opt, split):
        super().__init__(mesh, levels, sync_cfg, opt, split)
        self.flat_opt = FlatOptState(mesh, self.shards, opt, (INTRA,))

    def from_canonical(self, params, opt_state):
        return params, self.flat_opt.from_canonical(opt_state)

    def to_canonical(self, params, opt_state):
        return params, self.flat_opt.to_canonical(opt_state)

    def reduce(self, g):
        c = self.sync_cfg
        return sync.shard_intra(g, c.reduce, c.mean, self.mesh.shape[INTRA], data_size(self.mesh))  # [Np/intra]

    def own(self, vec):
        return _block_of(vec, INTRA, self.mesh.shape[INTRA])  # [Np/intra]

    def update(self, l, gs, stored_part, opt_state, lrs, oks):
        flat = self.levels.flats[l]
        shard, opt_state = self.opt.apply(gs, oks, opt_state, self.own(flat.ravel(stored_part)), lrs,
                                          self.decay_mask(l), level=l)  # [Np/intra]
        new = jax.lax.all_gather(shard, INTRA, axis=0, tiled=True)[: flat.size]  # [N]
        return flat.unravel(new), opt_state

    def opt_specs(self, opt_state):
        return jax.tree.map(self.flat_opt.leaf_spec, opt_state)

    def averaged(self, opt_state):
        # each level's average is a vector split over `intra`, as its moments are; stored
        # parameters are the model's pytree
        return self.levels.merge(tuple(sh.unravel(v, self.mesh) for sh, v in zip(self.shards, average_of(opt_state))))

    def as_average(self, params):
        return tuple(sh.ravel(p, self.flat_opt.shards) for sh, p in zip(self.shards, self.levels.split(params)))


class FSDP(Strategy):
    """Parameters, gradients and optimizer state split over both data axes; parameters are
    all-gathered for compute, gradients reduce-scattered."""

    name = "fsdp"
    stat_axes = DATA_AXES

    def __init__(self, mesh, levels, sync_cfg, opt, split):
        super().__init__(mesh, levels, sync_cfg, opt, split)
        self.flat_opt = FlatOptState(mesh, self.shards, opt, DATA_AXES)

    def from_canonical(self, params, opt_state):
        k = self.flat_opt.shards
        parts = self.levels.split(params)
        flat = tuple(sh.ravel(p, k) for sh, p in zip(self.shards, parts))  # [m * Np_l] each
        return flat, self.flat_opt.from_canonical(opt_state)

    def to_canonical(self, params, opt_state):
        parts = tuple(sh.unravel(v, self.mesh) for sh, v in zip(self.shards, params))
        return self.levels.merge(parts), self.flat_opt.to_canonical(opt_state)

    def compute_params(self, stored):
        # One all-gather per level (XLA may combine them). Not differentiated: the step
        # reduce-scatters the flat gradient itself, so only active levels' gradients move.
        parts = tuple(
            f.unravel(jax.lax.all_gather(v, DATA_AXES, axis=0, tiled=True)[: f.size])  # [N_l]
            for f, v in zip(self.levels.flats, stored)
        )
        return self.levels.merge(parts)

    def split(self, stored):
        return tuple(stored)

    def merge(self, parts):
        return tuple(parts)

    def reduce(self, g):
        c, m = self.sync_cfg, self.mesh.shape
        return sync.shard_all(g, c.reduce, c.mean, m[INTER], m[INTRA])  # [Np/(inter*intra)]

    def update(self, l, gs, stored_part, opt_state, lrs, oks):
        return self.opt.apply(gs, oks, opt_state, stored_part, lrs, self.decay_mask(l), level=l)

    def own(self, vec):
        return _block_of(vec, DATA_AXES, data_size(self.mesh))  # [Np/n]

    def param_specs(self, params):
        return tuple(self.flat_opt.spec for _ in params)

    def opt_specs(self, opt_state):
        return jax.tree.map(self.flat_opt.leaf_spec, opt_state)

    def gather_params(self, stored):
        fn = jax.jit(lambda p: self.to_canonical(p, ())[0], out_shardings=self.canonical_shardings()[0])
        return fn(stored)

    def averaged(self, opt_state):
        return average_of(opt_state)  # each level's vector, padded and split as its parameters are

    def as_average(self, params):
        return tuple(params)


def _block_of(vec: jax.Array, axes, n: int) -> jax.Array:
    """This device's block of `vec` padded to a multiple of `n`, split over `axes` (n devices)."""
    full = sync.pad_to(vec, n)  # [Np]
    size = full.shape[0] // n
    return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axes) * size, size)


STRATEGIES: dict[str, type[Strategy]] = {"replicated": Replicated, "zero1": Zero1, "fsdp": FSDP}


def make_strategy(cfg: Config, mesh: Mesh, levels: LevelLayout, split: Split) -> Strategy:
    """The `sync.strategy` of `cfg` for a run on `mesh` whose per-device parameters split as
    `levels`, over the tensor-parallel shards `split`."""
    return STRATEGIES[cfg.sync.strategy](mesh, levels, cfg.sync, Optimizer.of(cfg.optim, cfg.cms.periods), split)
