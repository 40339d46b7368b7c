"""What a frozen CMS level keeps on each device, and what crosses devices when it fires.

`cms.frozen_grads: accumulate` keeps a rank-local error buffer per level with period > 1;
`cms.accumulate` says what it holds:

- `gradients`: the sum of the level's local gradients since it last fired ([N_l]). At the firing
  the sum plus the current gradient is reduced as one vector and the optimizer takes ONE step on
  it: θ ← θ − η f(Σ_t g_t). With SGD f is the identity, so this is the paper's θ ← θ − Σ_t η g_t;
  with Adam it is one Adam step (one moment update) per period.
- `updates`: every step's local gradient in its own slot ([(C_l − 1) · N_l]). At the firing the
  C_l per-step gradients are reduced together (one collective over a [C_l, N_l] stack) and the
  optimizer runs on them in order with the parameters held, moving them once by
  Σ_t η_t f_t(g_t): the paper's sum of an arbitrary optimizer's per-step outputs.

Why `updates` buffers gradients and not lr·direction: a frozen level's per-step gradient exists
only on its own device (it moves zero bytes), and one reduction at the firing can only produce
Σ_d F(local data of d). For N devices to train exactly like one device (and for the optimizer
state to stay identical everywhere) F must therefore be linear in each step's gradient. Adam's
direction is not (it divides by √v, v quadratic in g): a device-local Adam would give
per-device moments and a result that depends on how rows are split. The per-step synchronized
gradients are the least that the exact rule needs, so they are what is kept. The price: C_l − 1
vectors of N_l floats per device instead of one, and C_l · N_l floats reduced when the level fires
(still zero while it is frozen). With SGD, a constant learning rate and no weight decay both
modes give the same parameters (up to float summation order).

Buffers stay 2-D, [n_devices, width], so checkpoints and elastic resume treat both modes alike:
redistributing Σ_d e_d keeps every slot's next reduction unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nljax.parallel.mesh import MODEL


def slots(eng, l: int) -> int:
    """Synchronized gradients one firing of level l feeds the optimizer: its period under
    `updates`, 1 otherwise."""
    if eng.buffered(l) and eng.cfg.cms.accumulate == "updates":
        return eng.cfg.cms.periods[l]
    return 1


def width(eng, l: int) -> int:
    """Floats per device in level l's error buffer: N_l, or (C_l − 1) · N_l under `updates`."""
    return eng.flats[l].size * max(slots(eng, l) - 1, 1)


def steps_of(step: jax.Array, k: int) -> jax.Array:
    """The global step of each of the k gradients a level synchronizes at `step`, oldest first.  # [k]
    Negative entries (a level firing before it has been frozen C_l − 1 times, i.e. at step 0)
    are slots no step wrote; the update skips them."""
    return step - (k - 1) + jnp.arange(k)


def finite(eng, g: jax.Array) -> jax.Array:
    """Whether a level's local gradient is finite; under tensor parallelism on every shard of
    it (a 4-byte flag over `model`, so all shards keep or drop their parts alike)."""
    ok = jnp.all(jnp.isfinite(g))
    if eng.tp > 1:
        ok = jax.lax.psum((~ok).astype(jnp.int32), MODEL) == 0
    return ok


def fold(eng, active: tuple[bool, ...], grads: tuple, err_buf: tuple, step: jax.Array):
    """Per level: the local gradients to synchronize, [K_l, N_l] (active levels, buffer folded
    in), and the new error buffers (frozen levels add their gradient, rank-local; fired levels
    reset). Under `gradients` a frozen level's non-finite local gradient is left out on this
    device: it would poison the sum until the level fires (a rank-local decision, like the buffer
    itself). Under `updates` it is kept in its own slot: that slot's synchronized gradient is then
    non-finite on every device and `step.keep_grads` skips it, as a synchronized step's (left
    out, the slot held zeros here and the other devices' share elsewhere, and the optimizer
    stepped on that)."""
    check = eng.cfg.sync.check_grads
    to_sync, new_buf = {}, list(err_buf)
    for l in range(eng.n_levels):
        if grads[l] is None or not eng.flats[l].size:  # not computed, or a level with no parameters
            continue
        g = eng.flats[l].ravel(grads[l])  # [N_l]
        k = slots(eng, l)
        if active[l]:
            if not eng.buffered(l):
                to_sync[l] = g[None]  # [1, N_l]
            elif k == 1:
                to_sync[l] = (g + err_buf[l][0])[None]  # [1, N_l]
            else:
                to_sync[l] = jnp.concatenate([err_buf[l][0].reshape(k - 1, g.shape[0]), g[None]])  # [C_l, N_l]
            if eng.buffered(l):
                new_buf[l] = jnp.zeros_like(err_buf[l])
        elif eng.buffered(l):
            if k == 1:
                acc = err_buf[l] + g[None]  # [1, N_l], rank-local, never communicated
            else:  # frozen at step s: s % C_l is 1 .. C_l − 1, slot s % C_l − 1
                slot = (step % eng.cfg.cms.periods[l] - 1) * g.shape[0]
                acc = jax.lax.dynamic_update_slice(err_buf[l], g[None], (0, slot))  # [1, (C_l − 1) N_l]
            new_buf[l] = jnp.where(finite(eng, g), acc, err_buf[l]) if check and k == 1 else acc
    return to_sync, tuple(new_buf)
