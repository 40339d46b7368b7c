"""The Engine: everything static about a run's step, decided once from the config.

The model (global, and its tensor-parallel shard when `mesh.model` > 1), the mesh, how one
device's parameters split into CMS levels (`LevelLayout`), the learning-rate schedule and the
strategy that says where parameters and optimizer state live. The step bodies
(`nljax.engine.step`) read it; the checkpoint code builds one from a saved config to read a state in
that run's layout. `init_state` makes the state at step 0, placed on the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from nljax.config import Config
from nljax.engine import frozen, optim
from nljax.engine.state import TrainState
from nljax.engine.strategy import Strategy, make_strategy
from nljax.errors import ConfigError
from nljax.models.base import Model, decays_by_name
from nljax.parallel import tp
from nljax.parallel.levels import LevelFlat, LevelLayout
from nljax.parallel.mesh import DATA_AXES, MODEL, data_size, model_size

PyTree = Any


def tensor_parallel(cfg: Config, model: Model, m: int) -> tuple[Model, tp.Split]:
    """`model`'s shard over `m` devices of the `model` axis (the model itself when m = 1) and
    how its parameters and memory split (`tp.Split`), derived from the global and shard shapes."""
    from nljax.models import registry

    key = jax.random.key(0)
    shapes = jax.eval_shape(model.init, key)
    local_model, shard = model, model
    if m > 1 and not hasattr(model, "tensor_parallel"):
        raise ConfigError(f"model.name={cfg.model.name} has no tensor-parallel form: use mesh.model=1")
    memory = lambda mdl: jax.eval_shape(lambda: mdl.init_memory(1))
    # the shard is the model's own code: what it raises is one line, as its build's
    with registry.plugin_code(cfg.model.name, f"its tensor_parallel({m}, ...) shard"):
        if m > 1:
            local_model, shard = model.tensor_parallel(m, MODEL), model.tensor_parallel(m, None)
        split = tp.Split(m, shapes, tp.split_specs(shapes, jax.eval_shape(shard.init, key), m),
                         tp.split_specs(memory(model), memory(shard), m, lead=(DATA_AXES,)))
    return local_model, split


def decays_of(cfg: Config, model: Model) -> Callable[[str], bool] | None:
    """Which parameters `optim.weight_decay` applies to, by path: the model's `decays` (or
    `decays_by_name`) with `optim.decay_params: weights`; None for every one (`all`, or no weight
    decay: the update then compiles as it always did)."""
    if cfg.optim.weight_decay == 0 or cfg.optim.decay_params == "all":
        return None
    return getattr(model, "decays", None) or decays_by_name


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Everything static about a run's step: the model, the mesh and the decided semantics."""

    cfg: Config
    model: Model  # the global model: init, shapes, sampling and export
    mesh: Mesh
    levels: LevelLayout  # how one device's parameters split into levels and flat vectors
    lr: Callable[[jax.Array], jax.Array]
    strategy: Strategy  # where params and optimizer state live (`sync.strategy`)
    local_model: Model  # what runs inside shard_map: `model`, or its tensor-parallel shard
    split: tp.Split  # which parameter and memory dimensions are split over `model`

    @property
    def n_levels(self) -> int:
        return len(self.cfg.cms.periods)

    @property
    def n_devices(self) -> int:  # data-parallel devices (`inter` x `intra`)
        return data_size(self.mesh)

    @property
    def mesh_devices(self) -> int:  # every device of the mesh: data-parallel x tensor-parallel
        return self.mesh.devices.size

    @property
    def level_tree(self) -> PyTree:  # same structure as params, an int level per leaf
        return self.levels.level_tree

    @property
    def flats(self) -> tuple[LevelFlat, ...]:  # per level: its leaves as one flat vector and back
        return self.levels.flats

    @property
    def param_shapes(self) -> PyTree:  # the model's (global) parameter pytree as ShapeDtypeStructs
        return self.split.shapes

    @property
    def tp(self) -> int:
        return self.split.m

    @classmethod
    def create(cls, cfg: Config, model: Model, mesh: Mesh, tp_shards: int | None = None) -> "Engine":
        """`tp_shards`: the tensor-parallel degree the state is laid out for, if not the mesh's
        (a checkpoint saved with another `mesh.model` is read through such an engine)."""
        m = model_size(mesh) if tp_shards is None else tp_shards
        local_model, split = tensor_parallel(cfg, model, m)
        levels = LevelLayout.of(split.local_shapes, model.level_of, len(cfg.cms.periods), decays_of(cfg, model))
        lr = optim.schedule(cfg.optim, cfg.train.steps, cfg.train.batch_size)
        return cls(cfg, model, mesh, levels, lr, make_strategy(cfg, mesh, levels, split), local_model, split)

    def buffered(self, level: int) -> bool:
        """Whether level `level` keeps a rank-local error buffer."""
        return self.cfg.cms.frozen_grads == "accumulate" and self.cfg.cms.periods[level] > 1

    def init_state(self, key: jax.Array, rows: int) -> TrainState:
        """Fresh state for `rows` stream rows, placed on the mesh."""
        params, opt_state = self.strategy.init_layout(self.model.init, key)  # already in their shardings
        err_buf = tuple(
            jnp.zeros((self.n_devices, self.tp * frozen.width(self, l)), jnp.float32) if self.buffered(l) else None
            for l in range(self.n_levels)
        )
        memory = self.model.init_memory(rows)
        state = TrainState(jnp.zeros((), jnp.int32), params, opt_state, err_buf, memory)
        return self.strategy.put_state(state)
