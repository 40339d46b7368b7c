"""Shared test plumbing: build a run on the first n devices and step it."""

from __future__ import annotations

import jax
import numpy as np

from nljax import config
from nljax.conductor import pulse
from nljax.trainer import Setup, host_sum

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


def make(overrides=(), inter=1, intra=1) -> Setup:
    cfg = config.load(None, [*TINY, *overrides, f"mesh.inter={inter}", f"mesh.intra={intra}"])
    return Setup.create(cfg, devices=jax.devices()[: inter * intra])


def run_steps(setup: Setup, steps: int, batch_fn=None):
    """Train `steps` steps; returns (losses, final state)."""
    state, losses = setup.state, []
    for s in range(steps):
        p = pulse(s, setup.cfg.cms.periods)
        batch = setup.batch(s) if batch_fn is None else batch_fn(setup, s)
        state, m = setup.cache.train(p.active, state, batch)
        losses.append(host_sum(m["loss_sum"]) / host_sum(m["count"]))
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
