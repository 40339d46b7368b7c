"""Layers shared by the language models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn


class MLP(nn.Module):
    """Pre-norm feed-forward block (one CMS level when named `cms<l>`)."""

    dim: int
    hidden: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        h = nn.LayerNorm(dtype=self.dtype, name="norm")(x)
        h = nn.Dense(self.hidden, dtype=self.dtype, name="up")(h)
        h = nn.gelu(h)
        # Zero-init the output so every level starts as the identity: a level that has not
        # fired yet does not perturb the residual stream.
        return nn.Dense(self.dim, dtype=self.dtype, kernel_init=nn.initializers.zeros, name="down")(h)


class CMSChain(nn.Module):
    """k MLP levels applied in sequence, level l named `cms<l>` (its parameters fire every C_l steps)."""

    dim: int
    hidden: int
    levels: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, T, D]
        for l in range(self.levels):
            x = x + MLP(self.dim, self.hidden, self.dtype, name=f"cms{l}")(x)
        return x


def token_loss(logits, targets, mask=None, weight=None):
    """Summed next-token cross-entropy and the token count (the summed weights).  logits [B, T, V],
    targets [B, T], mask [B] (1 for real rows, 0 for padding rows of an evaluation batch), weight
    [B, T] (each target's weight; None: 1)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    if mask is None and weight is None:
        return jnp.sum(nll), jnp.asarray(nll.size, jnp.float32)
    w = jnp.ones_like(nll) if weight is None else weight.astype(jnp.float32)
    if mask is not None:
        w = w * mask.astype(jnp.float32)[:, None]
    return jnp.sum(nll * w), jnp.sum(w)



def token_hits(logits, targets, score):
    """Greedy next-token hits at the scored positions, and how many positions were scored.
    logits [B, T, V], targets [B, T], score [B, T] (1 where the prediction counts, else 0).
    Teacher forced: position t is judged on argmax(logits[t]) whatever the model predicted before."""
    w = score.astype(jnp.float32)
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, T]
    return jnp.sum(hit * w), jnp.sum(w)
