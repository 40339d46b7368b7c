"""The Engine: everything static about a run's step, decided once from the config.

The model, the mesh, how the parameters split into CMS levels (`LevelLayout`), the learning-rate
schedule and the strategy that says where parameters and optimizer state live. The step bodies
(`nljax.step`) read it; the checkpoint code builds one from a saved config to read a state in
that run's layout. `init_state` makes the state at step 0, placed on the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from nljax import frozen, optim
from nljax.config import Config
from nljax.levels import LevelFlat, LevelLayout
from nljax.mesh import data_size
from nljax.models.base import Model
from nljax.state import TrainState
from nljax.strategy import Strategy, make_strategy

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Everything static about a run's step: the model, the mesh and the decided semantics."""

    cfg: Config
    model: Model
    mesh: Mesh
    levels: LevelLayout  # how the parameters split into levels and flat vectors
    lr: Callable[[jax.Array], jax.Array]
    strategy: Strategy  # where params and optimizer state live (`sync.strategy`)

    @property
    def n_levels(self) -> int:
        return len(self.cfg.cms.periods)

    @property
    def n_devices(self) -> int:
        return data_size(self.mesh)

    @property
    def level_tree(self) -> PyTree:  # same structure as params, an int level per leaf
        return self.levels.level_tree

    @property
    def flats(self) -> tuple[LevelFlat, ...]:  # per level: its leaves as one flat vector and back
        return self.levels.flats

    @property
    def param_shapes(self) -> PyTree:  # the model's parameter pytree as ShapeDtypeStructs
        return self.levels.shapes

    @classmethod
    def create(cls, cfg: Config, model: Model, mesh: Mesh) -> "Engine":
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        levels = LevelLayout.of(shapes, model.level_of, len(cfg.cms.periods))
        lr = optim.schedule(cfg.optim, cfg.train.steps, cfg.train.batch_size)
        return cls(cfg, model, mesh, levels, lr, make_strategy(cfg, mesh, levels))

    def buffered(self, level: int) -> bool:
        """Whether level `level` keeps a rank-local error buffer."""
        return self.cfg.cms.frozen_grads == "accumulate" and self.cfg.cms.periods[level] > 1

    def init_state(self, key: jax.Array, rows: int) -> TrainState:
        """Fresh state for `rows` stream rows, placed on the mesh."""
        params, opt_state = self.strategy.init_layout(self.model.init, key)  # already in their shardings
        err_buf = tuple(
            jnp.zeros((self.n_devices, frozen.width(self, l)), jnp.float32) if self.buffered(l) else None
            for l in range(self.n_levels)
        )
        memory = self.model.init_memory(rows)
        state = TrainState(jnp.zeros((), jnp.int32), params, opt_state, err_buf, memory)
        return self.strategy.put_state(state)
