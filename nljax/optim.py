"""Per-level optimizers.

Each CMS level has its own optimizer state, touched only when the level fires. The learning-rate
schedule is indexed by the global step (not by the level's own update count), so a slow level
does not sit in warm-up for thousands of steps; `optim.level_lr_scale` multiplies it per level.
`optim.lr_scaling` rescales the peak learning rate from the batch it was tuned for
(`optim.base_batch_size`) to the global batch of the run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from nljax.config import OptimConfig


def peak_lr(cfg: OptimConfig, batch_size: int) -> float:
    """`optim.lr` scaled to the global batch: linear (Goyal et al.) or square root (for Adam-like
    optimizers) in batch_size / base_batch_size; unchanged with `lr_scaling: none`."""
    ratio = batch_size / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def schedule(cfg: OptimConfig, total_steps: int, batch_size: int | None = None):
    """Warm-up (linear from 0) then cosine decay to 10% of the peak, or constant, by global step."""
    lr = cfg.lr if batch_size is None else peak_lr(cfg, batch_size)
    warm = max(cfg.warmup_steps, 0)
    if cfg.schedule == "constant":
        return optax.linear_schedule(0.0, lr, warm) if warm else optax.constant_schedule(lr)
    decay = max(total_steps, warm + 1)
    return optax.warmup_cosine_decay_schedule(0.0, lr, warm, decay, end_value=lr * 0.1) if warm else (
        optax.cosine_decay_schedule(lr, decay, alpha=0.1)
    )


def direction(cfg: OptimConfig) -> optax.GradientTransformation:
    """The update direction without learning rate (the schedule is applied by `apply`)."""
    if cfg.name == "adamw":
        return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2)
    if cfg.name == "sgd":
        return optax.identity()
    raise ValueError(f"unknown optimizer {cfg.name}")


def level_scales(cfg: OptimConfig, n_levels: int) -> tuple[float, ...]:
    return cfg.level_lr_scale or (1.0,) * n_levels


def clip_by_global_norm(grads, max_norm: float):
    """Clip a list of gradient vectors jointly; returns (clipped, norm before clipping)."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads)) if grads else jnp.zeros(())
    if max_norm <= 0:
        return grads, norm
    factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return [g * factor for g in grads], norm


def apply(tx: optax.GradientTransformation, grad, opt_state, params, lr, weight_decay: float):
    """One update of one level: returns (new params, new optimizer state)."""
    updates, opt_state = tx.update(grad, opt_state, params)
    new = jax.tree.map(lambda p, u: p - lr * (u + weight_decay * p), params, updates)
    return new, opt_state
