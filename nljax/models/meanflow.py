"""MeanFlow and flow-matching losses, and the samplers, for any velocity network u(z, t, r, y).

Time convention (Geng et al., "Mean Flows for One-step Generative Modeling"): data at t = 0,
noise at t = 1,

    z_t = (1 - t) x + t eps,        v = dz_t/dt = eps - x.

u(z_t, t, r) is the *average* velocity over [r, t], so z_r = z_t - (t - r) u(z_t, t, r) and one
step from noise is z_0 = z_1 - u(z_1, t=1, r=0). The MeanFlow identity

    u(z_t, t, r) = v - (t - r) du/dt,   du/dt = v . d_z u + d_t u   (r held fixed)

gives the regression target: u and du/dt come out of ONE `jax.jvp` of u with tangents
(dz, dt, dr) = (v, 1, 0); the target is stop-gradient. Flow matching is the special case r = t
(target v). Every random draw (noise, t, r, label dropout) comes from a per-example key, so the
loss of a global batch does not depend on how its rows are split over devices.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Literal

import jax
import jax.numpy as jnp

from nljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class MeanFlowConfig:
    """Config section `meanflow`: loss and sampling of the DiT denoiser."""

    loss: Literal["meanflow", "flow_matching"] = "meanflow"  # flow_matching: r = t, target v (for comparison)
    r_fraction: float = 0.25  # fraction of examples with r != t (the rest have r = t)
    time_mu: float = -0.4  # logit-normal (t, r): sigmoid(mu + sigma * N(0, 1))
    time_sigma: float = 1.0  # the sigma of time_mu's logit-normal
    adaptive_p: float = 1.0  # loss weight 1 / (||delta||^2 + c)^p, detached; p = 0: plain squared error
    adaptive_c: float = 1e-3  # the c of adaptive_p's loss weight
    class_cond: bool = True  # condition on labels when the data has them
    label_dropout: float = 0.1  # labels replaced by the null class (classifier-free guidance)
    cfg_omega: float = 1.0  # guided target w v + kappa u_cond + (1 - w - kappa) u_uncond; 1, 0: off
    cfg_kappa: float = 0.0  # the kappa of cfg_omega's guided target
    cfg_t_min: float = 0.0  # guidance applies for t in [cfg_t_min, cfg_t_max]
    cfg_t_max: float = 1.0  # see cfg_t_min
    sample_steps: int = 4  # steps of the multi-step evaluation (one-step is always reported)
    eval_samples: int = 0  # samples per evaluation, for held-out images spread over them; 0: one per held-out image

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader.
    # Guidance: the paper's effective scale is omega / (1 - kappa), so kappa >= 1 has none and
    # omega <= 0 takes out (or reverses) the data's own velocity; both trained before, exit 0.
    # The others here too, so that a refusal names its key and value (check_used named three keys
    # and their rules at once, no value). time_mu: at |mu| = 5 half of the logit-normal draws lie
    # within 0.007 of 0 or of 1 (sigmoid(5) = 0.993); further out almost none lands between data
    # and noise, and at mu = 1e6 every draw is t = r = 1 (it was accepted).
    RANGES: ClassVar[dict] = {"time_mu": (-5, 5, True, True),
                              "cfg_t_min": (0, 1, True, True), "cfg_t_max": (0, 1, True, True),
                              "cfg_omega": (0, None, False, None), "cfg_kappa": (0, 1, True, False),
                              "r_fraction": (0, 1, True, True), "label_dropout": (0, 1, True, False),
                              "time_sigma": (0, None, False, None), "adaptive_p": (0, None, True, None),
                              "adaptive_c": (0, None, False, None)}

    def check(self) -> None:
        if self.eval_samples < 0 or self.eval_samples == 1:
            # the energy distance needs two samples: found here, not after training
            raise ConfigError(f"meanflow.eval_samples must be 0 (all) or >= 2, got {self.eval_samples}")

    def check_used(self) -> None:
        """Rules that apply when a run trains with this section (model.name=dit)."""
        if not 1 <= self.sample_steps <= 1_000:  # one model call each, at every evaluation
            raise ConfigError(f"meanflow.sample_steps must be in [1, 1000], got {self.sample_steps:,}")
        if (self.cfg_omega != 1.0 or self.cfg_kappa != 0.0) and self.label_dropout == 0:
            # the unconditional field is the null label's, which only dropped labels train
            raise ConfigError(f"meanflow.cfg_omega={self.cfg_omega}, cfg_kappa={self.cfg_kappa} mix in the "
                              "unconditional field, which meanflow.label_dropout=0 never trains: set it > 0")
        if self.cfg_t_min > self.cfg_t_max:
            raise ConfigError(f"meanflow.cfg_t_min={self.cfg_t_min} must be <= meanflow.cfg_t_max={self.cfg_t_max}")


# u_fn(z [B, ...], t [B], r [B], y [B] int32 or None) -> u [B, ...]
VelocityFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]

TRAIN_STREAM, EVAL_STREAM = 0, 1  # independent key streams for training draws and sampling noise


def example_keys(seed: int, stream: int, index: jax.Array) -> jax.Array:
    """One key per example from (seed, stream, global example index).  index int32 [B]."""
    base = jax.random.fold_in(jax.random.key(seed), stream)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(index)


def _col(a: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] for broadcasting against [B, ...] arrays of rank `ndim`."""
    return a.reshape(a.shape + (1,) * (ndim - 1))


