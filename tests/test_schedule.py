"""The learning-rate schedules (`optim.schedule`): cosine as optax computes it, linear and
warmup-stable-decay (wsd) at the steps that define them, each the same with train.steps traced
(the compiled step takes it as an input), and the settings' bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nljax import config
from nljax.engine import optim


def lrs(overrides, total=100, steps=None):
    cfg = config.load(None, [f"train.steps={total}", *overrides]).optim
    fn = optim.schedule(cfg, total)
    steps = np.arange(total + 1) if steps is None else np.asarray(steps)
    return np.array([float(fn(jnp.int32(s))) for s in steps])


@pytest.mark.parametrize("warm", [0, 10])
def test_cosine_is_optax_and_ends_at_min_lr_ratio(warm):
    got = lrs(["optim.lr=0.5", f"optim.warmup_steps={warm}"])
    ref = optax.warmup_cosine_decay_schedule(0.0, 0.5, warm, 100, 0.05) if warm else \
        optax.cosine_decay_schedule(0.5, 100, 0.1)
    np.testing.assert_allclose(got, [float(ref(s)) for s in range(101)], rtol=1e-6)
    ended = lrs(["optim.lr=0.5", f"optim.warmup_steps={warm}", "optim.min_lr_ratio=0.0"])
    assert ended[-1] == pytest.approx(0.0, abs=1e-7) and ended[warm] == pytest.approx(0.5)


def test_linear_decays_in_a_straight_line():
    got = lrs(["optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=linear", "optim.min_lr_ratio=0.2"])
    np.testing.assert_allclose(got[:11], np.arange(11) / 10, rtol=1e-6)  # the warm-up
    np.testing.assert_allclose(got[10:], 1 - 0.8 * np.arange(91) / 90, rtol=1e-6, atol=1e-7)


def test_wsd_holds_the_peak_then_decays_over_the_last_fraction():
    got = lrs(["optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=wsd", "optim.decay_fraction=0.2",
               "optim.min_lr_ratio=0.0"])
    np.testing.assert_allclose(got[10:81], 1.0)  # stable until the last 20 steps of 100
    np.testing.assert_allclose(got[80:], 1 - np.arange(21) / 20, atol=1e-7)
    # a longer run (train.steps raised on resume) moves the decay to its new end
    longer = lrs(["optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=wsd", "optim.decay_fraction=0.2"], 200)
    assert longer[100] == 1.0 and longer[160] == 1.0 and longer[200] == pytest.approx(0.1)
    # a decay longer than what follows the warm-up starts right after it
    short = lrs(["optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=wsd", "optim.decay_fraction=1.0"], 20)
    np.testing.assert_allclose(short[10:], 1 - 0.9 * np.arange(11) / 10, rtol=1e-6)


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "constant"])
def test_a_traced_train_steps_gives_the_same_rates(name):
    cfg = config.load(None, ["train.steps=50", f"optim.schedule={name}", "optim.warmup_steps=5"]).optim
    traced = jax.jit(lambda total, s: optim.schedule(cfg, total)(s))
    static = optim.schedule(cfg, 50)
    for s in (0, 3, 5, 20, 41, 49, 50):
        assert float(traced(jnp.int32(50), jnp.int32(s))) == pytest.approx(float(static(jnp.int32(s))), rel=1e-6)


@pytest.mark.parametrize("setting,message", [
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio"), ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio"),
    ("optim.decay_fraction=0", "optim.decay_fraction"), ("optim.decay_fraction=1.2", "optim.decay_fraction"),
    ("optim.schedule=wsdd", "optim.schedule"),
])
def test_bad_settings_are_one_line(setting, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [setting])
