"""Shared test plumbing: build a run on the first n devices and step it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import yaml

from nljax import config
from nljax.checkpoint import storage
from nljax.conductor import pulse
from nljax.hostdev import mean_loss
from nljax.run import Run
from nljax.state import TrainState

# A model small enough that a step variant compiles in seconds on a 2-core CPU.
TINY = [
    "model.name=cms_mlp",
    "model.dim=16",
    "model.depth=1",
    "model.hidden_mult=2",
    "train.batch_size=8",
    "train.seq_len=8",
    "optim.lr=0.01",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]


# TINY with attention and a neural memory (per-row state written across steps) and two CMS levels.
TINY_NL = ["model.name=nl_lm", "model.heads=2", "model.nl_lm.window=8", "model.nl_lm.memory_layers=[0]", "model.nl_lm.memory_heads=2",
           "model.nl_lm.memory_dim=8", "model.nl_lm.memory_hidden=8", "model.nl_lm.memory_chunk=4", "cms.periods=[1,2]"]


@dataclasses.dataclass(eq=False)
class Setup:
    """A run and the state the tests step on from it (a `Run` keeps no state, its steps donate
    it); the run's fields and methods read through."""

    run: Run
    state: TrainState

    @classmethod
    def create(cls, cfg: config.Config, devices=None) -> "Setup":
        run = Run.create(cfg, devices)
        return cls(run, run.init_state())

    def __getattr__(self, name):
        if name == "run":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.run, name)


def make(overrides=(), inter=1, intra=1) -> Setup:
    cfg = config.load(None, [*TINY, *overrides, f"mesh.inter={inter}", f"mesh.intra={intra}"])
    return Setup.create(cfg, devices=jax.devices()[: inter * intra])


def run_steps(setup: Setup, steps: int, batch_fn=None):
    """Train `steps` steps; returns (losses, final state)."""
    state, losses = setup.state, []
    for s in range(steps):
        p = pulse(s, setup.cfg.cms.periods)
        batch = setup.batch(s) if batch_fn is None else batch_fn(setup, s)
        state, m, _ = setup.cache.train(p.active, state, batch)
        losses.append(mean_loss(m))
    setup.state = state
    return np.array(losses), state


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def replicas(x: jax.Array) -> list[np.ndarray]:
    """Each device's own copy of a replicated array."""
    return [np.asarray(s.data) for s in x.addressable_shards]


def saved_run(run_dir: Path, overrides, inter, intra, steps=2):
    """A run directory as nljax.train leaves it (config.yaml, a checkpoint after `steps` steps)."""
    setup = make([*overrides, f"run.dir={run_dir}"], inter, intra)
    _, state = run_steps(setup, steps)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(setup.cfg), sort_keys=False))
    save(setup, state, steps)
    return setup, state


def save(setup: Setup, state: TrainState, step: int) -> None:
    """A checkpoint of `state` after `step` steps in the run's checkpoint.dir, on disk on return."""
    m = storage.writer(setup.cfg)
    storage.save(m, setup.engine, step, state)
    m.wait_until_finished()
    m.close()