def draw(key: jax.Array, shape: tuple[int, ...], cfg: MeanFlowConfig):
    """One example's draws: noise [shape], t, r (scalars, r <= t), label dropped (bool).

    t and r are two logit-normal draws, t the larger; with probability 1 - r_fraction r is set
    to t (those examples are plain flow matching, the paper's data proportion)."""
    k_eps, k_tr, k_keep, k_drop = jax.random.split(key, 4)
    eps = jax.random.normal(k_eps, shape)
    a = jax.nn.sigmoid(cfg.time_mu + cfg.time_sigma * jax.random.normal(k_tr, (2,)))
    t, r = jnp.max(a), jnp.min(a)
    r = jnp.where(jax.random.uniform(k_keep) < cfg.r_fraction, r, t)
    drop = jax.random.uniform(k_drop) < cfg.label_dropout
    return eps, t, r, drop


def guided_velocity(u_fn: VelocityFn, z, t, v, y, dropped, null_label: int, cfg: MeanFlowConfig):
    """The paper's guided field (its Sec. 4.2 with the kappa mixing of its appendix):
    v~ = w v + kappa u(z, t, t | y) + (1 - w - kappa) u(z, t, t | null), under stop-gradient,
    for t in [cfg_t_min, cfg_t_max] and kept labels; plain v elsewhere. Both network calls run
    as one batch of 2B rows."""
    b = z.shape[0]
    both = u_fn(
        jnp.concatenate([z, z]), jnp.concatenate([t, t]), jnp.concatenate([t, t]),
        jnp.concatenate([y, jnp.full_like(y, null_label)]),
    )
    u_cond, u_uncond = jax.lax.stop_gradient(both[:b]), jax.lax.stop_gradient(both[b:])
    w, kappa = cfg.cfg_omega, cfg.cfg_kappa
    guided = w * v + kappa * u_cond + (1 - w - kappa) * u_uncond
    on = (~dropped) & (t >= cfg.cfg_t_min) & (t <= cfg.cfg_t_max)
    return jnp.where(_col(on, v.ndim), guided, v)


def meanflow_target(u_fn: VelocityFn, z, t, r, v, y):
    """(u, target, du/dt) from one jvp of u with tangents (v, 1, 0); the target is stop-gradient."""
    u, dudt = jax.jvp(lambda z_, t_, r_: u_fn(z_, t_, r_, y), (z, t, r), (v, jnp.ones_like(t), jnp.zeros_like(r)))
    target = jax.lax.stop_gradient(v - _col(t - r, v.ndim) * dudt)
    return u, target, dudt


