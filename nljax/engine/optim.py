"""Per-level optimizers.

Each CMS level has its own optimizer state, touched only when the level fires. The learning-rate
schedule is indexed by the global step (not by the level's own update count), so a slow level
does not sit in warm-up for thousands of steps; `optim.level_lr_scale` multiplies it per level.
`optim.lr_scaling` rescales the peak learning rate from the batch it was tuned for
(`optim.base_batch_size`) to the global batch of the run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import optax

from nljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Config section `optim`: the per-level optimizer and its learning-rate schedule."""

    # the update rule, one optimizer state per CMS level: adamw; sgd (optim.momentum); or lion
    # (Chen et al. 2023: the sign of a b1/b2 blend of momentum and gradient, each step of size lr):
    # Lion wants a learning rate about 3-10x smaller than AdamW's and a weight decay as much larger
    name: Literal["adamw", "sgd", "lion"] = "adamw"
    lr: float = 3e-3  # peak learning rate (before optim.lr_scaling and optim.level_lr_scale)
    level_lr_scale: tuple[float, ...] = ()  # per-level multiplier; empty means 1 for every level
    warmup_steps: int = 20  # linear warm-up from 0 to the peak over these steps
    # after the warm-up, to optim.min_lr_ratio x the peak at train.steps: cosine or linear decay;
    # wsd: constant, then linear decay over the last optim.decay_fraction of the steps; or constant
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # the learning rate at train.steps, as a fraction of the peak (not constant)
    decay_fraction: float = 0.2  # wsd: the last fraction of train.steps that decays (after the warm-up)
    weight_decay: float = 0.0  # decoupled weight decay (AdamW), times the learning rate
    # what weight decay applies to: weights (the model's `decays`; by default flax's kernel and
    # embedding leaves, not biases, norm scales or an initial memory) or all parameters
    decay_params: Literal["weights", "all"] = "weights"
    # adamw: the first-moment decay; lion: the momentum's weight in the update's sign (sgd: refused)
    b1: float = 0.9
    b2: float = 0.99  # adamw: the second-moment decay; lion: the momentum's decay (optax's 0.99; sgd: refused)
    # sgd: the momentum's decay (optax.trace: m = g + momentum m, the step lr m); 0: plain SGD and no
    # optimizer state; sgd's alone (adamw's and lion's momentum is b1: refused with them)
    momentum: float = 0.0
    nesterov: bool = False  # sgd with momentum: the step lr (g + momentum m), Nesterov's look-ahead
    # Adam's epsilon, added to the root of the second moment (optax's default; MaxText's adam_eps,
    # torch's AdamW eps): larger values damp the update of parameters with tiny gradients; above 0,
    # or a zero gradient (a parameter no token reaches) would divide 0 by 0; adamw's alone (sgd, lion: refused)
    eps: float = 1e-8
    # an exponential moving average of the parameters (NeMo's, Composer's, MeanFlow's EMA), what
    # evaluation, samples, nljax.evaluate/generate/export/lm_eval and nljax.load read: per step
    # a <- ema_decay a + (1 - ema_decay) p, from the initial parameters; a level of period C,
    # whose parameters hold still between its updates, takes its C steps at once at each update
    # (a <- ema_decay^C a + (1 - ema_decay^C) p). Its horizon is about 1 / (1 - ema_decay) steps,
    # for every level; kept with the optimizer state (as sharded). 0: off
    ema_decay: float = 0.0
    clip_norm: float = 0.0  # clip each active level's synchronized gradient by its own norm; 0: off
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # lr x (B/B0) or x sqrt(B/B0), B = train.batch_size
    base_batch_size: int = 16  # B0: the global batch that optim.lr was tuned for

    # (low, high, low inclusive, high inclusive) of float fields, checked by the config loader
    RANGES: ClassVar[dict] = {"lr": (0, None, False, None), "weight_decay": (0, None, True, None),
                              "b1": (0, 1, True, False), "b2": (0, 1, True, False),
                              "momentum": (0, 1, True, False), "eps": (0, None, False, None),
                              "ema_decay": (0, 1, True, False),
                              "clip_norm": (0, None, True, None),
                              "min_lr_ratio": (0, 1, True, True), "decay_fraction": (0, 1, False, True)}

    def check(self) -> None:
        if any(v < 0 for v in self.level_lr_scale):
            raise ConfigError(f"optim.level_lr_scale entries must be >= 0, got {list(self.level_lr_scale)}")
        if self.clip_norm < 0:
            raise ConfigError(f"optim.clip_norm must be >= 0 (0: off), got {self.clip_norm}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= 2**31 - 1:  # the schedule's warmup_steps + 1 is an int32 on the devices
            raise ConfigError(f"optim.warmup_steps must be < 2^31 - 1, got {self.warmup_steps:,}")
        if self.base_batch_size < 1:
            raise ConfigError(f"optim.base_batch_size must be >= 1, got {self.base_batch_size}")
        # torch's SGD(momentum=...) habit on another optimizer would be silently unused (and, as a
        # key a resume must match, a refusal later): said now
        if self.name != "sgd" and (self.momentum or self.nesterov):
            raise ConfigError(f"optim.momentum and optim.nesterov are sgd's: {self.name}'s momentum is optim.b1")
        if self.nesterov and not self.momentum:
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0 (plain SGD has no look-ahead)")
        # likewise adamw's b1, b2 and eps where the rule reads none of them (lion reads b1 and b2)
        unread = [k for k in UNREAD.get(self.name, ()) if getattr(self, k) != getattr(OptimConfig, k)]
        if unread:
            raise ConfigError(f"optim.{unread[0]} is not read by optim.name={self.name} ({READERS[unread[0]]})")


# The settings of `OptimConfig` an update rule does not read (`update_direction`), and who does.
UNREAD = {"sgd": ("b1", "b2", "eps"), "lion": ("eps",)}
READERS = {"b1": "adamw's and lion's; sgd's is optim.momentum", "b2": "adamw's and lion's",
           "eps": "Adam's epsilon: adamw's alone"}


def peak_lr(cfg: OptimConfig, batch_size: int) -> float:
    """`optim.lr` scaled to the global batch: linear (Goyal et al.) or square root (for Adam-like
    optimizers) in batch_size / base_batch_size; unchanged with `lr_scaling: none`."""
    ratio = batch_size / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def schedule(cfg: OptimConfig, total_steps, batch_size: int | None = None):
    """The learning rate by global step: a linear warm-up from 0, then `optim.schedule` (cosine or
    linear decay to `min_lr_ratio` x the peak at `total_steps`; wsd, warmup-stable-decay: the peak,
    then a linear decay to that over the last `decay_fraction` of `total_steps`; or constant).
    `total_steps` (train.steps) may be a traced value: the compiled step takes it as an input, so
    a run with another train.steps runs (and loads from the compile cache) the same executables.
    The cosine is optax's `warmup_cosine_decay_schedule`'s arithmetic, whose decay length must be
    static; its end at 10% is the one nljax always had, bit for bit."""
    lr = cfg.lr if batch_size is None else peak_lr(cfg, batch_size)
    warm = cfg.warmup_steps
    if cfg.schedule == "constant":
        return optax.linear_schedule(0.0, lr, warm) if warm else optax.constant_schedule(lr)
    decay = jnp.maximum(total_steps, warm + 1)
    ratio = cfg.min_lr_ratio
    alpha = lr * ratio / lr if warm else ratio  # optax's end_value / peak_value: not exactly the ratio for every lr

    def cosine(count, length):  # optax.cosine_decay_schedule(lr, length, alpha)
        count = jnp.minimum(count, length)
        return lr * ((1 - alpha) * (0.5 * (1 + jnp.cos(jnp.pi * count / length))) + alpha)

    def linear(count, length):  # from the peak at 0 to the end at `length`, then held
        return lr * (1 - (1 - ratio) * jnp.minimum(count, length) / length)

    def wsd(count, length):  # the peak, then `linear` over the last decay_fraction of the steps
        span = jnp.clip(jnp.ceil(cfg.decay_fraction * decay), 1, length)
        return linear(jnp.maximum(count - (length - span), 0), span)

    after = {"cosine": cosine, "linear": linear, "wsd": wsd}[cfg.schedule]
    if not warm:
        return lambda count: after(count, decay)
    ramp = optax.linear_schedule(0.0, lr, warm)
    return lambda count: jnp.where(count < warm, ramp(count), after(count - warm, decay - warm))


def update_direction(cfg: OptimConfig) -> optax.GradientTransformation:
    """The update direction without learning rate (the schedule is applied by `apply_steps`)."""
    if cfg.name == "adamw":
        return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if cfg.name == "sgd":
        # momentum 0 keeps the stateless identity, so plain SGD's state (and checkpoints) stay empty
        return optax.trace(cfg.momentum, cfg.nesterov) if cfg.momentum else optax.identity()
    if cfg.name == "lion":
        return optax.scale_by_lion(b1=cfg.b1, b2=cfg.b2)
    raise ValueError(f"unknown optimizer {cfg.name}")


def state_vectors(cfg: OptimConfig) -> int:
    """How many parameter-sized vectors each level's optimizer state holds (its counts aside):
    the update rule's, and the average of optim.ema_decay."""
    return {"adamw": 2, "lion": 1, "sgd": 1 if cfg.momentum else 0}[cfg.name] + bool(cfg.ema_decay)


def level_scales(cfg: OptimConfig, n_levels: int) -> tuple[float, ...]:
    return cfg.level_lr_scale or (1.0,) * n_levels


def clip(grads: jax.Array, norms: jax.Array, max_norm: float) -> jax.Array:
    """Each row of `grads` [K, S] (one level's synchronized gradients) scaled down to norm
    `max_norm` by its own norm `norms` [K] (computed over the full, unsharded vector); 0: off.
    Per level, so a slow level's large summed gradient cannot shrink a fast level's update."""
    if max_norm <= 0:
        return grads
    return grads * jnp.minimum(1.0, max_norm / (norms + 1e-6))[:, None]


def apply_steps(tx: optax.GradientTransformation, grads, oks, opt_state, params, lrs, weight_decay: float,
                decays=None):
    """A level's update from K gradients taken at the same parameters (every leaf of `grads`
    has a leading K axis; `oks` [K] bool, `lrs` [K]): the optimizer runs on them in order and the
    parameters move once, by Σ_k lr_k (u_k + wd d θ). `decays`: d, a tree like `params` of 0/1
    multipliers (scalars, or vectors over a flat one), None for 1 everywhere. A gradient whose
    `ok` is False changes neither the optimizer state nor the parameters. K = 1 is one ordinary
    step, bit for bit. Returns (new params, new optimizer state)."""
    if decays is None:
        decays = jax.tree.map(lambda p: 1.0, params)

    def one(carry, x):
        opt_state, total = carry
        g, ok, lr = x
        updates, new_state = tx.update(g, opt_state, params)
        delta = jax.tree.map(lambda p, u, d: jnp.where(ok, lr * (u + weight_decay * d * p), 0), params, updates, decays)
        keep = lambda new, old: jnp.where(ok, new, old)
        return (jax.tree.map(keep, new_state, opt_state), jax.tree.map(jnp.add, total, delta)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    if oks.shape[0] == 1:
        (opt_state, total), _ = one((opt_state, zeros), jax.tree.map(lambda x: x[0], (grads, oks, lrs)))
    else:
        (opt_state, total), _ = jax.lax.scan(one, (opt_state, zeros), (grads, oks, lrs))
    return jax.tree.map(lambda p, d: p - d, params, total), opt_state


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A level's update rule as the strategies apply it: the direction and the weight decay of
    `optim` (the learning rate comes per step from the schedule), and the parameters' moving
    average where `ema_decay` > 0. Its state is the update rule's (optax's), or with the average
    the pair (that state, the average: a tree like the parameters, or a vector over a flat one),
    so that every layout, checkpoint and conversion of the optimizer state carries the average."""

    tx: optax.GradientTransformation
    weight_decay: float
    # per level, the average's decay at each of its updates: optim.ema_decay ** its period (the
    # steps it stood still); empty: no average
    ema: tuple[float, ...] = ()

    @classmethod
    def of(cls, cfg: OptimConfig, periods: tuple[int, ...] = ()) -> "Optimizer":
        ema = tuple(cfg.ema_decay**p for p in periods) if cfg.ema_decay else ()
        return cls(update_direction(cfg), cfg.weight_decay, ema)

    def init(self, params):
        state = self.tx.init(params)
        # the average starts at the initial parameters (a copy: never the same buffer)
        return (state, jax.tree.map(jnp.array, params)) if self.ema else state

    def apply(self, grads, oks, opt_state, params, lrs, decays=None, level: int = 0):
        """`apply_steps` with this optimizer: (new params, new optimizer state); level `level`'s
        average moves toward the new parameters where any of the K gradients updated them."""
        if not self.ema:
            return apply_steps(self.tx, grads, oks, opt_state, params, lrs, self.weight_decay, decays)
        state, average = opt_state
        new, state = apply_steps(self.tx, grads, oks, state, params, lrs, self.weight_decay, decays)
        d, moved = self.ema[level], jnp.any(oks)
        average = jax.tree.map(lambda a, p: jnp.where(moved, d * a + (1 - d) * p, a), average, new)
        return new, (state, average)


def average_of(opt_state: tuple) -> tuple:
    """Each level's moving average from its optimizer state (`Optimizer`'s pair)."""
    return tuple(pair[1] for pair in opt_state)
