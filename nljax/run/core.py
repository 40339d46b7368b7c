"""A run: what `python -m nljax.train`, `nljax.comm`, `nljax.bench` and the tests build from a
config — mesh, engine, compiled steps and task — and nothing that changes while it trains.

The training state is not part of it: `init_state()` makes a fresh one, and whoever steps it
owns it (each step donates its input, so a state kept here would point at deleted buffers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from nljax.config import Config
from nljax.engine.core import Engine
from nljax.engine.state import TrainState
from nljax.engine.step import StepCache
from nljax.errors import ConfigError
from nljax.measure import budget
from nljax.models import build, registry
from nljax.parallel import mesh as meshlib
from nljax.run import tasks
from nljax.run.tasks import Task


def refuse_x64() -> None:
    """JAX's 64-bit mode, which a user's session may have turned on before nljax, is refused: its
    defaults turn float32 into float64, so a run trained float64 parameters whatever model.dtype
    said, then crashed at its throughput table, and loading a float32 run was "from another model"."""
    if jax.config.jax_enable_x64:
        raise ConfigError("JAX's 64-bit mode is on in this process (jax.config.update('jax_enable_x64', True), or "
                          "JAX_ENABLE_X64 set): nljax's models, steps and checkpoints are built for the dtypes "
                          "model.dtype names, and under it they would run in float64; turn it off first (unset "
                          "JAX_ENABLE_X64, or jax.config.update('jax_enable_x64', False))")


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    cfg: Config
    mesh: jax.sharding.Mesh
    engine: Engine
    cache: StepCache  # the compiled step variants
    task: Task
    # eval.harness_tasks' evaluation (nljax/run/harness.py `attach`, by the trainer); None: none
    harness: Any = None

    @classmethod
    def create(cls, cfg: Config, devices=None, model=None, trains: bool = True, reads_data: bool = True,
               average: bool | None = None) -> "Run":
        """The run of `cfg`; its own `cfg` adds what the data decide (`tasks.resolve`: the
        vocabulary of the user's files), read and checked before anything is built. `model`:
        this model instead of the one `cfg` names (`local`). `trains=False`: the run only uses
        the model (`nljax.run.trained.load`), whose budget has no gradients, optimizer state or
        error buffers (`budget.in_use`), and a text model's data are read as an evaluation reads
        them (`tasks.text_data`: no training split of data.prepared). `reads_data=False`: a text
        model's data are not read (`tasks.LoadedText`); its config.yaml holds what they decided.
        `average`: whether a use reads the parameters' moving average, whose optimizer state its
        budget then counts (None: where optim.ema_decay keeps one; `params=trained` reads none)."""
        refuse_x64()
        if trains:
            tasks.check_trains(cfg)
        cfg = tasks.resolve(cfg, trains) if reads_data else cfg
        mesh = meshlib.make_mesh(cfg.mesh.inter, cfg.mesh.intra, devices, cfg.mesh.model)
        rows = meshlib.check_batch(cfg.train.batch_size, mesh)
        if rows % cfg.train.accum_steps:
            raise ConfigError(
                f"train.accum_steps={cfg.train.accum_steps} does not divide the {rows} rows each device holds "
                f"(train.batch_size={cfg.train.batch_size} over {meshlib.data_size(mesh)} devices)"
            )
        # Refused before anything is allocated (nljax/measure/budget.py): from the config alone first, so
        # that an absurd size never reaches Flax or XLA, then from the exact shapes.
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        available = budget.available_bytes(len(local), local[0] if local else None)
        average = bool(cfg.optim.ema_decay) if average is None else average
        needs = (lambda terms: terms) if trains else (lambda terms: budget.in_use(terms, average))
        if model is None:  # a given model (a tensor-parallel shard) is smaller than its config says
            budget.check(needs(budget.config_floor(cfg, meshlib.data_size(mesh))), available, trains)
        model = build(cfg) if model is None else model
        engine = Engine.create(cfg, model, mesh)
        budget.check(needs(budget.engine_terms(cfg, engine)), available, trains)
        # the registered task decides (register_model(task=)); a model's own attribute is optional
        task = tasks.build(registry.task_of(cfg), cfg, mesh, reads_data, trains)
        return cls(cfg, mesh, engine, StepCache(engine), task)

    def init_state(self) -> TrainState:
        """The state at step 0, from `seed`, placed on the mesh."""
        return self.engine.init_state(jax.random.key(self.cfg.seed), self.cfg.train.batch_size)

    def batch(self, step: int, reset_all: bool = False) -> dict:
        return self.task.batch(step, reset_all=reset_all)

    def model_params(self, state: TrainState):
        """The parameters evaluation and samples read, in the stored layout: the moving average
        where optim.ema_decay is set (`Strategy.average_params`), else the trained ones."""
        if not self.cfg.optim.ema_decay:
            return state.params
        return self.engine.strategy.average_params(state.params, state.opt_state)

    def evaluate(self, params, step: int = 0) -> dict:
        """The task's held-out metrics, and the harness tasks' (eval.harness_tasks) when attached."""
        out = self.task.evaluate(self.cache, params, step)
        if self.harness is not None:
            out.update(self.harness.evaluate(params))
        return out

    def units_per_device(self, batch: dict) -> int:
        """Tokens (or the task's unit) one device processes in a step on `batch`: its data slot's
        rows, shared by the slot's `mesh.model` tensor-parallel devices."""
        rows = jax.tree.leaves(batch)[0].shape[0]
        return rows * self.task.units_per_row // self.engine.mesh_devices

    def local(self) -> "Run":
        """This run's program for one device: the same model (its tensor-parallel shard, with
        no collective, under `mesh.model` > 1), rows per device and optimizer, on a 1-device
        mesh, where every collective disappears (`nljax.run.throughput` times it)."""
        cfg, eng = self.cfg, self.engine
        local = dataclasses.replace(
            cfg,
            train=dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size // eng.n_devices),
            mesh=dataclasses.replace(cfg.mesh, inter=1, intra=1, model=1),
        )
        shard = eng.model.tensor_parallel(eng.tp, None) if eng.tp > 1 else None
        return Run.create(local, devices=jax.local_devices()[:1], model=shard)
