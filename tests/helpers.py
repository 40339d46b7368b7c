"""Shared test plumbing: build a run on the first n devices and step it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from nljax import config
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