def adaptive_loss(delta: jax.Array, cfg: MeanFlowConfig) -> jax.Array:
    """Per-example ||delta||^2 / (||delta||^2 + c)^p, the weight detached.  [B]"""
    sq = jnp.sum(jnp.square(delta).reshape(delta.shape[0], -1), axis=1)
    if cfg.adaptive_p == 0:
        return sq
    return sq * jax.lax.stop_gradient(1.0 / (sq + cfg.adaptive_c) ** cfg.adaptive_p)


def _prepare(u_fn, x, y, keys, cfg, null_label):
    eps, t, r, dropped = jax.vmap(lambda k: draw(k, x.shape[1:], cfg))(keys)
    if y is not None:
        y = jnp.where(dropped, null_label, y)
    tb = _col(t, x.ndim)
    z = (1 - tb) * x + tb * eps
    v = eps - x
    if y is not None and (cfg.cfg_omega != 1.0 or cfg.cfg_kappa != 0.0):
        v = guided_velocity(u_fn, z, t, v, y, dropped, null_label, cfg)
    return z, t, r, v, y


def meanflow_loss(u_fn: VelocityFn, x, y, keys, cfg: MeanFlowConfig, null_label: int = 0) -> jax.Array:
    """Per-example MeanFlow loss.  x [B, ...], y [B] or None, keys [B] -> [B]"""
    z, t, r, v, y = _prepare(u_fn, x, y, keys, cfg, null_label)
    u, target, _ = meanflow_target(u_fn, z, t, r, v, y)
    return adaptive_loss(u - target, cfg)


def flow_matching_loss(u_fn: VelocityFn, x, y, keys, cfg: MeanFlowConfig, null_label: int = 0) -> jax.Array:
    """Per-example flow-matching loss (r = t, target v), same draws and weighting.  [B]"""
    z, t, _, v, y = _prepare(u_fn, x, y, keys, cfg, null_label)
    return adaptive_loss(u_fn(z, t, t, y) - jax.lax.stop_gradient(v), cfg)


LOSSES = {"meanflow": meanflow_loss, "flow_matching": flow_matching_loss}


def sampled_as(trained: str, used: str, where: str) -> str | None:
    """A net trained with meanflow.loss=`trained` (its value in `where`, the run's config.yaml)
    and used with meanflow.loss=`used` (a tool's override: `sample` and the held-out error follow
    it): None when they agree, else a warning line, or a refusal where the other sampler reads
    what the net never learned. The DiT sees h = t - r. The MeanFlow loss trains h = 0 on
    1 - r_fraction of its examples (u(z, t, t) = v), so flow matching's Euler steps of u(z, t, t)
    are a sampler of that net, only not the run's: warned. Flow matching trains h = 0 alone, so
    MeanFlow's steps (h = 1/steps; one step: h = 1) read an h-embedding that never trained:
    refused."""
    if trained == used:
        return None
    if trained == "flow_matching":
        raise ConfigError(f"meanflow.loss={used}: the run trained with meanflow.loss={trained} ({where}), whose net "
                          "never saw r != t, and MeanFlow's sampler asks it for u(z, t, r) over [r, t]: leave "
                          "meanflow.loss out (the run's own sampler)")
    return (f"meanflow.loss={used}: the run trained with meanflow.loss={trained} ({where}); sampling with flow "
            "matching's Euler steps of u(z, t, t), not the run's MeanFlow sampler: the samples and scores are not "
            "the run's")


def sample(u_fn: VelocityFn, z1: jax.Array, y, steps: int, mean_flow: bool = True) -> jax.Array:
    """Noise z_1 -> data z_0 in `steps` uniform steps z_r = z_t - (t - r) u(z_t, t, r).

    With `mean_flow=False` (a flow-matching network, which only knows r = t) each step is an
    Euler step with the instantaneous velocity u(z_t, t, t)."""
    z, b = z1, z1.shape[0]
    for i in range(steps):
        t, r = 1.0 - i / steps, 1.0 - (i + 1) / steps
        tb = jnp.full((b,), t, z.dtype)
        rb = jnp.full((b,), r, z.dtype) if mean_flow else tb
        z = z - (t - r) * u_fn(z, tb, rb, y)
    return z
